"""One sequence's block table, as the blockmgr (its only owner) keeps it."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.blockmgr.block_pool import Block


# A table entry for a block a sliding-window group released (hybrid KV cache):
# the null block, in no pool and never ref-counted. Tables hold it only before
# the window; dense models never see it. On the wire it is block 0.
NULL_ENTRY = Block(0)


class BlockManagerError(ValueError):
    """A protocol error (unknown or duplicate sequence, wrong state). Earlier
    ops of the same step stay applied: the caller should reset."""


# A table's state before the step's first Append: (step_no, num_tokens,
# last_key, tail, num_unknown). A swap-out later in the same step gives back the slots the
# step reserved (the sequence will not run). A plain tuple, not a NamedTuple:
# one is made per running sequence per step, and that costs 4x less.
StepStart = tuple[int, int, bytes, list[int], int]


@dataclass(slots=True, eq=False)
class SeqTable:
    """``tail`` holds the known token ids after the last keyed block and
    ``last_key`` that block's key (both only with prefix caching). The last
    ``num_unknown`` of the ``num_tokens`` slots are reserved for tokens not
    sampled yet (async scheduling, ``Append.num_lookahead``)."""

    table: list[Block]
    num_tokens: int
    tail: list[int]
    last_key: bytes
    on_cpu: bool = False
    step_start: StepStart | None = None
    num_unknown: int = 0

    def start_of(self, step_no: int) -> StepStart | None:
        """The snapshot taken in step ``step_no``, if this step appended to it."""
        s = self.step_start
        return s if s is not None and s[0] == step_no else None
