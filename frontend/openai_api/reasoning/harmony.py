"""``openai_gptoss`` (gpt-oss): the harmony format, read as vLLM 0.32's
HarmonyParser reads it (vLLM parses the token ids with ``openai_harmony``;
here the text with its special tokens kept, which spells the same tokens).

An output is a series of messages: a header (``<|channel|>analysis``, or
``<|channel|>commentary to=functions.NAME <|constrain|>json``) up to
``<|message|>``, the text, then ``<|end|>``, ``<|call|>`` or ``<|return|>``;
each later message starts with ``<|start|>assistant``. ``analysis`` is
reasoning; ``final`` (and ``commentary`` without a recipient) is content; a
message to a function is a tool call (with ``--tool-call-parser openai``).
An output that ends inside a header (plain text, no harmony) is returned
whole as content; tokens where harmony expects ``<|start|>`` are dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pagedserve.frontend.openai_api.reasoning.base import Delta

Call = dict[str, Any]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
SPECIALS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS, "<|endoftext|>")
ROLES = ("assistant", "user", "system", "developer", "tool")
BUILTIN_TOOLS = ("python", "browser", "container")  # vLLM's MCP-served tools: not function calls
_LEX = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


DONE = ("", "done", None)
Segment = tuple[str, str | None, str | None] | None


def tool_call_id() -> str:
    # vLLM's make_tool_call_id (as tool_parsers.base's, which imports this module's package)
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


class HeaderError(ValueError):
    pass


def parse_header(text: str, role: str | None) -> tuple[str, str | None, str | None, str | None]:
    """(role, channel, recipient, content type) of a header, as openai_harmony splits it."""
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        after = text[at + len(CHANNEL):]
        end = next((i for i, c in enumerate(after) if c.isspace() or c == "<"), len(after))
        if end == 0:
            raise HeaderError("channel marker present but no channel value found in header")
        channel, text = after[:end], text[:at] + after[end:]
    parts = text.split()
    if role is None:
        if not parts or parts[0] not in ROLES:
            raise HeaderError("unknown role")
        role = parts.pop(0)
    recipient = ctype = None
    if parts:
        p = parts.pop(0)
        recipient = p[3:] if p.startswith("to=") else p
    if parts:
        ctype = parts.pop(0)
    if parts:
        raise HeaderError("unexpected tokens remaining in message header")
    if recipient is not None and CONSTRAIN in recipient:  # vLLM's _normalize_recipient
        recipient = recipient[:recipient.find(CONSTRAIN)].rstrip() or None
    return role, channel, recipient, ctype


def is_function(recipient: str | None) -> bool:
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in BUILTIN_TOOLS


def kind(channel: str | None, recipient: str | None) -> str:
    if is_function(recipient):
        return "tool"
    if channel == "analysis":
        return "reasoning"
    if channel == "final" or (channel == "commentary" and recipient is None):
        return "content"
    return "ignore"


class HarmonyParser:
    """One per generated sequence: ``parse`` a whole output or ``feed`` deltas."""

    name = "openai_gptoss"
    needs_tokens = (START, CHANNEL, MESSAGE, "<|end|>")
    keeps_special_tokens = True

    def __init__(self, reasoning: bool = True, tools: bool = False) -> None:
        self.reasoning, self.tools = reasoning, tools
        self._reset()
        self._next_call = 0

    def _reset(self) -> None:
        self.state = "header"  # "header", "content" or "start" (expecting <|start|>)
        self.role: str | None = "assistant"
        self.header = ""
        self.channel: str | None = None
        self.recipient: str | None = None
        self.ctype: str | None = None
        self.body = ""
        self.raw = ""  # text since the last complete message (the recovery of an unfinished one)
        self.messages: list[dict[str, Any]] = []

    def _piece(self, mark: str | None, text: str) -> Segment:
        """One token's worth: (text delta, channel, recipient); DONE: a message completed;
        None: a token openai_harmony refuses (dropped)."""
        if self.state == "start":
            if mark != START:
                return None  # harmony expects <|start|> here
            self.state, self.role, self.header = "header", None, ""
            self.raw += text
            return "", None, None
        if self.state == "header":
            if mark != MESSAGE:
                self.header += text
                self.raw += text
                return "", None, None
            try:
                self.role, self.channel, self.recipient, self.ctype = parse_header(self.header, self.role)
            except HeaderError:
                self.state = "start"
                return None
            self.state, self.body = "content", ""
            self.raw += text
            return "", self.channel, self.recipient
        if mark in ENDS:
            self._complete()
            return DONE
        self.body += text
        self.raw += text
        return text, self.channel, self.recipient

    def _complete(self) -> None:
        self.messages.append({"role": self.role, "channel": self.channel, "recipient": self.recipient,
                              "ctype": self.ctype, "text": self.body})
        self.state, self.raw = "start", ""
        self.channel = self.recipient = None

    def _eos(self) -> str | None:
        """The end of the output: a body in progress completes; an unfinished header is
        returned as raw text (vLLM's recovery: a final message of the undecoded tokens)."""
        out = None
        if self.state == "content":
            self._complete()
        elif self.state == "header":
            out = self.raw
            self.messages.append({"role": "assistant", "channel": "final", "recipient": None, "ctype": None,
                                  "text": out})
        return out

    @staticmethod
    def _pieces(text: str) -> list[tuple[str | None, str]]:
        return [(p if i % 2 else None, p) for i, p in enumerate(_LEX.split(text)) if p]

    def parse(self, text: str) -> tuple[str | None, str | None, list[Call]]:
        for mark, piece in self._pieces(text):
            self._piece(mark, piece)
        self._eos()
        reasoning, content, calls = [], [], []
        for m in self.messages:
            if m["role"] != "assistant":
                continue
            k = kind(m["channel"], m["recipient"])
            if k == "reasoning" and self.reasoning and m["text"]:
                reasoning.append(m["text"])
            elif k == "content" and m["text"]:
                content.append(m["text"])
            elif k == "tool" and self.tools:
                args = m["text"]
                if m["ctype"] is None or "json" in m["ctype"]:
                    try:
                        args = json.dumps(json.loads(args))
                    except json.JSONDecodeError:
                        pass
                calls.append({"id": tool_call_id(), "type": "function",
                              "function": {"name": m["recipient"].removeprefix("functions."), "arguments": args}})
        self._reset()
        return "\n".join(reasoning) or None, "\n".join(content) or None, calls

    def feed(self, text: str, finished: bool) -> Delta | None:
        prev = self.recipient
        content, reasoning = "", ""
        calls: list[dict[str, Any]] = []
        segments = [self._piece(mark, piece) for mark, piece in self._pieces(text)]
        if finished:
            ended_in = self.state
            recovered = self._eos()
            if recovered is not None:
                segments.append((recovered, "final", None))
            if ended_in != "start":
                segments.append(DONE)
        for seg in segments:
            if seg is None:
                continue
            if seg is DONE:  # a message completed here
                prev = None
                continue
            d, channel, recipient = seg
            k = kind(channel, recipient)
            if k == "reasoning" and self.reasoning:
                reasoning += d
            elif k == "content":
                content += d
            elif k == "tool" and self.tools:
                if prev != recipient:
                    calls.append({"id": tool_call_id(), "type": "function", "index": self._next_call,
                                  "function": {"name": recipient.removeprefix("functions."), "arguments": d}})
                    self._next_call += 1
                    prev = recipient
                elif d:
                    if calls:
                        calls[-1]["function"]["arguments"] += d
                    else:
                        calls.append({"index": self._next_call - 1, "function": {"arguments": d}})
        if finished:
            self._next_call = 0
            self._reset()
        if not content and not reasoning and not calls:
            return None
        out: Delta = {}
        if content:
            out["content"] = content
        if reasoning:
            out["reasoning"] = reasoning
        if calls:
            out["tool_calls"] = calls
        return out
