"""``deepseek_r1`` (DeepSeek-R1 and its distills): ``<think>...</think>``.
The start marker may be missing (the chat template puts it in the prompt):
text before ``</think>`` is reasoning; an output that never closes it is all
reasoning. Streaming reads marker token ids, as vLLM's parser of the name."""
from __future__ import annotations

from collections.abc import Sequence, Set

from pagedserve.frontend.openai_api.reasoning.base import Delta, ReasoningParser, delta

START, END = "<think>", "</think>"


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    needs_tokens = (START, END)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.start_id, self.end_id = self.vocab[START], self.vocab[END]

    def extract(self, text: str) -> tuple[str | None, str | None]:
        before, mark, after = text.partition(START)
        text = after if mark else before
        if END not in text:
            return text, None
        reasoning, _, content = text.partition(END)
        return reasoning, content or None

    def prompt_ends_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        for t in reversed(prompt_ids):  # the last marker of the prompt decides
            if t == self.start_id:
                return False
            if t == self.end_id:
                return True
        return False

    def _cut(self, text: str) -> Delta:
        # vLLM cuts at find(): -1 (the marker's text absent) cuts before the last character
        at = text.find(END)
        return delta(text[:at], text[at + len(END):] or None)

    def step(self, text: str, ids: Sequence[int], previous_ids: Set[int]) -> tuple[Delta | None, bool]:
        ended = self.end_id in ids
        if len(ids) == 1 and ids[0] in (self.start_id, self.end_id):
            return None, ended
        if self.start_id in previous_ids:
            if self.end_id in ids:
                return self._cut(text), ended
            return (delta(content=text) if self.end_id in previous_ids else delta(text)), ended
        if self.start_id in ids:
            start = text.find(START)
            if self.end_id in ids:
                at = text.find(END)
                return delta(text[start + len(START):at], text[at + len(END):] or None), ended
            return delta(text), ended
        # no start marker yet: reasoning until the end marker (the override of vLLM's base)
        if self.end_id in ids:
            return self._cut(text), ended
        return (delta(content=text) if self.end_id in previous_ids else delta(text)), ended
