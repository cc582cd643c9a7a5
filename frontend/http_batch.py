"""``/v1/completions`` with a batch of prompts and/or ``echo``, as vLLM has them.

Each prompt is its own engine request (validated and admitted before any is
opened, so a bad prompt refuses the whole batch and starts nothing); choice
``i * n + j`` is output ``j`` of prompt ``i``, and usage is the batch's sum.
``echo`` puts the prompt before each output's text (on the output's first
chunk when streaming); with ``logprobs`` it also prepends the prompt tokens'
logprobs (the first one is null), computed as ``prompt_logprobs``.
"""
from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

from aiohttp import web

from pagedserve.common.messages.frontend import ErrorKind
from pagedserve.frontend.errors import ApiError
from pagedserve.frontend.http_fields import check_ids, is_token_id
from pagedserve.frontend.generation import EngineError, RequestStream
from pagedserve.frontend.http_shared import Ctx, GatewayApi
from pagedserve.frontend.outputs import Chunk
from pagedserve.frontend.validation import Limits
from pagedserve.v1 import generation_pb2 as pb

MAX_BATCH_PROMPTS = 64
Prompt = str | list[int]

# The engine's reason for failing a request -> HTTP status and OpenAI error type, as
# frontend/server.py's GRPC_STATUS does for gRPC: a request the scheduler refuses is the
# client's (400), one that can never fit the KV cache is RESOURCE_EXHAUSTED there (429 here).
_ENGINE_STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.KV_CACHE: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
}


def engine_api_error(e: EngineError) -> ApiError:
    status, type_ = _ENGINE_STATUS.get(e.kind, (500, "server_error"))
    return ApiError(status, str(e), type_, code=e.kind.name.lower())


def engine_error_event(e: EngineError) -> dict[str, Any]:
    """The error as a server-sent event (the stream's status line went out long ago)."""
    err = engine_api_error(e)
    return {"error": {"message": str(err), "type": err.type, "param": None, "code": err.code}}


def completion_prompts(prompt: Any, limits: Limits) -> list[Prompt]:
    """A string, a token-id list, or a batch (list of strings / list of token-id lists);
    token ids are checked against the vocabulary here, before they meet a uint32 field."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(is_token_id(t) for t in prompt):
            batch: list[Any] = [prompt]
        elif all(isinstance(p, str) for p in prompt) or all(
                isinstance(p, list) and all(is_token_id(t) for t in p) for p in prompt):
            batch = list(prompt)
        else:
            batch = []
        if len(batch) > MAX_BATCH_PROMPTS:
            raise ApiError(400, f"prompt: at most {MAX_BATCH_PROMPTS} prompts in a batch, got {len(batch)}",
                           param="prompt")
        if batch:
            for p in batch:
                if isinstance(p, list):
                    check_ids(p, limits, "prompt")
            return batch
    raise ApiError(400, f"prompt: must be a string, a list of token ids, or a batch of 1 to {MAX_BATCH_PROMPTS} "
                        "prompts (all strings or all token-id lists)", param="prompt")


def set_prompt(req: pb.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.ids.extend(prompt)


class _Echo:
    """What echo prepends to one prompt's outputs."""

    def __init__(self, gw: GatewayApi, prompt: Prompt, stream: RequestStream, with_logprobs: bool) -> None:
        self.gw, self.stream, self.with_logprobs = gw, stream, with_logprobs
        self.text = prompt if isinstance(prompt, str) else gw.svc.detokenize(list(prompt))

    def logprobs(self) -> dict[str, Any]:
        ids = self.stream.req.prompt_ids
        entries = self.stream.prompt_logprobs or []
        tok = self.gw.token_str
        return {"tokens": [tok(t) for t in ids], "token_logprobs": [None] + [e[0] for e in entries],
                "top_logprobs": [None] + [{tok(t): v for t, v in e[1]} for e in entries], "text_offset": []}

    def apply(self, choice: dict[str, Any]) -> None:
        choice["text"] = self.text + choice["text"]
        if self.with_logprobs:
            lp, mine = choice.get("logprobs"), self.logprobs()
            if lp:
                for k in ("tokens", "token_logprobs", "top_logprobs"):
                    mine[k] += lp[k]
            choice["logprobs"] = mine


async def run_batch(gw: GatewayApi, request: web.Request, body: dict[str, Any], prompts: list[Prompt],
                    reqs: list[pb.GenerateRequest]) -> web.StreamResponse:
    echo = bool(body.get("echo"))
    echo_lp = echo and body.get("logprobs") is not None
    if echo_lp:
        for r in reqs:
            if not r.sampling_params.HasField("prompt_logprobs"):
                r.sampling_params.prompt_logprobs = r.sampling_params.logprobs
    prepared = []
    for r in reqs:  # every prompt is valid before any starts
        p = gw.prepare(r)
        prepared.append(await p if inspect.isawaitable(p) else p)  # async once tokenizing leaves the loop
    streams: list[RequestStream] = []
    try:
        for p in prepared:
            streams.append(await gw.open_stream(request, p))
        n = prepared[0].prep.params.n
        echoes = [_Echo(gw, p, s, echo_lp) if echo else None for p, s in zip(prompts, streams)]
        ctx = Ctx(f"cmpl-{streams[0].request_id}", "text_completion", gw.model_name(), n)
        if body.get("stream"):
            return await _stream(gw, request, body, streams, echoes, ctx)
        results = await asyncio.gather(*(s.collect() for s in streams))
        choices = []
        for i, merged in enumerate(results):
            for j in range(max(n, len(merged))):
                ch = gw.completion_choice(merged.get(j, Chunk(j)), None)
                ch["index"] = i * n + j
                if echoes[i] is not None:
                    echoes[i].apply(ch)
                choices.append(ch)
        return web.json_response({"id": ctx.id, "object": ctx.object, "created": ctx.created, "model": ctx.model,
                                  "choices": choices, "usage": _usage(streams)})
    except EngineError as e:
        raise engine_api_error(e) from None
    finally:
        for s in streams:
            s.close()




def _usage(streams: list[RequestStream]) -> dict[str, int]:
    p = sum(len(s.req.prompt_ids) for s in streams)
    c = sum(s.num_completion_tokens for s in streams)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _stream(gw: GatewayApi, request: web.Request, body: dict[str, Any], streams: list[RequestStream],
                  echoes: list[_Echo | None], ctx: Ctx) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    queue: asyncio.Queue[tuple[int, list[Chunk] | EngineError | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            while (chunks := await s.next()) is not None:
                await queue.put((i, chunks))
        except EngineError as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    async def send(payload: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    echoed: set[tuple[int, int]] = set()
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, EngineError):
                await send(engine_error_event(item))
                continue
            choices = []
            for c in item:
                ch = gw.completion_choice(c, None)
                ch["index"] = i * ctx.n + c.index
                echo = echoes[i]
                if echo is not None and (i, c.index) not in echoed:
                    echoed.add((i, c.index))
                    echo.apply(ch)
                choices.append(ch)
            if choices:
                await send({"id": ctx.id, "object": ctx.object, "created": ctx.created, "model": ctx.model,
                            "choices": choices})
    finally:
        for t in tasks:
            t.cancel()
    if (body.get("stream_options") or {}).get("include_usage"):
        await send({"id": ctx.id, "object": ctx.object, "created": ctx.created, "model": ctx.model, "choices": [],
                    "usage": _usage(streams)})
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
