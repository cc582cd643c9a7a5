"""OpenAI-compatible HTTP gateway, in the frontend process (``pagedserve serve
--port``, the frontend component's ``--http-port``).

``/v1/completions`` and ``/v1/chat/completions`` (the model's chat template)
are translated into a ``GenerateRequest`` and take the same engine path as
gRPC (validation, admission, stop strings, metrics); ``stream: true`` answers
with server-sent events; batches and ``echo`` in ``http_batch``. Also
``/v1/models``, ``/health`` (200 or 503), ``/metrics`` (with vLLM's names,
``vllm_metrics``) and vLLM's ``/tokenize``, ``/detokenize``, ``/version``
(``http_extras``); those route modules call the gateway through
``http_shared.GatewayApi``, so they never import this one. A body field a
route does not understand is a 400 naming it (``http_fields``). Bodies are
decoded with bounded nesting and finite numbers only (``http_json``); slow,
idle and surplus connections are closed (``http_conn``).
Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import json
import logging
import ssl
import uuid
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.frontend import openai_structured, openai_tools
from pagedserve.frontend.chat_template import has_chat_template, render_chat
from pagedserve.frontend.auth import ApiKeys
from pagedserve.frontend.engine_client import DuplicateRequestId
from pagedserve.frontend import http_batch, http_extras, http_fields, http_json
from pagedserve.frontend.error_table import rejected_api_error
from pagedserve.frontend.errors import ApiError
from pagedserve.frontend.http_conn import ClosingError, ConnectionGuard, HttpLimits, read_body, send_and_close
from pagedserve.frontend.http_fields import CHAT_FIELDS, COMPLETION_FIELDS, check_fields
from pagedserve.frontend.http_shared import Ctx
from pagedserve.frontend.generation import EngineError, GenerationService, Rejected, RequestStream
from pagedserve.frontend.openai_options import OpenAIOptions
from pagedserve.frontend.outputs import Chunk
from pagedserve.frontend.validation import DEFAULT_COMPLETION_MAX_TOKENS, MAX_REQUEST_BYTES, Limits, ValidationError
from pagedserve.v1 import generation_pb2 as pb

log = logging.getLogger("pagedserve.frontend")

# OpenAI body field -> SamplingParams field, for plain scalars.
_SCALARS = {
    "temperature": "temperature", "top_p": "top_p", "n": "n", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    # vLLM-style extras
    "top_k": "top_k", "min_p": "min_p", "min_tokens": "min_tokens", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "include_stop_str_in_output": "include_stop_str_in_output",
    "beam_width": "beam_width", "length_penalty": "length_penalty", "early_stopping": "early_stopping",
    "prompt_logprobs": "prompt_logprobs",
}


# Body fields whose check parses a grammar (tools: the chat route says).
_GRAMMAR_FIELDS = ("response_format", "structured_outputs", *openai_structured.GUIDED)


def _openai_param(field: str) -> str:
    name = field.removeprefix("sampling_params.")
    return {"prompt_token_ids": "prompt", "request": "body"}.get(name, name)


def _set(sp: pb.SamplingParams, name: str, value: Any, param: str) -> None:
    try:
        setattr(sp, name, value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ApiError(400, f"{param}: invalid value {str(value)[:80]} ({e})", param=param) from None


class Gateway:
    def __init__(self, svc: GenerationService, keys: ApiKeys, registry: Any, healthy: Callable[[], bool],
                 served_names: list[str] | None = None, opts: OpenAIOptions | None = None) -> None:
        self.svc = svc
        self.opts = opts or OpenAIOptions()
        self.keys = keys
        self.registry = registry
        self.healthy = healthy
        # /v1/models reports the first; 'model' may be any (or the engine's own name).
        self.served_names = served_names or []
        self.before_metrics: Callable[[], Awaitable[None]] | None = None  # fresh engine gauges per scrape
        self.http_limits = HttpLimits.from_env()
        self.guard = ConnectionGuard(self.http_limits.max_connections)

    # ------------------------------------------------------------ plumbing
    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[self.guard.middleware, self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        http_extras.add_routes(self, app)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if request.path not in ("/health", "/metrics"):
                self._key_id(request)
            return await handler(request)
        except ClosingError as e:
            return await send_and_close(request, e)
        except ApiError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status == 413:
                return ApiError(413, f"body: larger than {MAX_REQUEST_BYTES} bytes", param="body").response()
            return ApiError(e.status, e.reason, code=str(e.status)).response()

    def _key_id(self, request: web.Request) -> str | None:
        if not self.keys.enabled:
            return None
        key = self.keys.identify(request.headers.get("Authorization"))
        if key is None:
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        return key

    def model_name(self) -> str:
        if not self.svc.ready:
            raise ApiError(503, "the engine is still starting", "service_unavailable")
        return self.served_names[0] if self.served_names else self.svc.info.model.model_name

    def _limits(self) -> Limits:
        self.model_name()  # 503 while the engine starts (no vocabulary yet)
        return self.svc.limits

    async def json_body(self, request: web.Request) -> dict[str, Any]:
        raw = await read_body(request, self.http_limits.body_timeout_s)
        if len(raw) > http_json.ON_LOOP_BYTES:  # a 4 MiB body takes ~0.1 s to scan and parse
            body = await self.svc.off_loop(len(raw), http_json.decode_body, raw, request.charset)
        else:
            body = http_json.decode_body(raw, request.charset)
        if not isinstance(body, dict):
            raise ApiError(400, "body: must be a JSON object", param="body")
        model = body.get("model")
        if model is not None and model not in (self.model_name(), *self.served_names,
                                               self.svc.info.model.model_name):
            raise ApiError(404, f"model: {model!r} is not served here (try {self.model_name()!r})",
                           param="model", code="model_not_found")
        return body

    # ------------------------------------------------------------ simple routes
    async def health(self, request: web.Request) -> web.Response:
        ok = self.svc.ready and self.healthy()
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        if self.before_metrics is not None:
            await self.before_metrics()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        name = self.model_name()
        info = self.svc.info.model
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "pagedserve", "max_model_len": info.max_model_len}]})

    # ------------------------------------------------------------ translation
    async def _sampling_off_loop(self, body: dict[str, Any], req: pb.GenerateRequest,
                                 default_max_tokens: int | None, then: Callable[[], None] | None = None,
                                 grammar: bool = False) -> None:
        """``_sampling`` (and ``then``) on the tokenizer thread when the body asks
        for a grammar: its check parses the spec with xgrammar (the first one also
        imports it, 1-2 s), which must not stall the other streams on this loop."""
        def build() -> None:
            self._sampling(body, req, default_max_tokens)
            if then is not None:
                then()

        if grammar or any(body.get(k) is not None for k in _GRAMMAR_FIELDS):
            await self.svc.off_loop(0, build)
        else:
            build()

    def _sampling(self, body: dict[str, Any], req: pb.GenerateRequest, default_max_tokens: int | None) -> None:
        sp = req.sampling_params
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = default_max_tokens
        if max_tokens is not None:
            _set(sp, "max_tokens", max_tokens, "max_tokens")
        for key, name in _SCALARS.items():
            if body.get(key) is not None:
                _set(sp, name, body[key], key)
        if body.get("use_beam_search") and not sp.beam_width:
            sp.beam_width = max(sp.n if sp.HasField("n") else 1, 2)
        best_of = body.get("best_of")
        if best_of is not None and best_of != (sp.n if sp.HasField("n") else 1):
            raise ApiError(400, "best_of: only best_of == n is supported", param="best_of")
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise ApiError(400, "stop: must be a string or a list of strings", param="stop")
            sp.stop.extend(stops)
        # Repeated and map fields cannot be assigned: extended once their ids are known good.
        if body.get("stop_token_ids") is not None:
            sp.stop_token_ids.extend(http_fields.token_ids(body["stop_token_ids"], self._limits(), "stop_token_ids"))
        if body.get("logit_bias") is not None:
            sp.logit_bias.update(http_fields.logit_bias(body["logit_bias"], self._limits()))
        if isinstance(body.get("cache_salt"), str):
            req.cache_salt = body["cache_salt"]
        http_json.check_schema_texts(body)
        try:  # response_format, structured_outputs, guided_*: frontend/openai_structured.py
            openai_structured.apply_structured(body, sp)
        except ValidationError as e:
            raise ApiError(400, str(e), param=e.field) from None

    async def prepare(self, req: pb.GenerateRequest, add_special_tokens: bool = True) -> Any:
        try:
            return await self.svc.prepare_async(req, add_special_tokens)  # tokenizes off the event loop
        except ValidationError as e:
            raise ApiError(400, str(e), param=_openai_param(e.field)) from None

    async def open_stream(self, request: web.Request, prepared: Any) -> RequestStream:
        try:
            return await self.svc.open(prepared, self._key_id(request))
        except Rejected as e:
            raise rejected_api_error(e.reason, str(e)) from None
        except DuplicateRequestId:
            raise ApiError(409, "request id already running", code="duplicate") from None

    def token_str(self, tok: int) -> str:
        return self.svc.detokenize([tok], skip_special_tokens=False)

    # ------------------------------------------------------------ /v1/completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.json_body(request)
        check_fields(body, COMPLETION_FIELDS)
        if body.get("suffix"):
            raise ApiError(400, "suffix: not supported", param="suffix")
        prompts = http_batch.completion_prompts(body.get("prompt"), self._limits())
        reqs = []
        for prompt in prompts:
            req = pb.GenerateRequest()
            http_batch.set_prompt(req, prompt)
            await self._sampling_off_loop(body, req, DEFAULT_COMPLETION_MAX_TOKENS)
            if body.get("logprobs") is not None:
                _set(req.sampling_params, "logprobs", body["logprobs"], "logprobs")
            reqs.append(req)
        if len(reqs) > 1 or body.get("echo"):
            return await http_batch.run_batch(self, request, body, prompts, reqs)
        prepared = await self.prepare(req)
        stream = await self.open_stream(request, prepared)
        ctx = Ctx("cmpl-" + uuid.uuid4().hex, "text_completion", self.model_name(), prepared.prep.params.n)
        return await self._run(request, body, stream, ctx, self.completion_choice)

    def completion_choice(self, c: Chunk, acc: dict[str, Any] | None) -> dict[str, Any]:
        lp = None
        if c.logprobs:
            lp = {"tokens": [self.token_str(t) for t, _ in c.logprobs],
                  "token_logprobs": [e[0] for _, e in c.logprobs],
                  "top_logprobs": [{self.token_str(t): v for t, v in e[1]} for _, e in c.logprobs],
                  "text_offset": []}
        return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    # ------------------------------------------------------------ /v1/chat/completions
    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self.json_body(request)
        check_fields(body, CHAT_FIELDS)
        try:  # messages (tool calls included), tools and tool_choice: frontend/openai_tools.py
            conv = openai_tools.chat_messages(body.get("messages"))
            tool_mode, tools, body = openai_tools.take_tools(body, self.opts)
        except ValidationError as e:
            raise ApiError(400, str(e), param=e.field) from None
        tok = self.svc.tokenizer
        if not has_chat_template(tok):
            raise ApiError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        req = pb.GenerateRequest(prompt=render_chat(tok, conv, tools))
        def enforce_tools() -> None:
            if tool_mode is not None:
                try:
                    openai_tools.enforce(tool_mode, req.sampling_params)
                except ValidationError as e:
                    raise ApiError(400, str(e), param=e.field) from None

        await self._sampling_off_loop(body, req, None, enforce_tools, grammar=tool_mode is not None)
        if body.get("logprobs"):
            _set(req.sampling_params, "logprobs", body.get("top_logprobs") or 0, "top_logprobs")
        # The template already wrote the special tokens it wants.
        prepared = await self.prepare(req, add_special_tokens=False)
        stream = await self.open_stream(request, prepared)
        ctx = Ctx("chatcmpl-" + uuid.uuid4().hex, "chat.completion", self.model_name(), prepared.prep.params.n)
        choice = self._chat_choice if tool_mode is None else openai_tools.choice_formatter(tool_mode, self._chat_logprobs)
        return await self._run(request, body, stream, ctx, choice)

    def _chat_logprobs(self, c: Chunk) -> dict[str, Any] | None:
        if not c.logprobs:
            return None

        def entry(t: int, v: float) -> dict[str, Any]:
            s = self.token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {"content": [{**entry(t, e[0]), "top_logprobs": [entry(a, b) for a, b in e[1]]}
                            for t, e in c.logprobs]}

    def _chat_choice(self, c: Chunk, acc: dict[str, Any] | None) -> dict[str, Any]:
        if acc is None:  # a non-streaming choice
            return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
        delta: dict[str, Any] = {}
        if not acc.get("role_sent"):
            acc["role_sent"] = True
            delta["role"] = "assistant"
        if c.text:
            delta["content"] = c.text
        elif "role" in delta:
            delta["content"] = ""
        return {"index": c.index, "delta": delta, "logprobs": self._chat_logprobs(c),
                "finish_reason": c.finish_reason}

    # ------------------------------------------------------------ shared
    async def _run(self, request: web.Request, body: dict[str, Any], stream: RequestStream, ctx: Ctx,
                   choice: Callable[[Chunk, dict[str, Any] | None], dict[str, Any]]) -> web.StreamResponse:
        try:
            if body.get("stream"):
                return await self._stream(request, body, stream, ctx, choice)
            merged = await stream.collect()
            choices = [choice(merged.get(i, Chunk(i)), None) for i in range(max(ctx.n, len(merged)))]
            return web.json_response({"id": ctx.id, "object": ctx.object, "created": ctx.created,
                                      "model": ctx.model, "choices": choices, "usage": _usage(stream)})
        except EngineError as e:
            raise http_batch.engine_api_error(e) from None
        finally:
            stream.close()

    async def _stream(self, request: web.Request, body: dict[str, Any], stream: RequestStream, ctx: Ctx,
                      choice: Callable[[Chunk, dict[str, Any] | None], dict[str, Any]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        obj = ctx.object + ".chunk" if ctx.object == "chat.completion" else ctx.object
        accs: dict[int, dict[str, Any]] = {}

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        try:
            while (chunks := await stream.next()) is not None:
                # a None choice: nothing to send yet (a tool-call parser holds text back)
                choices = [x for c in chunks if (x := choice(c, accs.setdefault(c.index, {}))) is not None]
                if choices:
                    await send({"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model,
                                "choices": choices})
        except EngineError as e:
            await send(http_batch.engine_error_event(e))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model, "choices": [],
                        "usage": _usage(stream)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _usage(stream: RequestStream) -> dict[str, int]:
    p, c = len(stream.req.prompt_ids), stream.num_completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def start(gateway: Gateway, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> web.AppRunner:
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the request.
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None,
                           **gateway.http_limits.runner_kwargs())
    await runner.setup()
    assert runner.server is not None
    gateway.guard.attach(runner.server)
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner


def ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    return ctx
