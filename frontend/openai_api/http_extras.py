"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version`` on the HTTP gateway,
with vLLM's request and response shapes. Auth as every other route."""
from __future__ import annotations

import functools
import time
import uuid
from typing import Any

from aiohttp import web

from pagedserve.frontend.openai_api import openai_extras, openai_tools
from pagedserve.frontend.core.chat_template import has_chat_template, render_chat
from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.openai_api.http_fields import check_fields
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


# Every field of vLLM 0.32's TokenizeCompletionRequest / TokenizeChatRequest / DetokenizeRequest.
# Honoured: all but the two multimodal ones, which are ignored (the models served here are text only,
# there is no HF processor or media connector to hand them to).
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "return_token_strs", "continue_final_message", "chat_template",
                             "chat_template_kwargs", "tools", "media_io_kwargs", "mm_processor_kwargs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
_TEXT_ONLY = ("media_io_kwargs", "mm_processor_kwargs")


def _chat_prompt(gw: GatewayApi, body: dict[str, Any]) -> str:
    """The templated text, as the chat route renders it (vLLM's tokenize uses its chat renderer)."""
    for key in _TEXT_ONLY:
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise ApiError(400, f"{key}: must be an object", param=key)
    if body.get("continue_final_message") and _bool(body, "add_generation_prompt", True):
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                       param="continue_final_message")  # vLLM's check_generation_prompt
    try:
        conv = openai_tools.chat_messages(body["messages"])
        # The tools are rendered into the prompt, as the chat route does; nothing is enforced here.
        _, tools, _ = openai_tools.take_tools({"tools": body.get("tools"), "tool_choice": "none"}, gw.opts)
        template, kwargs = openai_extras._template(body, gw.opts)  # the chat route's checks and vLLM's merge
    except ValidationError as e:
        raise ApiError(400, str(e), param=e.field) from None
    if len(conv) > MAX_CHAT_MESSAGES:
        raise ApiError(400, f"messages: at most {MAX_CHAT_MESSAGES} messages", param="messages")
    tok = gw.svc.tokenizer
    template = template or gw.opts.chat_template
    if not template and not has_chat_template(tok):
        raise ApiError(400, "messages: this model has no chat template", param="messages")
    conv, tools = openai_tools.as_vllm_renders(conv, tools, template or getattr(tok, "chat_template", None))
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    try:
        return render_chat(tok, conv, tools, add_generation_prompt, template, kwargs)
    except ValidationError as e:
        raise ApiError(400, str(e), param=e.field) from None


async def tokenize(gw: GatewayApi, request: web.Request) -> web.Response:
    body = await gw.json_body(request)
    check_fields(body, TOKENIZE_FIELDS)
    svc = gw.svc
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise ApiError(400, "prompt: give either prompt or messages", param="prompt")
        text = _chat_prompt(gw, body)
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


def model_list(name: str, info: Any) -> dict[str, Any]:
    """vLLM 0.32's ModelList: one ModelCard (``root`` the model it loaded) with one ModelPermission."""
    now = int(time.time())
    perm = {"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": now,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}
    return {"object": "list", "data": [{"id": name, "object": "model", "created": now, "owned_by": "pagedserve",
                                        "root": info.model_name, "parent": None,
                                        "max_model_len": info.max_model_len, "permission": [perm]}]}


async def version(gw: GatewayApi, request: web.Request) -> web.Response:
    return web.json_response({"version": pagedserve_version()})


def add_routes(gw: GatewayApi, app: web.Application) -> None:
    # partial keeps them coroutine functions (aiohttp deprecates plain callables as handlers)
    app.router.add_post("/tokenize", functools.partial(tokenize, gw))
    app.router.add_post("/detokenize", functools.partial(detokenize, gw))
    app.router.add_get("/version", functools.partial(version, gw))
