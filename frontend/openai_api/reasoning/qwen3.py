"""``qwen3`` (Qwen3, QwQ): ``<think>...</think>``, read as vLLM 0.32's Qwen3
parser engine reads it with tool parsing off:

* the output starts inside the reasoning (the chat template opened it);
  ``<think>`` there is dropped, ``</think>`` ends it, and so does
  ``<tool_call>`` (which stays, as content, for the tool parser);
* in the content a repeated ``</think>`` is dropped (whole output only: a
  stream sends the text after the reasoning as it comes);
* the tokenizer's other special tokens are dropped;
* ``enable_thinking: false`` (chat_template_kwargs): no reasoning at all.

Whole outputs find markers by text; streams by token id, and the prompt's
last marker (back to the turn's ``<|im_start|>``) says whether the output
starts inside the reasoning."""
from __future__ import annotations

import re
from collections.abc import Sequence, Set

from pagedserve.frontend.openai_api.reasoning.base import Delta, ReasoningParser, delta, split_markers

START, END, TOOL_START, TOOL_END = "<think>", "</think>", "<tool_call>", "</tool_call>"
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    keeps_special_tokens = True
    engine_based = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        v = self.vocab
        markers = (START, END, TOOL_START, TOOL_END)
        self._drops = tuple(s for s in self.specials if s not in markers)
        self._marks = {v[m]: m for m in (*markers, *self._drops) if m in v}
        self._ends = {v[m] for m in (END, TOOL_START) if m in v}
        self._start_id = v.get(START)
        self._bounds = {v[m] for m in TURN_BOUNDARIES if m in v}
        literals = sorted({*markers, *self._drops}, key=len, reverse=True)
        self._lex = re.compile("(" + "|".join(re.escape(m) for m in literals) + ")")
        self._in_reasoning = self.thinking

    def _run(self, pieces: list[tuple[str | None, str]]) -> tuple[str, str, bool]:
        """(reasoning, content, ended) of marked pieces, from the current state."""
        reasoning, content, ended = [], [], False
        for mark, text in pieces:
            if mark in self._drops:
                continue
            if self._in_reasoning:
                if mark == START:
                    continue
                if mark in (END, TOOL_START):
                    self._in_reasoning, ended = False, True
                    if mark == TOOL_START:
                        content.append(text)
                    continue
                reasoning.append(text)
            elif mark != END:
                content.append(text)
        return "".join(reasoning), "".join(content), ended

    def extract(self, text: str) -> tuple[str | None, str | None]:
        if not self.thinking:
            return None, text
        self._in_reasoning = True
        pieces = [(p if i % 2 else None, p) for i, p in enumerate(self._lex.split(text)) if p]
        reasoning, content, _ = self._run(pieces)
        return reasoning or None, content or None

    def prompt_ends_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        for t in reversed(prompt_ids):
            if t in self._ends:
                return True
            if t == self._start_id:
                return False
            if t in self._bounds:
                break
        return not self.thinking

    def step(self, text: str, ids: Sequence[int], previous_ids: Set[int]) -> tuple[Delta | None, bool]:
        reasoning, content, ended = self._run(split_markers(text, ids, self._marks))
        if not reasoning and not content:
            return None, ended
        return delta(reasoning or None, content or None), ended
