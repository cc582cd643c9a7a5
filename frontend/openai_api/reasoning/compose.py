"""A reasoning parser and the tool-call parser after it, driven as vLLM 0.32's
``DelegatingParser`` drives them: the tool parser reads only the content after
the reasoning (whole outputs and streams), and a stream's deltas carry
``reasoning`` beside the tool parser's ``content`` / ``tool_calls``.

Stream: while the reasoning lasts, each delta goes to the reasoning parser;
the delta that ends it hands its content (an engine-based parser: everything
after the marker) to the tool parser as the tool parser's first text; after
that, deltas go to the tool parser, or out as content when there is none.
"""
from __future__ import annotations

from collections.abc import Sequence

from pagedserve.frontend.openai_api.reasoning.base import Delta, ReasoningParser
from pagedserve.frontend.openai_api.tool_parsers.base import Call, ToolParser


class Composer:
    """One per generated sequence."""

    def __init__(self, reasoning: ReasoningParser, tools: ToolParser | None,
                 prompt_ids: Sequence[int] | None = None) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.ended = prompt_ids is not None and reasoning.prompt_ends_reasoning(prompt_ids)
        self._previous_ids: set[int] = set()  # the ids so far (a set: read per delta)

    def parse(self, text: str) -> tuple[str | None, str | None, list[Call]]:
        reasoning, content = self.reasoning.extract(text)
        if self.tools is None:
            return reasoning, content, []
        parsed, calls = self.tools.parse(content if content is not None else "")
        if not calls and not (self.tools.engine_based and self.reasoning.engine_based):
            parsed = content  # vLLM: unless both parsers are engine-based, the text as it came
        return reasoning, parsed, calls

    def feed(self, text: str, ids: Sequence[int], finished: bool) -> Delta | None:
        msg: Delta | None = None
        transitioned = False
        if not self.ended:
            msg, ended = self.reasoning.step(text, ids, self._previous_ids)
            self._previous_ids.update(ids)
            if ended:
                self.ended = transitioned = True
                text = (msg or {}).get("content") or ""  # what the tool phase reads first
                if self.reasoning.engine_based and self.tools is None and text:
                    msg = {**(msg or {}), "content": text}
        if self.ended and self.tools is not None:
            reasoning = (msg or {}).get("reasoning")
            msg = self.tools.feed(text, finished)
            if reasoning:
                msg = {"reasoning": reasoning, **(msg or {})}
        elif msg is None and not transitioned and self.ended:
            msg = {"content": text}
        if finished and not self.ended and (rest := self.reasoning.finish()):
            msg = {**(msg or {}), **rest}
        return msg
