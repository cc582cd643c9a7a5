"""The prompt's token ids as a router sees an OpenAI request body, before any
engine has it: the Ray ingress and the Kubernetes picker hash these into the
blocks they look up. Past the limits a router does not tokenize (the request
goes by load and the engine judges it)."""
from __future__ import annotations

from typing import Any

MAX_PROMPT_CHARS = 4_000_000
MAX_PROMPT_TOKENS = 1 << 20
MAX_MESSAGES = 10_000


def routing_token_ids(tok: Any, path: str, body: dict[str, Any]) -> list[int] | None:
    """``/v1/completions``: a text or id prompt (a batch of one included); otherwise chat
    ``messages`` through the tokenizer's chat template, with the request's tools."""
    if path == "/v1/completions":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1:  # a batch of one
            p = p[0]
        if isinstance(p, str) and 0 < len(p) <= MAX_PROMPT_CHARS:
            return list(tok.encode(p))
        if isinstance(p, list) and 0 < len(p) <= MAX_PROMPT_TOKENS and all(type(t) is int for t in p):
            return p
        return None
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not 0 < len(msgs) <= MAX_MESSAGES or len(str(msgs)) > MAX_PROMPT_CHARS:
        return None
    tools = body.get("tools") if isinstance(body.get("tools"), list) else None
    return list(tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))
