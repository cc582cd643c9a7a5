"""What one engine step leaves for the next, in one object the ``Scheduler``
owns (``Scheduler.carry``), next to the ``StepPlan`` each step passes along.

* ``forks``: beam search's new beams (sampled in a step, forked from their
  parents in the next request, before the parents' frees);
* ``frees``: finished or aborted sequences whose blocks the blockmgr frees in
  the next request -> the GPU blocks (at most) each gives back;
* ``drops``: sequences whose worker state the next ``ExecuteStep`` drops;
* ``in_flight``: the plan whose ``ExecuteStep`` went to the worker and whose
  ``StepResult`` is not applied yet (with async scheduling the next plan is
  made meanwhile).

A step moves its plan through ``plan.StepPhase`` in one order (``Scheduler``
checks it): BLOCKS (rounds with the blockmgr) -> SETTLED -> SENT (the worker
runs it) -> APPLIED. A result applies only to the plan in flight, and only
with that plan's step id (``land``).

``StepCarry`` is the one writer of its fields: the scheduler's parts owe it
frees, drops and forks through its methods, and read the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.common.messages import blockmgr as bm
from pagedserve.scheduler.plan import StepOrderError, StepPhase, StepPlan


@dataclass
class StepCarry:
    forks: list[bm.Fork] = field(default_factory=list)
    frees: dict[int, int] = field(default_factory=dict)
    drops: list[int] = field(default_factory=list)
    in_flight: StepPlan | None = None

    def __bool__(self) -> bool:
        return bool(self.forks or self.frees or self.drops or self.in_flight is not None)

    def owe_free(self, seq_id: int, num_blocks: int) -> None:
        """The next request frees the sequence, which gives back about ``num_blocks``."""
        self.frees[seq_id] = num_blocks

    def owe_drop(self, seq_id: int) -> None:
        """The next ExecuteStep drops the sequence's worker state."""
        self.drops.append(seq_id)

    def owe_fork(self, fork: bm.Fork) -> None:
        """A new beam: the next request forks it from its parent (before the parent's Free)."""
        self.forks.append(fork)

    def send(self, plan: StepPlan) -> None:
        """``plan``'s ExecuteStep went to the worker: it is the plan in flight."""
        if self.in_flight is not None:
            raise StepOrderError("build_execute: the step in flight is not applied yet")
        self.in_flight = plan

    def land(self, plan: StepPlan, step_id: int | None, call: str) -> None:
        """The plan in flight, and only it, takes its result (``step_id``: the
        result's, None for a failed step); it is applied from now on."""
        plan.expect(StepPhase.SENT, call)
        if self.in_flight is not plan:
            raise StepOrderError(f"{call}: step {plan.step_id} is not the step in flight")
        if step_id is not None and step_id != plan.step_id:
            raise StepOrderError(f"{call}: the result of step {step_id} for step {plan.step_id}")
        self.in_flight, plan.phase = None, StepPhase.APPLIED

    def take_memory_ops(self) -> tuple[list[bm.Op], int]:
        """The next request's leading ops (forks first: a new beam's parent may
        be freed by the same request) and the blocks the frees give back."""
        ops: list[bm.Op] = [*self.forks, *(bm.Free(s) for s in self.frees)]
        freed = sum(self.frees.values())
        self.forks, self.frees = [], {}
        return ops, freed

    def take_frees(self, keep_fork_parents: bool = False) -> tuple[list[bm.Op], int]:
        """Frees to send now (a preemption round), with the blocks they give
        back; a pending fork's parent keeps its blocks if asked (its Fork must
        come before its Free)."""
        parents = {f.parent_seq_id for f in self.forks} if keep_fork_parents else set()
        sids = [s for s in self.frees if s not in parents]
        return [bm.Free(s) for s in sids], sum(self.frees.pop(s) for s in sids)

    def cancel_forks(self, seq_ids: set[int]) -> set[int]:
        """Drops the pending forks of these children; returns the ones dropped."""
        unforked = {f.child_seq_id for f in self.forks} & seq_ids
        if unforked:
            self.forks = [f for f in self.forks if f.child_seq_id not in unforked]
        return unforked

    def take_drops(self) -> list[int]:
        drops, self.drops = self.drops, []
        return drops

    def clear(self) -> None:
        """The components were reset: nothing is owed, and no result will come."""
        self.forks, self.frees, self.drops, self.in_flight = [], {}, [], None
