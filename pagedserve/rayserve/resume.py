"""Resuming a stream whose replica died mid-way, on another replica, so the
client sees one answer (a completion or a chat answer streamed as SSE).

The ingress forwards a stream event by event (whole ``data:`` events, as the
engine writes them) and keeps what the client has seen: the response's id,
created time and the text so far. When the replica dies, the continuation is
the same body with that text appended: to the prompt (completions), or as the
assistant's message to continue (chat: ``continue_final_message``); the token
budget is reduced by the tokens already streamed. Its events get the original
id and created time, and the chat role chunk is not repeated.

Only a stream that a continuation reproduces is resumed: one choice (n 1), no
logprobs, no tools and no structured output (a grammar would restart at the
continuation). Others end with an OpenAI error event, as before."""
from __future__ import annotations

import copy
import json
from typing import Any

BLOCKERS = ("tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar", "logprobs", "top_logprobs", "echo", "best_of", "prompt_logprobs",
            "continue_final_message")


class StreamState:
    def __init__(self, path: str, raw: bytes) -> None:
        self.path = path
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self.body: dict[str, Any] | None = body if isinstance(body, dict) else None
        self.buf = b""
        self.text = ""
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.streamed_tokens = 0
        self.done = False  # [DONE] or a finish reason seen: nothing to resume
        self.resumed = 0

    # ------------------------------------------------------------ what the client saw
    def events(self, chunk: bytes) -> list[bytes]:
        """Whole events out of the bytes so far (each forwarded as is), the rest kept for the next chunk."""
        self.buf += chunk
        out = []
        while b"\n\n" in self.buf:
            ev, self.buf = self.buf.split(b"\n\n", 1)
            out.append(ev + b"\n\n")
            self._saw(ev)
        return out

    def _saw(self, ev: bytes) -> None:
        data = ev.decode("utf-8", "replace").removeprefix("data: ").strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        self.id = self.id or obj.get("id")
        self.created = self.created or obj.get("created")
        self.model = self.model or obj.get("model")
        for ch in obj.get("choices") or ():
            piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
            self.text += piece or ""
            self.done = self.done or bool(ch.get("finish_reason"))

    # ------------------------------------------------------------ the continuation
    def resumable(self) -> bool:
        b = self.body
        if b is None or self.done or not b.get("stream") or b.get("n", 1) not in (1, None):
            return False
        if any(b.get(k) not in (None, False, [], {}) for k in BLOCKERS):
            return False
        if self.path == "/v1/completions":
            p = b.get("prompt")
            return isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))
        return self.path == "/v1/chat/completions" and isinstance(b.get("messages"), list)

    def continuation(self, count_tokens: Any) -> bytes | None:
        """The body that goes on from what was streamed; None when the budget is spent."""
        assert self.body is not None
        b = copy.deepcopy(self.body)
        done = count_tokens(self.text) if self.text else 0
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(b.get(key), int):
                b[key] -= done
                if b[key] < 1:
                    return None
        if self.text and self.path == "/v1/completions":
            p = b["prompt"]
            b["prompt"] = p + self.text if isinstance(p, str) else p + count_tokens(self.text, ids=True)
        elif self.text:
            b["messages"] = [*b["messages"], {"role": "assistant", "content": self.text}]
            b["continue_final_message"], b["add_generation_prompt"] = True, False
        if isinstance(b.get("min_tokens"), int):
            b["min_tokens"] = max(0, b["min_tokens"] - done)
        self.streamed_tokens = done
        return json.dumps(b).encode()

    def rewrite(self, ev: bytes) -> bytes | None:
        """A continuation's event as part of the original stream (None: drop it)."""
        data = ev.decode("utf-8", "replace").removeprefix("data: ").strip()
        if data == "[DONE]":
            return ev
        try:
            obj = json.loads(data)
        except ValueError:
            return ev
        if not isinstance(obj, dict):
            return ev
        if self.id:
            obj["id"] = self.id
        if self.created:
            obj["created"] = self.created
        choices = obj.get("choices") or []
        if choices and all(set((c.get("delta") or {})) <= {"role", "content"} and not (c.get("delta") or {})
                           .get("content") and (c.get("delta") or {}).get("role") and not c.get("finish_reason")
                           for c in choices):
            return None  # the role chunk: the client had it
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            n = self.streamed_tokens
            usage["prompt_tokens"] -= n
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + n
        return f"data: {json.dumps(obj)}\n\n".encode()
