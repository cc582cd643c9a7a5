"""The OpenAI response bodies, with vLLM 0.32's extras: logprobs (tokens as
text or ``token_id:N``), ``prompt_logprobs``, ``token_ids`` /
``prompt_token_ids`` (``return_token_ids``), usage (and vLLM's
``stream_options.continuous_usage_stats``: usage in every chunk), and the chat
route's stream (a role chunk per choice first, then an ``echo`` chunk, then
one chunk per choice and delta, as vLLM's serving_chat emits them)."""
from __future__ import annotations

import json
from typing import Any, Callable

from aiohttp import web

from pagedserve.frontend.core.generation import EngineError, RequestStream
from pagedserve.frontend.openai_api.http_shared import Ctx, GatewayApi
from pagedserve.frontend.core.outputs import Chunk, Logprob
from pagedserve.frontend.openai_api.server_flags import prompt_tokens_details
from pagedserve.frontend.openai_api.sse_writes import SseBatch

MIN_LOGPROB = -9999.0  # vLLM writes -inf as this (JSON has no infinity)
Choice = Callable[[Chunk, dict[str, Any] | None], Any]  # a dict, or None: nothing to send yet


def _lp(v: float) -> float:
    return max(v, MIN_LOGPROB)


def token_text(gw: GatewayApi, tok: int, as_id: bool) -> str:
    return f"token_id:{tok}" if as_id else gw.token_str(tok)


REPLACEMENT = "\ufffd"
MAX_BYTE_CONTEXT = 4  # vLLM's: enough for any UTF-8 sequence


def decoded_token(gw: GatewayApi, tok: int, context: list[int]) -> str:
    """vLLM's logprob token string (LogprobsProcessor._verify_tokens): a token
    whose text ends in U+FFFD (part of a character) is decoded after up to 4 of
    the tokens before it (``context``, the output's own); it gets the text that
    completes, or "" while the character is still incomplete."""
    text = gw.token_str(tok)
    if not text.endswith(REPLACEMENT):
        return text
    for n in range(1, min(len(context), MAX_BYTE_CONTEXT) + 1):
        ctx = context[-n:]
        full = gw.svc.detokenize([*ctx, tok], skip_special_tokens=False)
        if full.endswith(REPLACEMENT):
            continue
        clean_end = len(ctx)  # context tokens that are themselves part of this character
        for j in range(len(ctx) - 1, -1, -1):
            if gw.token_str(ctx[j]).endswith(REPLACEMENT):
                clean_end = j
            else:
                break
        prefix = gw.svc.detokenize(ctx[:clean_end], skip_special_tokens=False) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def _strings(gw: GatewayApi, toks: list[int], as_id: bool, context: list[int]) -> dict[int, str]:
    """The strings of one position's tokens (the chosen one and its alternatives)."""
    if as_id:
        return {t: f"token_id:{t}" for t in toks}
    return {t: decoded_token(gw, t, context) for t in toks}


def _with_chosen(tok: int, e: Logprob) -> list[tuple[int, float]]:
    """vLLM's logprobs of a position: the chosen token first, then the top ones (ids once)."""
    out = {tok: e[0]}
    for t, v in e[1]:
        out.setdefault(t, v)
    return list(out.items())


def usage(prompt: int, completion: int, details: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                           "completion_tokens": completion}
    if details is not None:
        out["prompt_tokens_details"] = details
    return out


def cached_details(ctx: Ctx, stream: RequestStream, streaming: bool) -> dict[str, Any] | None:
    """--enable-prompt-tokens-details: the prompt tokens the prefix cache held (server_flags)."""
    return prompt_tokens_details(stream.times.num_cached_tokens, streaming) if ctx.prompt_details else None


# The fields vLLM 0.32's non-streamed response models dump as null when nothing set them
# (ChatCompletionResponse / CompletionResponse and their choices, ChatMessage): present here
# too, for clients that read them. Only defaults: whoever set a value (reasoning, prompt
# logprobs, token ids) keeps it. ``tool_calls`` is left out when empty, as vLLM's ChatMessage.
_TOP_NULLS = ("service_tier", "system_fingerprint", "kv_transfer_params", "ec_transfer_params", "metrics")
_CHAT_TOP_NULLS = (*_TOP_NULLS, "prompt_logprobs", "prompt_token_ids", "prompt_text")
_CHOICE_NULLS = ("logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts")
_COMPLETION_CHOICE_NULLS = (*_CHOICE_NULLS, "prompt_logprobs", "prompt_token_ids")
_MESSAGE_NULLS = ("content", "refusal", "annotations", "audio", "function_call", "reasoning")


def with_vllm_nulls(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    for k in _CHAT_TOP_NULLS if chat else _TOP_NULLS:
        body.setdefault(k, None)
    if isinstance(body.get("usage"), dict):  # streamed usage leaves them out, as vLLM's (exclude_unset)
        body["usage"].setdefault("prompt_tokens_details", None)
        body["usage"].setdefault("completion_tokens_details", None)
    for ch in body.get("choices", ()):
        for k in _CHOICE_NULLS if chat else _COMPLETION_CHOICE_NULLS:
            ch.setdefault(k, None)
        msg = ch.get("message")
        if isinstance(msg, dict):
            for k in _MESSAGE_NULLS:
                msg.setdefault(k, None)
            if msg.get("tool_calls") == []:
                del msg["tool_calls"]
    return body


def completion_logprobs(gw: GatewayApi, entries: list[tuple[int, Logprob | None]], as_id: bool,
                        offset: int = 0, context: list[int] | None = None, k: int = -1) -> dict[str, Any]:
    """OpenAI's legacy logprobs as vLLM writes them: an entry without a logprob (the
    first prompt token) is null; ``top_logprobs`` holds the chosen token and the
    top ones (logprobs=k: up to k+1 entries, k=0 the chosen one alone).
    ``text_offset`` runs over the token strings from ``offset``. Token strings
    are vLLM's (``decoded_token``) with the entries before as context, after
    ``context`` (a stream's earlier chunks), which this call extends. ``k``
    (the request's logprobs; -1 all): at most k+1 entries, as vLLM cuts an
    echoed prompt position whose prompt_logprobs asked for more."""
    tokens, lps, tops, offsets = [], [], [], []
    context = [] if context is None else context
    for tok, e in entries:
        if e is None:
            s = token_text(gw, tok, as_id)
            tokens.append(s)
            lps.append(None)
            tops.append(None)
        else:
            pairs = _with_chosen(tok, e)
            pairs = pairs if k < 0 else pairs[:k + 1]
            names = _strings(gw, [t for t, _ in pairs], as_id, context)
            s = names[tok]
            tokens.append(s)
            lps.append(_lp(e[0]))
            tops.append({names[t]: _lp(v) for t, v in pairs})
            context.append(tok)
        offsets.append(offset)
        offset += len(s)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(gw: GatewayApi, c: Chunk, as_id: bool, context: list[int] | None = None) -> dict[str, Any] | None:
    """Chat logprobs as vLLM writes them: ``top_logprobs`` the first top_logprobs of
    (the chosen token, then the top ones); ``bytes`` those of the token strings.
    ``context``: the choice's earlier tokens (streaming), extended here."""
    if not c.logprobs:
        return None
    ctx = [] if context is None else context
    content = []
    for t, e in c.logprobs:
        pairs = _with_chosen(t, e)[:len(e[1])]
        names = _strings(gw, [t, *(a for a, _ in pairs)], as_id, ctx)
        main = names[t]
        decoded = main if not as_id else decoded_token(gw, t, ctx)
        content.append({"token": main, "logprob": _lp(e[0]), "bytes": list(decoded.encode("utf-8", errors="replace")),
                        "top_logprobs": [{"token": names[a], "logprob": _lp(b),
                                          "bytes": list(names[a].encode("utf-8", errors="replace"))}
                                         for a, b in pairs]})
        ctx.append(t)
    return {"content": content}


def prompt_logprobs(gw: GatewayApi, stream: RequestStream) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: null for the first token, then {id: {logprob, rank, decoded_token}}
    for the prompt token and the top ones. Ranks as vLLM's: a top one's is its place among the top
    ones (so is the prompt token's when it is one of them); else the prompt token's vocabulary rank
    from the worker (null only from a worker too old to send it)."""
    if stream.req.prep.params.prompt_logprobs is None:
        return None
    ids, entries = stream.req.prompt_ids, stream.prompt_logprobs or []
    vocab_ranks: list[int | None] = list(stream.prompt_logprob_ranks) or [None] * len(entries)
    out: list[dict[str, Any] | None] = [None]
    for i, (tok, (lp, top), vrank) in enumerate(zip(ids[1:], entries, vocab_ranks)):
        ranks = {t: r for r, (t, _) in enumerate(top, 1)}
        context = ids[max(1, i + 1 - MAX_BYTE_CONTEXT):i + 1]  # vLLM's: the prompt tokens with a logprob before
        d = {str(tok): {"logprob": _lp(lp), "rank": ranks.get(tok, vrank),
                        "decoded_token": decoded_token(gw, tok, context)}}
        for t, v in top:
            d.setdefault(str(t), {"logprob": _lp(v), "rank": ranks[t], "decoded_token": decoded_token(gw, t, context)})
        out.append(d)
    return out


async def sse(resp: web.StreamResponse, payload: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def event_stream() -> web.StreamResponse:
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


# ------------------------------------------------------------------ chat
def chat_response(gw: GatewayApi, ctx: Ctx, stream: RequestStream, merged: dict[int, Chunk],
                  choice: Choice) -> dict[str, Any]:
    x = ctx.extras
    choices = []
    for i in range(max(ctx.n, len(merged))):
        c = merged.get(i, Chunk(i))
        ch = choice(c, None)
        msg = ch.get("message")
        if isinstance(msg, dict):
            msg["role"] = ctx.role
            if ctx.echo_text and x is not None and x.echo:
                msg["content"] = ctx.echo_text + (msg.get("content") or "")
        if x is not None and x.return_token_ids:
            ch["token_ids"] = c.token_ids
        choices.append(ch)
    out = {"id": ctx.id, "object": ctx.object, "created": ctx.created, "model": ctx.model, "choices": choices,
           "usage": usage(len(stream.req.prompt_ids), stream.num_completion_tokens, cached_details(ctx, stream, False))}
    if x is not None:
        if x.prompt_logprobs is not None or x.echo:  # vLLM: echo asks for them (top_logprobs of them)
            out["prompt_logprobs"] = prompt_logprobs(gw, stream)
        if x.return_token_ids:
            out["prompt_token_ids"] = stream.req.prompt_ids
        if x.return_prompt_text:
            out["prompt_text"] = ctx.prompt_text
    return with_vllm_nulls(out, chat=True)


async def chat_stream(request: web.Request, stream: RequestStream, ctx: Ctx, choice: Choice,
                      engine_error_event: Callable[[EngineError], dict[str, Any]]) -> web.StreamResponse:
    resp = event_stream()
    await resp.prepare(request)
    x = ctx.extras
    obj = "chat.completion.chunk"
    n_prompt = len(stream.req.prompt_ids)
    accs: dict[int, dict[str, Any]] = {}
    counts = [0] * ctx.n

    def chunk(choices: list[dict[str, Any]], completion: int | None = None, **top: Any) -> dict[str, Any]:
        out = {"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model, "choices": choices, **top}
        if x is not None and x.continuous_usage and completion is not None:
            out["usage"] = {**usage(n_prompt, completion), "completion_tokens_details": None}  # as vLLM's chunks
        return out

    batch = SseBatch()  # the events of one step in one write
    try:
        first = True
        while (chunks := await stream.next()) is not None:
            if first:  # vLLM: the role alone first, for every choice, then the echoed message
                first = False
                # vLLM's first chunk carries both, null where not asked for.
                top: dict[str, Any] = {
                    "prompt_token_ids": stream.req.prompt_ids if x is not None and x.return_token_ids else None,
                    "prompt_text": ctx.prompt_text if x is not None and x.return_prompt_text else None}
                for i in range(ctx.n):
                    batch.add(chunk([{"index": i, "delta": {"role": ctx.role, "content": ""},
                                            "logprobs": None, "finish_reason": None}], 0, **top))
                if x is not None and x.echo and ctx.echo_text:
                    for i in range(ctx.n):
                        batch.add(chunk([{"index": i, "delta": {"content": ctx.echo_text},
                                                "logprobs": None, "finish_reason": None}], 0))
            for c in chunks:
                if c.index < len(counts):
                    counts[c.index] = len(c.token_ids) if c.replace else counts[c.index] + len(c.token_ids)
                ch = choice(c, accs.setdefault(c.index, {}))
                if ch is None:  # nothing to send yet (a tool-call parser holds text back)
                    continue
                delta = ch.get("delta")
                if isinstance(delta, dict):
                    delta.pop("role", None)  # sent in the role chunk
                ch["token_ids"] = c.token_ids if x is not None and x.return_token_ids else None  # null: vLLM's
                if c.finish_reason is not None:
                    ch.setdefault("stop_reason", c.stop_reason)
                batch.add(chunk([ch], counts[c.index] if c.index < len(counts) else None))
            await batch.flush(resp)
    except EngineError as e:
        batch.add(engine_error_event(e))
    if x is not None and x.include_usage:
        batch.add({"id": ctx.id, "object": obj, "created": ctx.created, "model": ctx.model, "choices": [],
                         "usage": usage(n_prompt, stream.num_completion_tokens, cached_details(ctx, stream, True))})
    batch.add_raw(b"data: [DONE]\n\n")
    await batch.flush(resp)
    await resp.write_eof()
    return resp
