"""The reasoning-parser protocol, after vLLM 0.32's ``--reasoning-parser``
parsers driven by its ``DelegatingParser``: ``extract`` splits a whole output
into (reasoning, content); ``step`` reads one streamed delta (its text and
token ids) while the reasoning lasts and says when it ended.

A streamed delta is the dict vLLM's ``DeltaMessage`` serializes to:
``{"reasoning": ..., "content": ...}`` (keys only when set); None: nothing.
Markers are found by token id when streaming (a marker is one token: a
chunk never splits it) and by text in a whole output, as vLLM finds them.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any, ClassVar

Delta = dict[str, Any]


def delta(reasoning: str | None = None, content: str | None = None) -> Delta:
    out: Delta = {}
    if reasoning is not None:
        out["reasoning"] = reasoning
    if content is not None:
        out["content"] = content
    return out


def split_markers(text: str, ids: Sequence[int], markers: Mapping[int, str]) -> list[tuple[str | None, str]]:
    """A delta's text cut at its marker tokens: [(marker text or None for plain text, text)].
    A marker id whose text is not in the delta (held back or skipped) is passed over."""
    out: list[tuple[str | None, str]] = []
    pos = 0
    for t in ids:
        mark = markers.get(t)
        if mark is None:
            continue
        at = text.find(mark, pos)
        if at < 0:
            continue
        if at > pos:
            out.append((None, text[pos:at]))
        out.append((mark, mark))
        pos = at + len(mark)
    if pos < len(text):
        out.append((None, text[pos:]))
    return out


class ReasoningParser:
    """One per generated sequence (streaming keeps state)."""

    name: ClassVar[str]
    # Tokens the parser cannot work without (vLLM refuses to start without them).
    needs_tokens: ClassVar[tuple[str, ...]] = ()
    # vLLM's ParserEngine.adjust_request: special tokens stay in the text it parses.
    keeps_special_tokens: ClassVar[bool] = False
    # vLLM's engine-based parsers: the text after the end marker is flushed at the
    # transition, and a legacy tool parser then reads it (DelegatingParser).
    engine_based: ClassVar[bool] = False

    def __init__(self, vocab: Mapping[str, int], specials: Sequence[str] = (), thinking: bool = True) -> None:
        self.vocab = vocab
        self.specials = tuple(specials)  # the tokenizer's special tokens (qwen3 drops them)
        self.thinking = thinking  # chat_template_kwargs' enable_thinking

    def extract(self, text: str) -> tuple[str | None, str | None]:
        raise NotImplementedError

    def prompt_ends_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """vLLM's is_reasoning_end on the prompt: the output starts after the reasoning."""
        raise NotImplementedError

    def step(self, text: str, ids: Sequence[int], previous_ids: Set[int]) -> tuple[Delta | None, bool]:
        """(the delta, whether the reasoning ended in it); called until it ends. ``previous_ids``:
        the ids of the earlier deltas."""
        raise NotImplementedError

    def finish(self) -> Delta | None:
        """What is still held when the output ends inside the reasoning."""
        return None
