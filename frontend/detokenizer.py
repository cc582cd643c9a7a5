"""Incremental detokenization that never splits a multi-byte character.

Each step decodes a short window of ids twice (with and without the new
ids) and emits the difference; text that ends in U+FFFD (an incomplete UTF-8
sequence) is held back until the next token completes it.
"""
from __future__ import annotations

from typing import Any

_CONTEXT = 6  # prompt ids kept as left context, so a first token keeps its leading space


class IncrementalDetokenizer:
    """``skip_special_tokens`` and ``spaces_between_special_tokens`` as vLLM's
    request fields (the second only changes slow tokenizers' output, as in HF)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._kw = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
        if not spaces_between_special_tokens:
            self._kw["spaces_between_special_tokens"] = False

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, **self._kw))

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self._ids += new_ids
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text):]
