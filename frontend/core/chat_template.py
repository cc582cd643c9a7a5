"""Chat templating, once for every API (gRPC messages, OpenAI chat, /tokenize).

A template that knows tool calls renders them itself; for one that does not,
tools are listed in a system message and calls written into the content as
``<tool_call>`` blocks, so any chat model can be asked for them.
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.frontend.core.validation import ValidationError


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, template: str | None = None,
                kwargs: dict[str, Any] | None = None) -> str:
    """The templated prompt text (tools and tool calls included). It holds the
    special tokens the template wants: tokenize it without adding more.
    ``template`` replaces the tokenizer's; ``kwargs`` go to the template as vLLM's
    ``chat_template_kwargs`` do (``continue_final_message``, ``documents``, ...;
    an ``add_generation_prompt`` there wins over the argument)."""
    template = template or str(getattr(tokenizer, "chat_template", "") or "")
    kw: dict[str, Any] = {"add_generation_prompt": add_generation_prompt, **(kwargs or {})}
    if template != getattr(tokenizer, "chat_template", None):
        kw["chat_template"] = template
    has_calls = any("tool_calls" in m for m in conv)
    if "tool_calls" in template or not (tools or has_calls):
        if tools:
            kw["tools"] = tools
        return _apply(tokenizer, conv, kw)
    plain = [_plain(m) for m in conv]
    if tools:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        text = f"You may call these functions:\n<tools>\n{listing}\n</tools>"
        if plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": plain[0]["content"] + "\n\n" + text}
        else:
            plain.insert(0, {"role": "system", "content": text})
    return _apply(tokenizer, plain, kw)


def _apply(tokenizer: Any, conv: list[dict[str, Any]], kw: dict[str, Any]) -> str:
    try:
        return str(tokenizer.apply_chat_template(conv, tokenize=False, **kw))
    except Exception as e:  # a template's own error (jinja2, or a bad kwarg combination): the request's fault
        raise ValidationError("messages", f"the chat template failed: {str(e)[:500]}") from None


def _plain(m: dict[str, Any]) -> dict[str, str]:
    content = m["content"]
    for c in m.get("tool_calls", []):
        call = json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        content += ("\n" if content else "") + f"<tool_call>\n{call}\n</tool_call>"
    return {"role": m["role"], "content": content}
