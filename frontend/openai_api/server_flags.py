"""vLLM 0.32's OpenAI-server flags that shape responses, with vLLM's meaning:

* ``--return-tokens-as-token-ids``: logprobs' tokens as ``token_id:N`` unless the
  request says otherwise (its own ``return_tokens_as_token_ids``);
* ``--enable-request-id-headers``: every response carries ``X-Request-Id``, the
  request's own header or a new uuid4 hex (vLLM's ``XRequestIdMiddleware``);
* ``--enable-prompt-tokens-details``: usage has ``prompt_tokens_details`` with the
  prompt tokens found in the prefix cache (``cached_tokens``);
* ``--enable-force-include-usage``: every stream carries usage, in each chunk and
  at its end, as ``stream_options: {include_usage, continuous_usage_stats}`` would;
* ``--chat-template-content-format``: a message's content reaches the chat
  template as a string (text parts joined by newlines) or as OpenAI's list of
  parts; auto: the list where the template loops over a message's content;
* ``--default-chat-template-kwargs``: a JSON object of chat-template variables
  under every request's own ``chat_template_kwargs`` (vLLM's ``merge_kwargs``).

Parsed by ``serve`` and the frontend (``add_server_flags``), read by the HTTP routes."""
from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from pagedserve.common.config import json_object

CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass(frozen=True)
class ServerFlags:
    return_tokens_as_token_ids: bool = False
    enable_request_id_headers: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: str | None = None  # a JSON object


_BOOLS = {"return_tokens_as_token_ids": "logprobs' tokens as token_id:N unless a request says otherwise",
          "enable_request_id_headers": "every response carries X-Request-Id (the request's, or a new uuid4 hex)",
          "enable_prompt_tokens_details": "usage.prompt_tokens_details.cached_tokens: prompt tokens found in the "
                                          "prefix cache",
          "enable_force_include_usage": "every stream carries usage, in each chunk and at its end"}


def add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI responses (vLLM's flags)")
    for name, text in _BOOLS.items():
        g.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=False,
                       help=f"{text} (default: off)")
    g.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                   help="a message's content in the chat template: string (text parts joined by newlines) or "
                        "openai (a list of parts); auto: openai where the template loops over the content "
                        "(default: auto)")
    g.add_argument("--default-chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="chat-template variables for every request, under its own chat_template_kwargs, e.g. "
                        "'{\"enable_thinking\": false}' (default: none)")


def server_flags(args: argparse.Namespace) -> ServerFlags:
    return ServerFlags(*(bool(getattr(args, n)) for n in _BOOLS), args.chat_template_content_format,
                       args.default_chat_template_kwargs)


def server_flags_argv(args: argparse.Namespace) -> list[str]:
    """The flags that rebuild them in the frontend process."""
    out = [*("--" + n.replace("_", "-") for n in _BOOLS if getattr(args, n)),
           "--chat-template-content-format", args.chat_template_content_format]
    if args.default_chat_template_kwargs is not None:
        out += ["--default-chat-template-kwargs", args.default_chat_template_kwargs]
    return out


def with_server_flags(flags: ServerFlags, x: Any, body: dict[str, Any]) -> Any:
    """A request's extras (``openai_extras.Extras``) with the server's defaults applied as vLLM applies them."""
    changes: dict[str, Any] = {}
    if flags.return_tokens_as_token_ids and body.get("return_tokens_as_token_ids") is None:
        changes["return_tokens_as_token_ids"] = True
    if flags.enable_force_include_usage and x.stream:  # vLLM's should_include_usage: (True, True)
        changes.update(include_usage=True, continuous_usage=True)
    if flags.default_chat_template_kwargs is not None:  # the request's own win, unless None or "auto"
        own = {k: v for k, v in x.template_kwargs.items() if v is not None and v != "auto"}
        changes["template_kwargs"] = {**json.loads(flags.default_chat_template_kwargs), **own}
    return replace(x, **changes) if changes else x


def install(app: Any, flags: ServerFlags) -> None:
    """The HTTP app's hooks for these flags."""
    if flags.enable_request_id_headers:
        app.on_response_prepare.append(request_id_header)


async def request_id_header(request: Any, response: Any) -> None:
    """aiohttp's on_response_prepare: before the headers go out, streams included."""
    response.headers.add("X-Request-Id", request.headers.get("X-Request-Id") or uuid.uuid4().hex)


def prompt_tokens_details(cached: int, stream: bool) -> dict[str, Any]:
    """vLLM's PromptTokenUsageInfo: a stream's usage leaves its null fields out, a response keeps them."""
    return {"cached_tokens": cached} if stream else {"cached_tokens": cached, "created_cache_tokens": None,
                                                     "multimodal_tokens": None}


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """vLLM's _detect_content_format: openai when the template loops over a message's content."""
    import jinja2
    from jinja2 import nodes

    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateError:
        return "string"
    msg_vars = {loop.target.name for loop in ast.find_all(nodes.For)
                if isinstance(loop.iter, nodes.Name) and loop.iter.name == "messages"
                and isinstance(loop.target, nodes.Name)}

    def content_of(n: nodes.Node) -> bool:
        if isinstance(n, nodes.Getattr):
            return n.attr == "content" and isinstance(n.node, nodes.Name) and n.node.name in msg_vars
        if isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Const) and n.arg.value == "content":
            return isinstance(n.node, nodes.Name) and n.node.name in msg_vars
        return isinstance(n, nodes.Name) and n.name == "content"

    return "openai" if any(content_of(loop.iter) for loop in ast.find_all(nodes.For)) else "string"


def with_content_format(flags: ServerFlags, conv: list[dict[str, Any]], messages: Any, template: str | None,
                        tokenizer: Any) -> list[dict[str, Any]]:
    """``conv`` (one entry per request message, text content) as ``template`` (None: the
    tokenizer's) should see it."""
    template = str(template or getattr(tokenizer, "chat_template", "") or "")
    fmt = flags.chat_template_content_format
    fmt = detect_content_format(template) if fmt == "auto" else fmt
    if not isinstance(messages, list) or len(messages) != len(conv):
        return conv
    if fmt == "openai" and any("tool_calls" in m for m in conv) and "tool_calls" not in template:
        return conv  # render_chat writes the calls into the text itself
    out = []
    for m, original in zip(conv, messages):
        content = original.get("content") if isinstance(original, dict) else None
        texts = ([str(p.get("text", "")) for p in content] if isinstance(content, list)
                 else [content] if isinstance(content, str) else [])
        if fmt == "openai":
            out.append({**m, "content": [{"type": "text", "text": t} for t in texts]})
        elif isinstance(content, list):  # vLLM joins the non-empty text parts with newlines
            out.append({**m, "content": "\n".join(t for t in texts if t)})
        else:
            out.append(m)
    return out
