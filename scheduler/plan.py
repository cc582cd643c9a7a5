"""One step's plan, passed explicitly through the step (like vLLM's
``SchedulerOutput``): ``Scheduler.schedule`` creates it, every blockmgr
round adds to it, ``Scheduler.build_execute`` turns it into the worker's
``ExecuteStep`` and ``Scheduler.on_step_result`` reads it back. Nothing of
it lives on the scheduler between two steps.

Pairing: ``StepReply.results`` answers ``request.ops`` one entry per
sequence an op names, in order (a ``SwapOut``/``SwapIn`` names its whole
group, a ``Fork`` its child); ``None`` means applied with the block table
unchanged (a ``Free``, an ``Append`` that needed no new block).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import StructuredSpec
from pagedserve.scheduler.sequence import Sequence, SequenceGroup


class StepPhase(enum.Enum):
    BLOCKS = "blocks"  # its request is with the blockmgr
    SETTLED = "settled"  # every blockmgr round answered
    SENT = "sent"  # its ExecuteStep is with the worker
    APPLIED = "applied"  # its StepResult (or failure) applied; or nothing to run


class StepOrderError(RuntimeError):
    """A step's calls came out of order, or a result for another step."""


@dataclass
class StepPlan:
    request: bm.StepRequest  # the round in flight; its reply pairs with its ops
    admitted: list[SequenceGroup] = field(default_factory=list)  # tried this round, settled after it
    scheduled: dict[int, tuple[Sequence, int]] = field(default_factory=dict)  # insertion = batch order
    new_seqs: list[Sequence] = field(default_factory=list)  # the worker learns of them this step
    block_diffs: list[wk.BlockDiff] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # request ids, this step
    unknown_slots: dict[int, int] = field(default_factory=dict)  # seq id -> its Append's num_lookahead
    compile: list[StructuredSpec] = field(default_factory=list)  # grammars the worker is asked to compile
    phase: StepPhase = StepPhase.BLOCKS
    step_id: int | None = None  # the ExecuteStep's, once sent

    def expect(self, phase: StepPhase, call: str) -> None:
        if self.phase is not phase:
            raise StepOrderError(f"{call}: the step is {self.phase.value}, expected {phase.value}")

    def unschedule(self, group: SequenceGroup) -> None:
        for s in group.seqs:
            self.scheduled.pop(s.seq_id, None)
            if s in self.new_seqs:
                self.new_seqs.remove(s)


def append_op(seq: Sequence, k: int) -> bm.Append:
    """Slots for the sequence's next ``k`` tokens. The ids the blockmgr lacks
    go with it: those of its unknown slots first; a token still being sampled
    (async scheduling) gets a lookahead slot."""
    n = seq.num_computed_tokens
    known = min(len(seq.token_ids), n + k)
    return bm.Append(seq.seq_id, seq.token_ids[n - seq.num_unknown_slots:known], n + k - known)
