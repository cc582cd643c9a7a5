"""scheduler <-> gpuworker.

Per-sequence state is sent once (``NewSeq``), then each step carries only what
changed: block-table diffs and how many tokens to compute, as in vLLM v1. The
worker keeps every sequence's token ids and appends the tokens it samples, so
the scheduler never resends them.
"""
from __future__ import annotations

import msgspec

from pagedserve.common.blocks import usable_gpu_blocks
from pagedserve.common.messages.types import ComponentRefusal, ModelInfo, SamplingParams, StructuredSpec

# Compiled grammars the worker keeps (LRU); the scheduler's GrammarGate mirrors the set.
GRAMMAR_CACHE_SIZE = 256


class NewSeq(msgspec.Struct, array_like=True):
    """A sequence the worker has not seen (or re-sees after recompute).

    No blocks: its table arrives as ``BlockDiff``s in the same step (applied
    after ``new_seqs``), the blockmgr's diffs being the table's only source."""

    seq_id: int
    token_ids: list[int]  # prompt, plus already generated tokens after a recompute preemption
    num_computed_tokens: int  # tokens whose K/V is already in the pool (prefix-cache hits)
    params: SamplingParams
    num_prompt_tokens: int  # so penalties and seeds know where the output starts


class BlockDiff(msgspec.Struct, array_like=True):
    """Replace the sequence's block table from ``table_start`` on."""

    seq_id: int
    table_start: int
    block_ids: list[int]
    group: int = 0  # the KV cache group's table (hybrid models; 0 for dense ones)


class ScheduledSeq(msgspec.Struct, array_like=True):
    """Compute the next ``num_tokens`` tokens of this sequence this step.

    The worker samples a new token only when these reach the end of the
    sequence's known tokens (the last chunk of a prefill, or a decode)."""

    seq_id: int
    num_tokens: int


class ExecuteStep(msgspec.Struct, tag=30, array_like=True):
    step_id: int
    new_seqs: list[NewSeq]
    block_diffs: list[BlockDiff]
    scheduled: list[ScheduledSeq]  # batch order
    finished: list[int]  # seq ids whose state the worker drops (before the step)
    # Executed before the forward, in this order: swap_out, swap_in, copies
    # (a block released by an earlier op of the step may be a later op's destination).
    copies: list[tuple[int, int]] = []  # copy-on-write, (src, dst)
    swap_in: list[tuple[int, int]] = []  # (cpu, gpu)
    swap_out: list[tuple[int, int]] = []  # (gpu, cpu)
    # Swapped-out sequences keep their worker state but are not scheduled.
    # Grammars to compile off the step path (scheduler/grammar_gate.py); each
    # is answered once, in a later StepResult.grammars.
    compile: list[StructuredSpec] = []


class InitWorker(msgspec.Struct, tag=31, array_like=True):
    pass


class ResetWorker(msgspec.Struct, tag=32, array_like=True):
    """Drop every sequence's state (tests reuse one worker)."""


class Shutdown(msgspec.Struct, tag=33, array_like=True):
    pass


Request = ExecuteStep | InitWorker | ResetWorker | Shutdown


class SampledToken(msgspec.Struct, array_like=True):
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = []


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt positions computed this step (params.prompt_logprobs)."""

    seq_id: int
    start: int  # position of the first entry's token in the sequence
    # per position: (logprob of the actual token, top-k (token, logprob))
    entries: list[tuple[float, list[tuple[int, float]]]]
    # per entry: vLLM's rank of the actual token in the vocabulary (how many
    # logprobs are >= its own); empty from a peer that does not send ranks
    ranks: list[int] = []


class GrammarStatus(msgspec.Struct, array_like=True):
    """An asked grammar finished compiling (``error`` None) or failed."""

    spec: StructuredSpec
    error: str | None = None


class StepResult(msgspec.Struct, tag=40, array_like=True):
    step_id: int
    sampled: list[SampledToken]  # one per scheduled sequence that reached its end
    forward_time_s: float = 0.0
    prompt_logprobs: list[PromptLogprobs] = []
    grammars: list[GrammarStatus] = []  # compiles finished since the last step


class WorkerReady(msgspec.Struct, tag=41, array_like=True):
    model: ModelInfo
    num_gpu_blocks: int  # the pool, null block included
    num_cpu_blocks: int
    block_size: int
    # Hybrid KV cache: per KV cache group, 0 (full attention) or its sliding
    # window; empty for a dense pool (one table per sequence).
    kv_group_windows: list[int] = []

    @property
    def num_usable_gpu_blocks(self) -> int:
        return usable_gpu_blocks(self.num_gpu_blocks)


class WorkerError(ComponentRefusal, tag=42):
    pass


class WorkerAck(msgspec.Struct, tag=43, array_like=True):
    pass


Reply = StepResult | WorkerReady | WorkerError | WorkerAck
