"""Preemption (PagedAttention paper, sec. 4.5): when a running sequence finds
no room, the latest arrivals give back their blocks, whole groups at a time,
by recompute or swap, and the failed appends are retried in another round of
the same step. ``Preemptor`` owns the preemption count; it moves groups
through ``Requests`` and owes frees and drops through ``StepCarry``."""
from __future__ import annotations

from pagedserve.common.blocks import cdiv
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages.frontend import ErrorKind
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.finish import Finisher
from pagedserve.scheduler.plan import StepPlan, append_op
from pagedserve.scheduler.requests import Requests
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


def victim_blocks(group: SequenceGroup, cfg: SchedulerConfig | None = None) -> int:
    """Blocks the group holds (an estimate: sharing is not counted; a hybrid
    KV cache's sliding groups hold about a window each)."""
    if cfg is None or not cfg.kv_group_windows:
        return sum(s.num_blocks for s in group.live_seqs)
    return sum(cfg.table_blocks(s.num_blocks) for s in group.live_seqs)


class Preemptor:
    def __init__(self, cfg: SchedulerConfig, requests: Requests, carry: StepCarry, finisher: Finisher) -> None:
        self._cfg = cfg
        self._requests = requests
        self._carry = carry
        self._finisher = finisher
        self.num_preemptions = 0

    def preempt_for(self, plan: StepPlan, failed: list[tuple[Sequence, int]], num_cpu_blocks: int) -> list[bm.Op]:
        """Preempt the latest arrivals until each failed append can be retried.
        Blocks a victim releases may be shared, so this is an estimate; a
        retry that still finds no room comes back for another round.
        ``num_cpu_blocks``: the CPU pool (none: recompute only)."""
        cfg, requests = self._cfg, self._requests
        retries: list[tuple[SequenceGroup, Sequence, int]] = []
        # Sequences the step that was in flight finished (async scheduling)
        # still hold blocks: those are freed first (not a new beam's parent,
        # whose Fork must come before its Free).
        ops, released = self._carry.take_frees(keep_fork_parents=True)
        for seq, k in failed:
            if seq.is_finished:  # a stop token in the step that was in flight
                continue
            group = requests.group_of(seq.seq_id)
            assert group is not None
            need = max(1, cfg.num_kv_groups * (cdiv(seq.num_computed_tokens + k, cfg.block_size) - seq.num_blocks))
            while group.request_id not in plan.preempted and released < need:
                victim = requests.running[-1]
                if victim is group and len(requests.running) == 1:
                    # Alone and still no room: waiting cannot help.
                    requests.stop_running(group)
                    plan.preempted.add(group.request_id)
                    plan.unschedule(group)
                    self._finisher.finish_group(group, FinishReason.ERROR, "sequence outgrew the KV cache",
                                                ErrorKind.KV_CACHE)
                    ops += self._carry.take_frees()[0]
                    break
                released += victim_blocks(victim, cfg)
                ops += self._preempt(plan, victim, num_cpu_blocks)
            if group.request_id not in plan.preempted:
                released -= need
                retries.append((group, seq, k))
        # A group preempted after one of its retries was queued (a later seq
        # of it still found no room) is not retried: its Append would come back
        # OK and schedule a sequence that was freed or swapped out.
        return ops + [append_op(seq, k) for group, seq, k in retries if group.request_id not in plan.preempted]

    def _preempt(self, plan: StepPlan, group: SequenceGroup, num_cpu_blocks: int) -> list[bm.Op]:
        self.num_preemptions += 1
        group.num_preemptions += 1
        plan.preempted.add(group.request_id)
        plan.unschedule(group)
        live = group.live_seqs
        if self._use_swap(group, num_cpu_blocks):
            for s in live:
                s.status = SeqStatus.SWAPPED
            self._requests.swap_out(group)
            return [bm.SwapOut([s.seq_id for s in live])]
        # An append earlier in this step may have given the victim a block: the
        # worker drops it (finished) before applying diffs, so build_execute
        # leaves out every diff of a sequence no longer known to the worker.
        self._requests.stop_running(group)
        return self.recompute(group)

    def recompute(self, group: SequenceGroup) -> list[bm.Op]:
        """Drop the group's K/V (the caller took it out of its queue); it goes
        back to waiting and is prefilled again (prompt + output so far)."""
        live = group.live_seqs
        # New beams whose Fork is not sent yet (async scheduling: the beam step
        # came in this step's rounds) have no table to free: the fork is dropped.
        unforked = self._carry.cancel_forks({s.seq_id for s in live})
        for s in live:
            s.status = SeqStatus.WAITING
            s.num_computed_tokens = 0
            s.num_blocks = 0
            s.num_pending, s.num_unknown_slots = 0, 0
            if s.known_to_worker:
                self._carry.owe_drop(s.seq_id)
                s.known_to_worker = False
        # Back to the queue, ahead of every later arrival.
        self._requests.requeue(group)
        return [bm.Free(s.seq_id) for s in live if s.seq_id not in unforked]

    def _use_swap(self, group: SequenceGroup, num_cpu_blocks: int) -> bool:
        live = group.live_seqs
        if num_cpu_blocks == 0 or not all(s.known_to_worker for s in live):
            return False
        if self._cfg.preemption_mode == "swap":
            return True
        if self._cfg.preemption_mode == "auto":
            # The paper (sec. 7.3): recomputation is never much slower than swapping
            # at block sizes >= 16, and needs no CPU memory; swapping pays when a
            # group's sequences share blocks (parallel sampling, beam search), which
            # recomputation would have to rebuild once per sequence.
            return len(live) > 1
        return False
