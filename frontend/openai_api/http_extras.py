"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version`` on the HTTP gateway,
with vLLM's request and response shapes. Auth as every other route."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from pagedserve.frontend.core.chat_template import has_chat_template, render_chat
from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.openai_api.http_fields import DETOKENIZE_FIELDS, TOKENIZE_FIELDS, check_fields
from pagedserve.frontend.openai_api.http_shared import GatewayApi
from pagedserve.frontend.core.validation import MAX_CHAT_MESSAGES, ValidationError, check_text, check_token_ids
from pagedserve.common.version import version as pagedserve_version

MAX_DETOKENIZE_IDS = 1_000_000  # as gRPC Detokenize


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key}: must be a boolean", param=key)
    return v


def _conversation(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_CHAT_MESSAGES:
        raise ApiError(400, f"messages: must be a list of 1 to {MAX_CHAT_MESSAGES} messages", param="messages")
    conv = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(400, "messages: each message needs a role and text content", param="messages")
        conv.append({"role": m["role"], "content": content})
    return conv


async def tokenize(gw: GatewayApi, request: web.Request) -> web.Response:
    body = await gw.json_body(request)
    check_fields(body, TOKENIZE_FIELDS)
    svc = gw.svc
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise ApiError(400, "prompt: give either prompt or messages", param="prompt")
        tok = svc.tokenizer
        if not has_chat_template(tok):
            raise ApiError(400, "messages: this model has no chat template", param="messages")
        text = render_chat(tok, _conversation(body["messages"]),
                           add_generation_prompt=_bool(body, "add_generation_prompt", True))
        add_special = _bool(body, "add_special_tokens", False)  # the template wrote them
        field = "messages"
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "prompt: must be a string (or send messages)", param="prompt")
        add_special = _bool(body, "add_special_tokens", True)
        field = "prompt"
    try:
        check_text(text, svc.limits, field)
    except ValidationError as e:
        raise ApiError(400, str(e), param=field) from None
    ids = await svc.off_loop(len(text), svc.tokenize, text, add_special)  # a 1 MB text must not stall the loop
    strs = svc.tokenizer.convert_ids_to_tokens(ids) if _bool(body, "return_token_strs", False) else None
    return web.json_response({"count": len(ids), "max_model_len": svc.info.model.max_model_len, "tokens": ids,
                              "token_strs": strs})


async def detokenize(gw: GatewayApi, request: web.Request) -> web.Response:
    body = await gw.json_body(request)
    check_fields(body, DETOKENIZE_FIELDS)
    ids = body.get("tokens")
    if (not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ApiError(400, f"tokens: must be a list of at most {MAX_DETOKENIZE_IDS} non-negative token ids",
                       param="tokens")
    try:
        check_token_ids(ids, gw.svc.limits, "tokens")
    except ValidationError as e:
        raise ApiError(400, str(e), param="tokens") from None
    # Special tokens kept, as vLLM: /tokenize then /detokenize gives the text back with them.
    text = await gw.svc.off_loop(len(ids), gw.svc.detokenize, ids, False)
    return web.json_response({"prompt": text})


async def version(gw: GatewayApi, request: web.Request) -> web.Response:
    return web.json_response({"version": pagedserve_version()})


def add_routes(gw: GatewayApi, app: web.Application) -> None:
    app.router.add_post("/tokenize", lambda r: tokenize(gw, r))
    app.router.add_post("/detokenize", lambda r: detokenize(gw, r))
    app.router.add_get("/version", lambda r: version(gw, r))
