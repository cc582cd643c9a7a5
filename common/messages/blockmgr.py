"""scheduler <-> blockmgr: one batched request per scheduler step.

The scheduler sends a ``StepRequest`` holding every memory operation of the
step, in the order they must be applied (frees first, then appends of running
sequences oldest first, then admissions in FCFS order). The blockmgr applies
them in order and answers one ``StepReply`` whose results pair one to one
with the ops (one entry per sequence an op names: a ``SeqResult``, or None
when the block table did not change), plus the copy-on-write copies and the
swap mappings the worker must execute before the forward pass.

An op that cannot get memory changes nothing and answers ``no_room``; once
one op has answered ``no_room``, every later ``Allocate`` and ``SwapIn`` in
the same request answers ``no_room`` too, so FCFS order is kept.
"""
from __future__ import annotations

import enum

import msgspec

from pagedserve.common.blocks import kv_usage
from pagedserve.common.messages.types import ComponentRefusal


class Allocate(msgspec.Struct, tag=1, array_like=True):
    """Admit a new sequence. Reuses the cached full-block prefix of
    ``token_ids`` (never the whole prompt: the last token is always computed),
    then allocates blocks for ``num_new_tokens`` more tokens, capped at the
    prompt's end. ``token_ids`` is the whole prompt (hashing needs it)."""

    seq_id: int
    token_ids: list[int]
    num_new_tokens: int
    cache_salt: str | None = None
    # Compute every prompt position (prompt logprobs need them all): no lookup.
    # The blocks it fills are still cached for later requests (as vLLM does).
    skip_prefix_lookup: bool = False


class Append(msgspec.Struct, tag=2, array_like=True):
    """Reserve slots for ``token_ids``, the next tokens whose K/V this step
    writes (a prefill chunk, or the last sampled token). Allocates a block
    only when the last one is full; copies-on-write a shared last block.

    Async scheduling plans a step while the worker still samples the
    previous one: ``num_lookahead`` more slots are reserved for tokens not
    sampled yet. Their ids come first in a later Append's ``token_ids``
    (they fill those slots; only the rest take new ones), and only then do
    the blocks they fill get prefix-cache keys."""

    seq_id: int
    token_ids: list[int]
    num_lookahead: int = 0


class Free(msgspec.Struct, tag=3, array_like=True):
    """Drop the sequence's block table (GPU or CPU) and its references."""

    seq_id: int


class Fork(msgspec.Struct, tag=4, array_like=True):
    """The child shares every block of the parent (ref counts go up)."""

    parent_seq_id: int
    child_seq_id: int


class SwapOut(msgspec.Struct, tag=5, array_like=True):
    """Move a whole sequence group to CPU blocks; shared blocks move once."""

    seq_ids: list[int]


class SwapIn(msgspec.Struct, tag=6, array_like=True):
    """Move a swapped-out group back to GPU blocks."""

    seq_ids: list[int]


Op = Allocate | Append | Free | Fork | SwapOut | SwapIn


def answered_seq_ids(op: Op) -> list[int]:
    """The sequences the answers to ``op`` stand for, in the order they come
    in ``StepReply.results``: one per sequence the op names."""
    if isinstance(op, (SwapOut, SwapIn)):
        return op.seq_ids
    if isinstance(op, Fork):
        return [op.child_seq_id]
    return [op.seq_id]


class StepRequest(msgspec.Struct, tag=10, array_like=True):
    ops: list[Op]
    # False for the first request of a scheduler step: the previous step's
    # forward pass has run, so the blocks it filled become prefix-cache hits.
    # True for the extra rounds of the same step (preemption): those blocks'
    # K/V is not written yet, and a sequence freed now must not leave them cached.
    continues_step: bool = False


# Share of the usable GPU blocks kept free when admitting (running sequences may
# still grow into it). Above vLLM's 1 %: the serving simulation shows it cuts
# recompute thrash under overload 4-5x (docs/serving-sim.md). The one default:
# EngineConfig, InitRequest and BlockManager all read it from here.
DEFAULT_WATERMARK = 0.05


class InitRequest(msgspec.Struct, tag=11, array_like=True):
    """Sent once by the scheduler after the worker has sized the KV pool."""

    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    watermark: float = DEFAULT_WATERMARK
    # Hybrid KV cache (docs/blockmgr.md, "Sliding-window layers"): one entry per
    # KV cache group, 0 for a full-attention group, else the group's sliding
    # window. Empty: a dense model, one table per sequence (today's path).
    kv_group_windows: list[int] = []


class StatsRequest(msgspec.Struct, tag=12, array_like=True):
    pass


class ResetRequest(msgspec.Struct, tag=13, array_like=True):
    """Frees everything (tests and benchmarks reuse one process)."""


Request = StepRequest | InitRequest | StatsRequest | ResetRequest


class Status(enum.IntEnum):
    OK = 0
    NO_ROOM = 1


class SeqResult(msgspec.Struct, array_like=True):
    """How one op changed one sequence's GPU block table.

    The table from index ``table_start`` on is replaced by ``block_ids``
    (appended blocks; or, for copy-on-write, the new last block; or, after a
    swap-in or fork, the whole table)."""

    seq_id: int
    status: Status
    table_start: int = 0
    block_ids: list[int] = []
    num_cached_tokens: int = 0  # Allocate: prompt tokens found in the prefix cache
    num_scheduled_tokens: int = 0  # Allocate/Append: tokens given slots this step
    # Hybrid KV cache only: (group, table_start, block_ids) for every group whose
    # table changed (group 0's is also in table_start/block_ids). Empty for dense models.
    group_diffs: list[tuple[int, int, list[int]]] = []


class BlockStats(msgspec.Struct, tag=20, array_like=True):
    num_gpu_blocks: int
    num_free_gpu_blocks: int  # includes cached blocks with ref count 0 (evictable)
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    num_seqs: int
    prefix_cache_queries: int = 0  # blocks looked up
    prefix_cache_hits: int = 0  # blocks found
    num_shared_block_refs: int = 0  # references beyond the first: blocks saved by sharing
    # Free GPU blocks beyond the watermark (negative below it): what admissions
    # may take. Only the blockmgr knows the watermark; the scheduler reads this.
    num_admissible_gpu_blocks: int = 0

    @property
    def kv_usage(self) -> float:
        return kv_usage(self.num_free_gpu_blocks, self.num_gpu_blocks)


class StepReply(msgspec.Struct, tag=21, array_like=True):
    # One entry per sequence an op names, in the ops' order (Fork: the child;
    # SwapOut/SwapIn: each of the group); None: applied, block table unchanged.
    results: list[SeqResult | None]
    copies: list[tuple[int, int]]  # copy-on-write (src_gpu_block, dst_gpu_block)
    swap_out: list[tuple[int, int]]  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]]  # (cpu_block, gpu_block)
    stats: BlockStats


class ErrorReply(ComponentRefusal, tag=22):
    pass


class Ack(msgspec.Struct, tag=23, array_like=True):
    pass


Reply = StepReply | BlockStats | ErrorReply | Ack
