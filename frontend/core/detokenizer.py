"""Incremental detokenization that never splits a multi-byte character.

The text of each step is ``decode(window + new ids)`` minus ``decode(window)``,
where the window holds the ids since the previous emitted text (at first:
the last few prompt ids, so a first token keeps its leading space); text that
ends in U+FFFD (an incomplete UTF-8 sequence) is held back until a later
token completes it, and at the end of the output it is dropped, as vLLM's
detokenizer drops it (``final`` keeps it: whole beams, decoded at once).

A fast tokenizer (``backend_tokenizer``, a ``tokenizers.Tokenizer``) runs
this loop in Rust: ``tokenizers.decoders.DecodeStream``, one call per token,
the window's text cached between calls (vLLM's ``FastIncrementalDetokenizer``).
The Python loop below is the same computation through ``tokenizer.decode``,
used for a slow tokenizer, and from the step on where ``DecodeStream``
refuses (its window's text is not a prefix of the longer text, which the
Python loop slices by length): so the text is the same either way.
"""
from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_CONTEXT = 6  # prompt ids kept as left context, so a first token keeps its leading space


def fast_backend(tokenizer: Any) -> Tokenizer | None:
    """The Rust tokenizer behind a fast tokenizer (transformers' or frontend/core/tokenizer.py's), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, Tokenizer) else None


class IncrementalDetokenizer:
    """``skip_special_tokens`` and ``spaces_between_special_tokens`` as vLLM's
    request fields (the second only changes slow tokenizers' output, as in HF:
    ``tokenizer.decode`` of a fast tokenizer ignores it, and so does this)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        # The window: ids[:read] spelled the last emitted text, the ids after it are held.
        self._ids = list(prompt_ids[-_CONTEXT:])
        self._read = len(self._ids)
        self._kw = {"skip_special_tokens": skip_special_tokens, "clean_up_tokenization_spaces": False}
        if not spaces_between_special_tokens:
            self._kw["spaces_between_special_tokens"] = False
        self._backend = fast_backend(tokenizer)
        self._stream: DecodeStream | None = None
        # As vLLM: any tokenizer with a Rust backend decodes through it. Not after a
        # context that ends inside a character: DecodeStream then starts its text
        # at the context's start (the context's text would be sent).
        if self._backend is not None and not (self._ids and self._decode(self._ids).endswith("\ufffd")):
            self._stream = DecodeStream(ids=self._ids, skip_special_tokens=skip_special_tokens)

    @property
    def fast(self) -> bool:
        """Whether ``DecodeStream`` still does the work (False: the Python loop)."""
        return self._stream is not None

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, **self._kw))

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """The new text of ``new_ids`` (one id at a time through DecodeStream).
        ``final``: the bytes still held are sent too, as U+FFFD."""
        if self._stream is not None:
            out: list[str] = []
            for i, tok in enumerate(new_ids):
                try:
                    text = self._stream.step(self._backend, tok)
                except Exception:  # noqa: BLE001 - InvalidPrefix (a Rust error, no class of its own)
                    self._stream = None  # the Python loop from here on, from the same window
                    out.append(self._add_py(new_ids[i:], final))
                    return "".join(out)
                self._ids.append(tok)
                if text is not None:
                    self._advance()
                    out.append(text)
            if final and self._read < len(self._ids):
                out.append(self._add_py([], True))  # the held bytes, as U+FFFD
            return "".join(out)
        return self._add_py(new_ids, final)

    def _advance(self) -> None:
        """The window moves on: the text just emitted becomes its start."""
        del self._ids[:self._read]
        self._read = len(self._ids)

    def _add_py(self, new_ids: list[int], final: bool) -> str:
        self._ids += new_ids
        prefix_text = self._decode(self._ids[:self._read])
        new_text = self._decode(self._ids)
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        self._advance()
        return new_text[len(prefix_text):]


def decode_whole(tokenizer: Any, prompt_ids: list[int], ids: list[int], skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> str:
    """The text of ``ids`` decoded at once after the prompt's context (a whole
    beam): an incomplete character at the end stays, as U+FFFD."""
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, spaces_between_special_tokens)._add_py(
        list(ids), True)
