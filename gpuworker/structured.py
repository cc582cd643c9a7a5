"""Structured outputs in the worker: grammars compiled with xgrammar, one
``GrammarMatcher`` per constrained sequence, one batched token bitmask per step.

Per step, before sampling, ``apply`` fills one bitmask row for every
constrained sequence of the batch and masks those logits rows in place (the
CPU kernel on CPU, xgrammar's GPU kernel on CUDA); after sampling, ``advance``
feeds each matcher its sampled token. Once a grammar is complete its matcher
allows only the model's EOS ids, so a constrained sequence always ends with
EOS (the scheduler finishes it) or at max_tokens.

A recompute preemption (or any re-sent ``NewSeq``) rebuilds the matcher by
replaying the already generated tokens; swapped sequences keep theirs; each
sample of ``n > 1`` arrives as its own ``NewSeq`` and gets its own matcher.
Compiled grammars are cached by spec (all its fields: a request's
``disable_any_whitespace`` changes the grammar; the server's setting is one per
worker). xgrammar is imported on first use, so a
worker that never sees a spec does not need it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pagedserve.common.grammar import parse_grammar
from pagedserve.common.messages.types import SamplingParams, StructuredSpec
from pagedserve.common.messages.worker import GRAMMAR_CACHE_SIZE
from pagedserve.gpuworker.inputs import to_device

MAX_CACHED_GRAMMARS = GRAMMAR_CACHE_SIZE  # the scheduler's GrammarGate mirrors this set


class ConstrainedRow(Protocol):
    seq_id: int
    params: SamplingParams


def compile_spec(compiler: Any, spec: StructuredSpec, disable_any_whitespace: bool = False) -> Any:
    """xgrammar's compiled grammar of ``spec`` (no cache: any thread);
    ``disable_any_whitespace``: the server's --structured-outputs-config."""
    return compiler.compile_grammar(parse_grammar(spec, disable_any_whitespace))


class StructuredDecoding:
    """``tokenizer_dir``: the model folder (None: no tokenizer, every spec is
    refused). ``vocab_size``: the logits' width. ``disable_any_whitespace``:
    the server's setting (vLLM's StructuredOutputsConfig), for every JSON spec."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, eos_token_ids: tuple[int, ...],
                 disable_any_whitespace: bool = False) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.disable_any_whitespace = disable_any_whitespace
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.matchers: dict[int, Any] = {}
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self.compiled = 0  # grammars compiled (cache misses), for tests

    def compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer_dir is None:
                raise ValueError("structured outputs need the model's tokenizer; this worker has none")
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.eos_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def build(self, compiler: Any, spec: StructuredSpec) -> Any:
        """``compile_spec`` with this worker's setting (no cache: any thread)."""
        return compile_spec(compiler, spec, self.disable_any_whitespace)

    def compile(self, spec: StructuredSpec) -> Any:
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        compiled = self.build(self.compiler(), spec)
        self.keep(spec, compiled)
        return compiled

    def has(self, spec: StructuredSpec) -> bool:
        return spec in self._cache

    def keep(self, spec: StructuredSpec, compiled: Any) -> None:
        """A compiled grammar joins the cache (also one compiled off the step path:
        grammar_compiler.AsyncCompiles)."""
        self.compiled += 1
        self._cache[spec] = compiled
        if len(self._cache) > MAX_CACHED_GRAMMARS:
            self._cache.popitem(last=False)

    def add(self, seq_id: int, params: SamplingParams, output_ids: Sequence[int]) -> None:
        """A (re-)sent sequence: a fresh matcher that has seen ``output_ids``."""
        self.matchers.pop(seq_id, None)
        if params.structured is None:
            return
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(params.structured))
        for i, t in enumerate(output_ids):
            if not matcher.accept_token(t):
                raise ValueError(f"seq {seq_id}: generated token {t} (output position {i}) breaks its grammar")
        self.matchers[seq_id] = matcher

    def drop(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def clear(self) -> None:
        self.matchers.clear()

    def apply(self, logits: torch.Tensor, rows: Sequence[ConstrainedRow]) -> None:
        """Mask ``logits`` [len(rows), vocab] in place: one bitmask for all
        constrained rows of the batch."""
        if not self.matchers:
            return
        idx = [i for i, r in enumerate(rows) if r.seq_id in self.matchers]
        if not idx:
            return
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i in idx:
            m = self.matchers[rows[i].seq_id]
            if m.is_terminated():  # only EOS is left (the scheduler ends it on that token)
                self._eos_only(bitmask, i)
            else:
                m.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, to_device(bitmask, logits.device),
                                        vocab_size=self.vocab_size, indices=idx)

    def _eos_only(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.eos_token_ids:
            word, bit = divmod(t, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def advance(self, sampled: Sequence[tuple[int, int]]) -> None:
        """Feed each constrained sequence its sampled (seq_id, token)."""
        for seq_id, tok in sampled:
            m = self.matchers.get(seq_id)
            if m is None or m.is_terminated():
                continue
            if not m.accept_token(tok):
                raise RuntimeError(f"seq {seq_id}: sampled token {tok} is outside its grammar (mask not applied?)")
