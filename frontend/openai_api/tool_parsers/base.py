"""The tool-call parser protocol, after vLLM 0.32's ``ToolParser`` driven by its
``DelegatingParser`` (no reasoning parser): ``parse`` takes a whole output,
``feed`` one streamed text delta at a time.

A streamed delta is the dict vLLM's ``DeltaMessage`` serializes to (only the
keys its parser set): ``{"content": ...}`` and/or ``{"tool_calls": [{"index",
"id", "type", "function": {"name", "arguments"}}, ...]}``; ``None``: nothing to
send yet. Calls are ``{"id", "type": "function", "function": {"name",
"arguments"}}`` with ``arguments`` JSON text.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

Call = dict[str, Any]
Delta = dict[str, Any]


def tool_call_id() -> str:
    # vLLM's make_tool_call_id: "chatcmpl-tool-" + 16 hex digits of a uuid4
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


def call(name: object, arguments: str, id_: str | None = None) -> Call:
    if not isinstance(name, str):  # vLLM's FunctionCall model refuses it: the output stays text
        raise TypeError("a tool name must be a string")
    return {"id": id_ or tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def partial_tag_overlap(text: str, tag: str) -> int:
    """The longest proper prefix of ``tag`` that ``text`` ends with (a tag still arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class ToolParser:
    """One per generated sequence (streaming keeps state)."""

    name: ClassVar[str]
    # A vocabulary entry the parser cannot work without (vLLM fails at start-up without it).
    needs_token: ClassVar[str | None] = None
    # vLLM's structural_tag_model, where we build its grammar (frontend/openai_api/tool_grammar.py): named and
    # "required" tool choice are then read by this parser under that grammar, as vLLM does.
    structural_tag: ClassVar[str | None] = None
    # vLLM's adjust_request turns skip_special_tokens off for a request with tools (and
    # tool_choice not "none"): its tags may be special tokens of some models.
    keeps_special_tokens: ClassVar[bool] = False
    # The request's tools (a parser that types arguments by their schema reads them: qwen3_xml).
    tools: list[dict[str, Any]] | None = None
    # vLLM's skip_reasoning_parsing: think markers are plain content unless a reasoning parser ran first.
    reasoning_markup_is_text: bool = True
    # vLLM's engine-based parsers: a whole output without calls answers the parser's content, not the text.
    engine_based: ClassVar[bool] = False

    def __init__(self) -> None:
        # vLLM's shared streaming state: what each call parsed and what was sent of its arguments
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.streamed_args_for_tool: list[str] = []
        self.current_tool_id = -1
        self.current_tool_name_sent = False
        self._text = ""

    # ------------------------------------------------------------ to implement
    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a whole output; no calls: (text, [])."""
        raise NotImplementedError

    def extract_streaming(self, previous: str, current: str, delta: str) -> Delta | None:
        raise NotImplementedError

    # ------------------------------------------------------------ the driver
    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """The answer's (content, tool_calls): whitespace-only content beside calls is None."""
        try:
            content, calls = self.extract(text)
        except Exception:  # vLLM logs and answers the raw text
            return text, []
        if calls and content is not None and not content.strip():
            content = None
        return content, calls

    def feed(self, delta: str, finished: bool) -> Delta | None:
        current = self._text + delta
        try:
            msg = self.extract_streaming(self._text, current, delta)
        except Exception:  # vLLM: "Error trying to handle streaming tool call", nothing sent
            msg = None
        self._text = current
        if finished and msg and msg.get("tool_calls") and "function" in msg["tool_calls"][-1]:
            fn = msg["tool_calls"][-1]["function"]
            fn["arguments"] = (fn.get("arguments") or "") + self.remaining_args()
        return msg

    def remaining_args(self) -> str:
        """Arguments parsed but not streamed yet (vLLM's get_remaining_unstreamed_args)."""
        if not self.prev_tool_call_arr:
            return ""
        i = len(self.prev_tool_call_arr) - 1
        args = self.prev_tool_call_arr[i].get("arguments", {})
        expected = args if isinstance(args, str) else dumps(args)
        actual = self.streamed_args_for_tool[i] if i < len(self.streamed_args_for_tool) else ""
        return expected[len(actual):] if expected.startswith(actual) else ""


def check_vocab(cls: type[ToolParser], vocab: Mapping[str, int]) -> str | None:
    """Why this tokenizer cannot serve the parser, or None."""
    if cls.needs_token is not None and cls.needs_token not in vocab:
        return f"the tokenizer has no {cls.needs_token!r} token"
    return None
