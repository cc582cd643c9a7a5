"""One sequence's block table, as the blockmgr (its only owner) keeps it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedserve.blockmgr.block_pool import Block


class BlockManagerError(ValueError):
    """A protocol error (unknown or duplicate sequence, wrong state). Earlier
    ops of the same step stay applied: the caller should reset."""


class StepStart(NamedTuple):
    """A table's state before the step's first Append: a swap-out later in the
    same step gives back the slots it reserved (the sequence will not run)."""

    step_no: int
    num_tokens: int
    last_key: bytes
    tail: list[int]


@dataclass(slots=True, eq=False)
class SeqTable:
    """``tail`` holds the token ids of the partly filled last block and
    ``last_key`` the key of the last full one (both only with prefix caching)."""

    table: list[Block]
    num_tokens: int
    tail: list[int]
    last_key: bytes
    on_cpu: bool = False
    step_start: StepStart | None = None

    def start_of(self, step_no: int) -> StepStart | None:
        """The snapshot taken in step ``step_no``, if this step appended to it."""
        s = self.step_start
        return s if s is not None and s.step_no == step_no else None
