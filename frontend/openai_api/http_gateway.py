"""OpenAI-compatible HTTP gateway, in the frontend process (``pagedserve serve
--port``, the frontend component's ``--http-port``).

``/v1/completions`` and ``/v1/chat/completions`` (the model's chat template)
are translated into a ``GenerateRequest`` and take the same engine path as
gRPC (validation, admission, stop strings, metrics); ``stream: true`` answers
with server-sent events; completions (batches, ``echo``) in ``http_batch``,
response bodies in ``http_response``. vLLM 0.32's request extras are read by
``openai_extras`` (a field outside vLLM's models is ignored, as vLLM does);
the server's options (``OpenAIOptions``: response role, chat template,
max_logprobs, generation-config defaults, request logging, CORS, root path)
apply here. Also ``/v1/models``, ``/health`` (200 or 503), ``/metrics`` (with
vLLM's names, ``vllm_metrics``) and vLLM's ``/tokenize``, ``/detokenize``,
``/version`` (``http_extras``); those route modules call the gateway through
``http_shared.GatewayApi``, so they never import this one. Bodies are decoded
with bounded nesting and finite numbers only (``http_json``); slow, idle and
surplus connections are closed (``http_conn``).
Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import logging
import ssl
import uuid
from dataclasses import replace
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.common import request_fields
from pagedserve.frontend.openai_api import http_batch, http_cors, http_extras, http_fields, http_json, http_lax
from pagedserve.frontend.openai_api import openai_extras, openai_structured, openai_tools, server_flags, stop_tokens
from pagedserve.frontend.core.auth import ApiKeys
from pagedserve.frontend.core.chat_template import has_chat_template, render_chat
from pagedserve.frontend.core.engine_client import DuplicateRequestId
from pagedserve.frontend.core.error_table import RejectReason, rejected_api_error
from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.core.generation import EngineError, GenerationService, Rejected, RequestStream
from pagedserve.frontend.openai_api.http_conn import ClosingError, ConnectionGuard, HttpLimits, read_body, send_and_close
from pagedserve.frontend.openai_api.http_response import chat_logprobs, chat_response, chat_stream
from pagedserve.frontend.openai_api.http_shared import Ctx
from pagedserve.frontend.openai_api.openai_extras import Extras
from pagedserve.frontend.openai_api.openai_options import OpenAIOptions
from pagedserve.frontend.core.outputs import Chunk
from pagedserve.frontend.core.prompt_options import InputOptions, with_sampler_extras
from pagedserve.frontend.openai_api.reasoning import chat as reasoning_chat
from pagedserve.frontend.openai_api.tool_parsers import PARSERS
from pagedserve.frontend.core.validation import MAX_REQUEST_BYTES, Limits, ValidationError
from pagedserve.frontend.core.vllm_metrics import HttpMetrics
from pagedserve.v1 import generation_pb2 as pb

log = logging.getLogger("pagedserve.frontend")

# Body fields whose check parses a grammar (tools: the chat route says).
_GRAMMAR_FIELDS = ("response_format", "structured_outputs", *openai_structured.GUIDED)


def _openai_param(field: str) -> str:
    name = field.removeprefix("sampling_params.")
    return {"prompt_token_ids": "prompt", "request": "body"}.get(name, name)


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
        self.root_path = http_cors.normalize_root(self.opts.root_path)
        self.cors = http_cors.Cors(self.opts)
        self.flags = server_flags.ServerFlags()  # vLLM's response flags; the service sets them

    # ------------------------------------------------------------ plumbing
    def app(self) -> web.Application:
        outer = [self.guard.middleware] + ([HttpMetrics.on(self.registry).middleware] if self.registry else [])
        app = web.Application(client_max_size=MAX_REQUEST_BYTES, middlewares=[*outer, self._errors])
        server_flags.install(app, self.flags)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        http_extras.add_routes(self, app)
        http_cors.add_prefixed_routes(app, self.root_path)
        app.on_response_prepare.append(self.cors.on_prepare)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            preflight = self.cors.preflight(request)  # before auth, as vLLM's CORS and auth middlewares
            if preflight is not None:
                return preflight
            if http_cors.route_path(request, self.root_path) not in ("/health", "/metrics"):
                self._key_id(request)
            return await handler(request)
        except ClosingError as e:
            return await send_and_close(request, e)
        except ApiError as e:
            return e.response()
        except web.HTTPException as e:
            if e.status == 413:
                return ApiError(413, f"body: larger than {MAX_REQUEST_BYTES} bytes", param="body").response()
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # a 405 names the methods
            return ApiError(e.status, e.reason, routing=True, headers=allow).response()

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
            raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: {self.model_name()}.",
                           param="model", code="model_not_found")  # vLLM's words
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
        return web.json_response(http_extras.model_list(self.model_name(), self.svc.info.model))

    # ------------------------------------------------------------ translation
    async def _sampling_off_loop(self, body: dict[str, Any], max_tokens: Any, x: Extras,
                                 tool_mode: Any = None) -> dict[str, Any]:
        """``_sampling`` on the tokenizer thread when the body asks for a grammar:
        its check waits for the grammar-check child's xgrammar parse
        (frontend/core/grammar_check.py; the first one starts the child, 1-2 s), which must
        not stall the other streams on this loop."""
        if tool_mode is not None or any(body.get(k) is not None for k in _GRAMMAR_FIELDS):
            values = await self.svc.off_loop(0, self._sampling, body, max_tokens, x, tool_mode)
            return values  # type: ignore[no-any-return]
        return self._sampling(body, max_tokens, x, tool_mode)

    def _sampling(self, body: dict[str, Any], max_tokens: Any, x: Extras, tool_mode: Any) -> dict[str, Any]:
        """The body's sampling fields as the table's given values (common/request_fields.py),
        which ``prepare`` validates into the engine's SamplingParams as it does gRPC's."""
        values = http_fields.sampling_values(body, self._limits())
        if max_tokens is not None:
            why = request_fields.check_type(request_fields.TABLE["max_tokens"], max_tokens)
            if why is not None:
                raise ApiError(400, f"max_tokens: {why}", param="max_tokens")
            values["max_tokens"] = max_tokens
        if x.logprobs is not None:
            values["logprobs"] = x.logprobs
        if x.prompt_logprobs is not None:
            values["prompt_logprobs"] = x.prompt_logprobs
        elif x.echo and (x.chat or x.logprobs is not None):
            # vLLM: echo asks for the prompt's logprobs too (chat: top_logprobs of them)
            values["prompt_logprobs"] = x.logprobs or 0
        if not values.get("beam_width"):  # beam search returns n beams, not n samples
            openai_extras.greedy_n_check(values.get("n", 1), values.get("temperature"))
        http_json.check_schema_texts(body)
        # Structured outputs travel as the proto's StructuredOutputs message on both protocols.
        carrier = pb.SamplingParams()
        try:  # response_format, structured_outputs, guided_*: frontend/openai_api/openai_structured.py; tools: openai_tools
            openai_structured.apply_structured(body, carrier)
            if tool_mode is not None:
                openai_tools.enforce(tool_mode, carrier)
        except ValidationError as e:
            raise ApiError(400, str(e), param=e.field) from None
        if carrier.HasField("structured_outputs"):
            values["structured_outputs"] = carrier.structured_outputs
        return values

    def _extras(self, request: web.Request, body: dict[str, Any], chat: bool) -> Extras:
        x = openai_extras.parse(body, chat, self.opts, self._limits().vocab_size, request.headers.get("X-Request-Id"))
        x = server_flags.with_server_flags(self.flags, x, body)
        return x if x.request_id else replace(x, request_id=uuid.uuid4().hex)

    def _capped(self, max_tokens: Any) -> Any:
        """vLLM's override_max_tokens (a generation config's max_new_tokens) caps every request."""
        cap = self.opts.override_max_tokens
        ok = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
        return min(max_tokens, cap) if cap is not None and ok else max_tokens

    def _options(self, x: Extras, sampling: dict[str, Any], default_max_tokens: int | None = None) -> InputOptions:
        return InputOptions(add_special_tokens=x.add_special_tokens, truncate=x.truncate,
                            truncate_left=x.truncate_left, sampling=sampling, route="chat" if x.chat else "completions",
                            default_max_tokens=default_max_tokens, skip_special_tokens=x.skip_special_tokens,
                            spaces_between_special_tokens=x.spaces_between_special_tokens,
                            allowed_token_ids=x.allowed_token_ids, bad_words=x.bad_words)

    def _log(self, rid: str, num_prompts: int, values: dict[str, Any]) -> None:
        if self.opts.log_requests:  # ids and sampling parameters only: never a header (the API key)
            params = " ".join(f"{k}: {v}" for k, v in values.items() if k != "structured_outputs")
            log.info("Received request %s: %d prompt(s), params: {%s}", rid, num_prompts, params)

    async def prepare(self, req: pb.GenerateRequest, add_special_tokens: bool = True,
                      options: InputOptions | None = None) -> Any:
        try:  # tokenizes off the event loop
            prepared = await self.svc.prepare_async(req, add_special_tokens, options)
            return with_sampler_extras(prepared, options, self._encode)
        except ValidationError as e:
            # vLLM names a prompt with no room left in max_model_len `input_tokens` (its context check).
            param = "input_tokens" if "leaves no room to generate" in str(e) else _openai_param(e.field)
            raise ApiError(400, str(e), param=param) from None

    async def open_stream(self, request: web.Request, prepared: Any) -> RequestStream:
        try:  # a stop token's text and stop_reason as vLLM's (stop_tokens)
            stream = await self.svc.open(prepared, self._key_id(request))
            return stop_tokens.apply(stream, getattr(self.svc.tokenizer, "eos_token_id", None))
        except Rejected as e:
            reason = e.reason if isinstance(e.reason, RejectReason) else RejectReason(e.reason)
            raise rejected_api_error(reason, str(e)) from None
        except DuplicateRequestId:
            raise ApiError(409, "request id already running", code="duplicate") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.svc.tokenizer.encode(text, add_special_tokens=False))

    def token_str(self, tok: int) -> str:
        return self.svc.detokenize([tok], skip_special_tokens=False)

    # ------------------------------------------------------------ /v1/completions
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = http_lax.lax(await self.json_body(request), chat=False)  # vLLM's pydantic conversions
        x = self._extras(request, body, chat=False)
        if body.get("suffix") is not None:  # vLLM: FIM models only
            raise ApiError(400, "suffix: suffix is only supported for models with FIM completion rendering",
                           param="suffix")
        body = openai_extras.with_defaults(body, self.opts.default_sampling)
        prompts = http_batch.completion_prompts(body.get("prompt"), self._limits())
        # vLLM's CompletionRequest: max_tokens 16 when absent or null; 0 with echo answers the prompt alone.
        max_tokens = body.get("max_tokens")
        max_tokens = request_fields.default("max_tokens", "completions") if max_tokens is None else max_tokens
        max_tokens = self._capped(max_tokens)
        echo_only = x.echo and max_tokens == 0
        values = await self._sampling_off_loop(body, 1 if echo_only else max_tokens, x)
        reqs = []
        for prompt in prompts:
            req = pb.GenerateRequest()
            http_batch.set_prompt(req, prompt)
            if isinstance(body.get("cache_salt"), str):
                req.cache_salt = body["cache_salt"]
            reqs.append(req)
        self._log(f"cmpl-{x.request_id}", len(reqs), values)
        return await http_batch.run_batch(self, request, x, prompts, reqs, self._options(x, values), echo_only)

    # ------------------------------------------------------------ /v1/chat/completions
    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = http_lax.lax(await self.json_body(request), chat=True)
        x = self._extras(request, body, chat=True)
        body = openai_extras.with_defaults(body, self.opts.default_sampling)
        try:  # messages (tool calls included), tools and tool_choice: frontend/openai_api/openai_tools.py
            conv = openai_tools.chat_messages(body.get("messages"))
            tool_mode, tools, body = openai_tools.take_tools(body, self.opts)
        except ValidationError as e:
            raise ApiError(400, str(e), param=e.field) from None
        if tool_mode is not None and tool_mode.parser is not None and PARSERS[tool_mode.parser].keeps_special_tokens:
            x = replace(x, skip_special_tokens=False)  # vLLM's hermes adjust_request
        x = reasoning_chat.extras(self.opts, x)  # --reasoning-parser: frontend/openai_api/reasoning/chat.py
        tok = self.svc.tokenizer
        template = x.chat_template or self.opts.chat_template
        if not template and not has_chat_template(tok):
            raise ApiError(400, "messages: this model has no chat template; use /v1/completions", param="messages")
        conv, tools = openai_tools.as_vllm_renders(conv, tools, template or getattr(tok, "chat_template", None))
        try:
            conv_t = server_flags.with_content_format(self.flags, conv, body.get("messages"), template, tok)
            prompt = render_chat(tok, conv_t, tools, x.add_generation_prompt, template, x.template_kwargs)
        except ValidationError as e:
            raise ApiError(400, str(e), param=e.field) from None
        # vLLM: the answer's role is the server's, or, continuing a message, that message's.
        role = self.opts.response_role if x.add_generation_prompt else conv[-1]["role"]
        echo_text = conv[-1]["content"] if x.echo and conv[-1]["role"] == role else ""
        req = pb.GenerateRequest(prompt=prompt)
        if isinstance(body.get("cache_salt"), str):
            req.cache_salt = body["cache_salt"]
        max_tokens = body.get("max_completion_tokens")
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        max_tokens = None if max_tokens is None else self._capped(max_tokens)
        values = await self._sampling_off_loop(body, max_tokens, x, tool_mode)
        self._log(f"chatcmpl-{x.request_id}", 1, values)
        prepared = await self.prepare(req, options=self._options(x, values,
                                                                 self.opts.default_sampling.get("max_tokens")))
        stream = await self.open_stream(request, prepared)
        ctx = Ctx(f"chatcmpl-{x.request_id}", "chat.completion", self.model_name(), prepared.prep.params.n, x,
                  role, echo_text, prompt, self.flags.enable_prompt_tokens_details)
        as_id = x.return_tokens_as_token_ids

        def logprobs(c: Chunk, context: list[int] | None = None) -> Any:  # context: a stream's earlier ids
            return chat_logprobs(self, c, as_id, context)

        choice = self._chat_choice(as_id) if tool_mode is None else \
            openai_tools.choice_formatter(tool_mode, logprobs, x.return_token_ids)
        choice = reasoning_chat.choice(self.opts, tok, tool_mode, x, stream.req.prompt_ids, body,
                                       "structured_outputs" in values, logprobs, choice)
        try:
            if x.stream:
                return await chat_stream(request, stream, ctx, choice, http_batch.engine_error_event)
            return web.json_response(chat_response(self, ctx, stream, await stream.collect(), choice))
        except EngineError as e:
            raise http_batch.engine_api_error(e) from None
        finally:
            stream.close()

    def _chat_choice(self, as_id: bool) -> Callable[[Chunk, dict[str, Any] | None], dict[str, Any]]:
        def build(c: Chunk, acc: dict[str, Any] | None) -> dict[str, Any]:
            lp = chat_logprobs(self, c, as_id, None if acc is None else acc.setdefault("lp_context", []))
            if acc is None:  # a non-streaming choice (the role is the response's: http_response)
                return {"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            return {"index": c.index, "delta": {"content": c.text}, "logprobs": lp, "finish_reason": c.finish_reason}

        return build


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
