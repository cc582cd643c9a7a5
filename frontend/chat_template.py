"""Chat templating, once for every API (gRPC messages, OpenAI chat, /tokenize).

A template that knows tool calls renders them itself; for one that does not,
tools are listed in a system message and calls written into the content as
``<tool_call>`` blocks, so any chat model can be asked for them.
"""
from __future__ import annotations

import json
from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(tokenizer: Any, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The templated prompt text (tools and tool calls included). It holds the
    special tokens the template wants: tokenize it without adding more."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    has_calls = any("tool_calls" in m for m in conv)
    if "tool_calls" in template or not (tools or has_calls):
        kw: dict[str, Any] = {"tools": tools} if tools else {}
        return str(tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt, **kw))
    plain = [_plain(m) for m in conv]
    if tools:
        listing = "\n".join(json.dumps(t["function"]) for t in tools)
        text = f"You may call these functions:\n<tools>\n{listing}\n</tools>"
        if plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": plain[0]["content"] + "\n\n" + text}
        else:
            plain.insert(0, {"role": "system", "content": text})
    return str(tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt))


def _plain(m: dict[str, Any]) -> dict[str, str]:
    content = m["content"]
    for c in m.get("tool_calls", []):
        call = json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        content += ("\n" if content else "") + f"<tool_call>\n{call}\n</tool_call>"
    return {"role": m["role"], "content": content}
