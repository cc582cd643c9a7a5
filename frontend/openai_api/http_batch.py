"""``/v1/completions``: one prompt or a batch, and ``echo``, as vLLM 0.32's
serving_completion answers them.

Each prompt is its own engine request (validated and admitted before any is
opened, so a bad prompt refuses the whole batch and starts nothing); choice
``i * n + j`` is output ``j`` of prompt ``i``, and usage is the batch's sum.
``echo`` puts the prompt before each output's text (on the output's first
chunk when streaming); with ``logprobs`` it also prepends the prompt tokens'
logprobs (the first one is null), computed as ``prompt_logprobs``; with
``max_tokens`` 0 the answer is the prompt alone (one token is generated and
dropped, as vLLM). A stream sends one chunk per choice and delta; with
``stream_options.continuous_usage_stats`` each carries usage (the prompt's
tokens, the choice's tokens so far), as vLLM's.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any

from aiohttp import web

from pagedserve.frontend.core import error_table
from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.openai_api.http_fields import check_ids, is_token_id
from pagedserve.frontend.core.generation import EngineError, RequestStream
from pagedserve.frontend.openai_api.http_response import (cached_details, completion_logprobs, event_stream,
                                                        prompt_logprobs, usage, with_vllm_nulls)
from pagedserve.frontend.openai_api.http_shared import Ctx, GatewayApi
from pagedserve.frontend.openai_api.openai_extras import Extras
from pagedserve.frontend.core.outputs import Chunk, Logprob
from pagedserve.frontend.openai_api.sse_writes import SseBatch
from pagedserve.frontend.core.prompt_options import InputOptions
from pagedserve.frontend.core.validation import Limits
from pagedserve.v1 import generation_pb2 as pb

MAX_BATCH_PROMPTS = 64
Prompt = str | list[int]

def engine_api_error(e: EngineError) -> ApiError:
    """The engine's failure in the one error table (error_table), as gRPC gets it."""
    return error_table.engine_api_error(e.kind, str(e))


def engine_error_event(e: EngineError) -> dict[str, Any]:
    """The error as a server-sent event (the stream's status line went out long ago)."""
    return error_table.sse_error_event(engine_api_error(e))


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


class _Prompt:
    """One prompt's stream and what echo prepends to its outputs."""

    def __init__(self, gw: GatewayApi, prompt: Prompt, stream: RequestStream, x: Extras, echo_only: bool) -> None:
        self.gw, self.stream, self.x, self.echo_only = gw, stream, x, echo_only
        self._context: dict[int, list[int]] = {}  # output index -> token ids its earlier chunks' logprobs read
        ids = stream.req.prompt_ids
        if not x.echo or x.return_token_ids:  # vLLM echoes no text when it returns token ids
            self.text = ""
        else:
            self.text = prompt if isinstance(prompt, str) else gw.svc.detokenize(list(ids))

    def prompt_entries(self) -> list[tuple[int, Logprob | None]]:
        ids, entries = self.stream.req.prompt_ids, self.stream.prompt_logprobs or []
        return [(ids[0], None), *zip(ids[1:], entries)]

    def choice(self, c: Chunk, index: int, first: bool, offset: int = 0) -> tuple[dict[str, Any], int]:
        """A choice for ``c`` (on an output's first chunk, with what echo adds); and the next text offset."""
        x = self.x
        echo = x.echo and first
        text = ("" if self.echo_only else c.text) if not echo else self.text + ("" if self.echo_only else c.text)
        ch: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
        if x.logprobs is not None:
            out = [] if self.echo_only else list(c.logprobs)
            entries = [*(self.prompt_entries() if echo else []), *out]
            ch["logprobs"] = completion_logprobs(self.gw, entries, x.return_tokens_as_token_ids, offset,
                                                 self._context.setdefault(index, []), x.logprobs)
            lp = ch["logprobs"]
            if lp["tokens"]:
                offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        # Both keys on every choice, null where unset, as vLLM's stream chunks carry them.
        ch["prompt_token_ids"] = self.stream.req.prompt_ids if first and (echo or x.return_token_ids) else None
        ch["token_ids"] = c.token_ids if x.return_token_ids else None
        return ch, offset


async def run_batch(gw: GatewayApi, request: web.Request, x: Extras, prompts: list[Prompt],
                    reqs: list[pb.GenerateRequest], options: InputOptions, echo_only: bool = False) -> web.StreamResponse:
    prepared = [await gw.prepare(r, options.add_special_tokens, options) for r in reqs]  # all valid before any starts
    streams: list[RequestStream] = []
    try:
        for p in prepared:
            streams.append(await gw.open_stream(request, p))
        n = prepared[0].prep.params.n
        ps = [_Prompt(gw, p, s, x, echo_only) for p, s in zip(prompts, streams)]
        ctx = Ctx("cmpl-" + (x.request_id or uuid.uuid4().hex), "text_completion", gw.model_name(), n, x,
                  prompt_details=gw.flags.enable_prompt_tokens_details)
        if x.stream:
            return await _stream(request, ps, ctx)
        results = await asyncio.gather(*(s.collect() for s in streams))
        choices = []
        for i, merged in enumerate(results):
            plp = prompt_logprobs(gw, ps[i].stream) if x.prompt_logprobs is not None or x.echo else None
            for j in range(max(n, len(merged))):
                ch, _ = ps[i].choice(merged.get(j, Chunk(j)), i * n + j, True)
                if plp is not None:
                    ch["prompt_logprobs"] = plp
                choices.append(ch)
        return web.json_response(with_vllm_nulls({"id": ctx.id, "object": ctx.object, "created": ctx.created,
                                                  "model": ctx.model, "choices": choices,
                                                  "usage": _usage(streams, ctx, False)}, chat=False))
    except EngineError as e:
        raise engine_api_error(e) from None
    finally:
        for s in streams:
            s.close()


def _usage(streams: list[RequestStream], ctx: Ctx, streaming: bool) -> dict[str, Any]:
    # prompt_tokens_details: the last prompt's, as vLLM's completions report it
    return usage(sum(len(s.req.prompt_ids) for s in streams), sum(s.num_completion_tokens for s in streams),
                 cached_details(ctx, streams[-1], streaming))


async def _stream(request: web.Request, ps: list[_Prompt], ctx: Ctx) -> web.StreamResponse:
    resp = event_stream()
    await resp.prepare(request)
    x = ctx.extras
    assert x is not None
    queue: asyncio.Queue[tuple[int, list[Chunk] | EngineError | None]] = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            while (chunks := await s.next()) is not None:
                await queue.put((i, chunks))
        except EngineError as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, p.stream)) for i, p in enumerate(ps)]
    seen: set[int] = set()
    offsets: dict[int, int] = {}
    counts: dict[int, int] = {}
    batch = SseBatch()  # every event waiting after a step goes out in one write
    try:
        open_streams = len(ps)
        while open_streams:
            waiting = [await queue.get()]
            while not queue.empty():
                waiting.append(queue.get_nowait())
            for i, item in waiting:
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, EngineError):
                    batch.add(engine_error_event(item))
                    continue
                for c in item:
                    k = i * ctx.n + c.index
                    first = k not in seen
                    seen.add(k)
                    ch, offsets[k] = ps[i].choice(c, k, first, offsets.get(k, 0))
                    counts[k] = len(c.token_ids) if c.replace else counts.get(k, 0) + len(c.token_ids)
                    payload = {"id": ctx.id, "object": ctx.object, "created": ctx.created, "model": ctx.model,
                               "choices": [ch]}
                    if x.continuous_usage:
                        payload["usage"] = usage(len(ps[i].stream.req.prompt_ids), counts[k])
                    batch.add(payload)
            await batch.flush(resp)
    finally:
        for t in tasks:
            t.cancel()
    if x.include_usage:
        batch.add({"id": ctx.id, "object": ctx.object, "created": ctx.created, "model": ctx.model,
                   "choices": [], "usage": _usage([p.stream for p in ps], ctx, True)})
    batch.add_raw(b"data: [DONE]\n\n")
    await batch.flush(resp)
    await resp.write_eof()
    return resp
