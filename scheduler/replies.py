"""Applying the blockmgr's ``StepReply`` to a step's plan: each result pairs
with the op it answers (``answers``); block-table diffs are relayed to the
worker's half of the plan; admissions settle all or nothing per group; an
Append that found no room drives preemption (``Preemptor``) and a retry in
another round. ``BlockReplies`` keeps no state of its own: the plan holds the
step's, ``Requests`` the queues."""
from __future__ import annotations

import time

from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import ErrorKind
from pagedserve.scheduler.finish import Finisher
from pagedserve.scheduler.plan import StepPlan
from pagedserve.scheduler.preemption import Preemptor
from pagedserve.scheduler.requests import Requests
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


def answers(ops: list[bm.Op]) -> list[tuple[bm.Op, int]]:
    """(op, seq id) for each entry of the StepReply that answers ``ops``."""
    return [(op, sid) for op in ops for sid in bm.answered_seq_ids(op)]


def must_settle(plan: StepPlan, reply: bm.StepReply) -> bool:
    """Applying ``reply`` may preempt (an Append or SwapOut found no room):
    with async scheduling, the step in flight must be applied first."""
    if all(r is None or r.status is bm.Status.OK for r in reply.results):
        return False
    return any(type(op) in (bm.Append, bm.SwapOut) and r is not None and r.status is not bm.Status.OK
               for (op, _), r in zip(answers(plan.request.ops), reply.results))


def apply_table(plan: StepPlan, seq: Sequence, res: bm.SeqResult) -> None:
    """Relay the blockmgr's diff to the worker; keep only the table's length
    (group 0's: every KV cache group's table has the same length)."""
    if res.group_diffs:  # a hybrid KV cache: one diff per group whose table changed
        seq.num_blocks = res.table_start + len(res.block_ids)
        plan.block_diffs += [wk.BlockDiff(seq.seq_id, start, list(ids), g) for g, start, ids in res.group_diffs]
        return
    if not res.block_ids and res.table_start == seq.num_blocks:
        return
    seq.num_blocks = res.table_start + len(res.block_ids)
    plan.block_diffs.append(wk.BlockDiff(seq.seq_id, res.table_start, list(res.block_ids)))


class BlockReplies:
    def __init__(self, requests: Requests, finisher: Finisher, preemptor: Preemptor) -> None:
        self._requests = requests
        self._finisher = finisher
        self._preemptor = preemptor

    def _group(self, seq_id: int) -> SequenceGroup:
        group = self._requests.group_of(seq_id)
        assert group is not None, f"seq {seq_id} belongs to no request"
        return group

    def apply(self, plan: StepPlan, pairs: list[tuple[bm.Op, int]], reply: bm.StepReply,
              num_cpu_blocks: int) -> list[bm.Op]:
        """``pairs``: ``answers(plan.request.ops)``, as long as ``reply.results``.
        Returns the ops of another round (releases, preemption), or none."""
        plan.copies += reply.copies
        plan.swap_in += reply.swap_in
        plan.swap_out += reply.swap_out
        failed: list[tuple[Sequence, int]] = []
        unchanged: list[tuple[Sequence, int]] = []  # appends that needed no block
        refused: set[str] = set()
        swap_refused: list[SequenceGroup] = []
        for (op, sid), res in zip(pairs, reply.results):
            if type(op) is bm.Free:
                continue
            seq = self._requests.seq(sid)
            if seq is None or seq.is_finished:
                # Async scheduling: the step that was in flight finished it
                # (must_settle); its Free is queued, and releases these slots too.
                continue
            if type(op) is bm.Append:
                n = len(op.token_ids)  # the first fill slots reserved for unknown tokens
                k = n - min(n, seq.num_unknown_slots) + op.num_lookahead
                if res is None or res.status is bm.Status.OK:
                    plan.unknown_slots[sid] = op.num_lookahead
                if res is None:
                    unchanged.append((seq, k))
                elif res.status is bm.Status.OK:
                    apply_table(plan, seq, res)
                    plan.scheduled[sid] = (seq, res.num_scheduled_tokens)
                else:
                    failed.append((seq, k))
            elif type(op) is bm.Fork:
                assert res is not None
                apply_table(plan, seq, res)
                plan.new_seqs.append(seq)
            elif type(op) is bm.SwapOut:
                assert res is not None
                group = self._group(sid)
                if res.status is bm.Status.OK:
                    seq.num_blocks = 0
                elif group not in swap_refused:
                    swap_refused.append(group)
            else:  # Allocate, SwapIn: all or nothing per group
                assert res is not None
                group = self._group(sid)
                if res.status is not bm.Status.OK or group.request_id in refused:
                    refused.add(group.request_id)
                    continue
                apply_table(plan, seq, res)
                if type(op) is bm.SwapIn:
                    seq.status = SeqStatus.RUNNING
                else:
                    seq.num_computed_tokens = res.num_cached_tokens
                    plan.scheduled[sid] = (seq, res.num_scheduled_tokens)
                    plan.new_seqs.append(seq)
        # Batch order: sequences whose table changed, in reply order, then the others.
        for seq, k in unchanged:
            plan.scheduled[seq.seq_id] = (seq, k)
        # A refused group's sequences that did get blocks free them in this
        # same step (an extra round): their blocks hold no K/V, and freed before
        # the next step's commit they never become prefix-cache hits.
        more: list[bm.Op] = [bm.Free(sid) for sid in self._settle_admissions(plan, refused, reply.stats)]
        for group in swap_refused:
            # No CPU room: fall back to recomputation for this group.
            self._requests.unswap(group)
            more += self._preemptor.recompute(group)
        if failed:
            more += self._preemptor.preempt_for(plan, failed, num_cpu_blocks)
        return more

    def _settle_admissions(self, plan: StepPlan, refused: set[str], stats: bm.BlockStats | None) -> list[int]:
        """Admits the groups that got everything; returns the seq ids to free."""
        requests = self._requests
        frees: list[int] = []
        for group in plan.admitted:
            if group.request_id in refused:
                # All or nothing per group: release what part of it got.
                for s in group.live_seqs:
                    plan.scheduled.pop(s.seq_id, None)
                    if s in plan.new_seqs:
                        plan.new_seqs.remove(s)
                        frees.append(s.seq_id)
                        s.num_blocks, s.num_computed_tokens = 0, 0
                continue
            if not requests.admit(group) and group.queue_time_s is None:  # first admission, from waiting
                group.queue_time_s = max(0.0, time.time() - group.arrival_time)
                group.num_cached_tokens = group.seqs[0].num_computed_tokens  # Allocate set it to the hit
            for s in group.live_seqs:
                s.status = SeqStatus.RUNNING
        requests.sort_running()
        if refused and not requests.running and not requests.swapped and requests.waiting:
            head = requests.waiting[0]
            if head.request_id in refused and (stats is None or stats.num_free_gpu_blocks == stats.num_gpu_blocks):
                # Nothing else holds memory, so waiting cannot help: fail instead of hanging.
                requests.pop_waiting_head()
                self._finisher.finish_group(head, FinishReason.ERROR, "request does not fit in the KV cache",
                                            ErrorKind.KV_CACHE)
        plan.admitted = []
        return frees
