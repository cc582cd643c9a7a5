"""The pure scheduler: iteration-level (continuous) batching, FCFS, a token
budget per step, chunked prefill, and preemption by recompute or swap.

It never touches a socket. One engine step is a small conversation in which
every reply pairs with its request (``plan.py``) and the step's plan is
passed along, never kept on the scheduler:

    plan = sched.schedule()                # None when idle
    req = plan.request
    while req is not None:                 # another round only to preempt or release
        req = sched.on_block_reply(plan, blockmgr.step(req))
    step = sched.build_execute(plan)       # None when nothing is left to run
    deltas = sched.on_step_result(plan, worker.execute(step))

Normally that is one blockmgr round trip per step; when a running sequence
finds no room, the reply drives a second round that preempts the latest
arrivals (last come, first preempted, whole groups) and retries
(``preemption.py``). Applying the worker's result is ``results.py``; adding
and aborting requests and the per-sequence bookkeeping is ``intake.py``.
"""
from __future__ import annotations

import itertools
import time
from collections import deque

from pagedserve.common.blocks import cdiv
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import ErrorKind, TokenDelta
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import PoolSize, SchedulerConfig
from pagedserve.scheduler.grammar_gate import GrammarGate
from pagedserve.scheduler.intake import Intake
from pagedserve.scheduler.plan import StepOrderError, StepPhase, StepPlan
from pagedserve.scheduler.preemption import Preemption
from pagedserve.scheduler.results import Results
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


def _answers(ops: list[bm.Op]) -> list[tuple[bm.Op, int]]:
    """(op, seq id) for each entry of the StepReply that answers ``ops``."""
    return [(op, sid) for op in ops for sid in bm.answered_seq_ids(op)]


class BlockReplyMismatch(ValueError):
    """A StepReply whose results do not pair with the request's ops."""


class Scheduler(Intake, Preemption, Results):
    def __init__(self, cfg: SchedulerConfig, pool: PoolSize) -> None:
        self.cfg = cfg
        self.pool = pool
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # arrival order
        self.swapped: list[SequenceGroup] = []
        self.groups: dict[str, SequenceGroup] = {}
        self._seq_group: dict[int, SequenceGroup] = {}
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()
        self.carry = StepCarry()  # what a step leaves for the next (carry.py)
        self._deltas: list[TokenDelta] = []  # produced outside a worker step (errors, aborts)
        self.block_stats: bm.BlockStats | None = None  # the blockmgr's, from its last reply
        self.grammars = GrammarGate()  # requests whose grammar the worker still compiles
        self.num_preemptions = 0
        self.num_steps = 0

    # ------------------------------------------------------------ planning
    def _fork_children(self, group: SequenceGroup) -> list[bm.Op]:
        """The first sequence has prefilled all but the prompt's last token:
        the other n-1 fork from it, and each computes that token (copy-on-write
        gives each its own copy of a shared, partly filled last block)."""
        parent = group.seqs[0]
        ops: list[bm.Op] = []
        for i in range(1, group.params.n):
            child = Sequence(next(self._seq_ids), i, list(parent.token_ids), parent.num_prompt_tokens,
                             parent.num_computed_tokens, status=SeqStatus.RUNNING,
                             num_unknown_slots=parent.num_unknown_slots)
            group.seqs.append(child)
            self._track(group, child)
            ops.append(bm.Fork(parent.seq_id, child.seq_id))
        group.needs_fork = False
        return ops

    def schedule(self) -> StepPlan | None:
        """Plan a step: every memory op of it, in order, in ``plan.request``; None if idle."""
        ops, freed = self.carry.take_memory_ops()
        for group in self.running:
            if group.needs_fork and group.tokens_to_compute(group.seqs[0]) == 0:
                ops += self._fork_children(group)
        plan = StepPlan(bm.StepRequest(ops), compile=self.grammars.take_asks())
        budget = self.cfg.max_num_batched_tokens
        bs = self.cfg.block_size
        # Blocks likely open to admissions: the blockmgr's last count (free blocks
        # beyond its watermark), plus what this step's frees return, minus what the
        # appends take. Only an estimate (prefix hits and sharing move it), used to
        # avoid sending admissions that are sure to be refused.
        room = None
        if self.block_stats is not None:
            room = self.block_stats.num_admissible_gpu_blocks + freed
        max_len = self.cfg.max_model_len
        G = self.cfg.num_kv_groups  # every KV cache group takes a block at the same boundaries
        hybrid = bool(self.cfg.kv_group_windows)  # prefill chunks may be cut (_chunk_cap)
        for group in self.running:
            live = group.live_seqs
            if group.beam is not None and any(s.num_pending for s in live):
                continue  # its next beams are chosen from the step in flight
            for seq in live:
                k = min(group.tokens_to_compute(seq), budget)
                if hybrid and k > 1:
                    k = min(k, self._chunk_cap(group, seq))
                if k <= 0 or (seq.num_pending and group.long_enough(seq, max_len)):
                    continue
                budget -= k
                ops.append(self._append_op(seq, k))
                if room is not None:
                    room -= G * max(0, cdiv(seq.num_computed_tokens + k, bs) - seq.num_blocks)
        num_seqs = sum(g.batch_width for g in self.running)
        # Swapped groups resume before new admissions.
        for group in self.swapped:
            live = group.live_seqs
            if num_seqs + len(live) > self.cfg.max_num_seqs:
                break
            ops.append(bm.SwapIn([s.seq_id for s in live]))
            num_seqs += len(live)
            plan.admitted.append(group)
        if not self.swapped:
            for group in self.waiting:
                width = group.batch_width
                if budget <= 0 or num_seqs + width > self.cfg.max_num_seqs:
                    break
                # A prompt that does not fit what is left of this step's budget is split (chunked
                # prefill) unless that is off; a step with nothing else in it still takes it.
                split = sum(len(s.token_ids) - group.needs_fork for s in group.live_seqs) > budget
                if split and budget < self.cfg.max_num_batched_tokens and not self.cfg.enable_chunked_prefill:
                    break
                allocs = []
                need = 0
                for seq in group.live_seqs:
                    tokens = seq.token_ids[:-1] if group.needs_fork else seq.token_ids
                    k = min(len(tokens), budget)
                    if hybrid and k > 1:
                        k = min(k, self._chunk_cap(group, seq))
                    budget -= k
                    need += G * cdiv(k, bs)
                    allocs.append(bm.Allocate(seq.seq_id, list(tokens), k, group.cache_salt,
                                              skip_prefix_lookup=group.params.prompt_logprobs is not None))
                # The queue's head is always tried (its prefix may be cached); later
                # groups only while the estimate says they may fit.
                if room is not None and plan.admitted and need > room:
                    break
                if room is not None:
                    room -= need
                ops += allocs
                num_seqs += width
                plan.admitted.append(group)
        if not ops and not self.carry.drops and not plan.compile and not self.grammars.waiting:
            return None
        return plan

    @staticmethod
    def must_settle(plan: StepPlan, reply: bm.StepReply) -> bool:
        """Applying ``reply`` may preempt (an Append or SwapOut found no room):
        with async scheduling, the step in flight must be applied first."""
        if all(r is None or r.status is bm.Status.OK for r in reply.results):
            return False
        return any(type(op) in (bm.Append, bm.SwapOut) and r is not None and r.status is not bm.Status.OK
                   for (op, _), r in zip(_answers(plan.request.ops), reply.results))

    def on_block_reply(self, plan: StepPlan, reply: bm.StepReply) -> bm.StepRequest | None:
        """Apply the blockmgr's answer to ``plan.request``; returns the next
        round's request (preemption, releases), or None when the step is settled."""
        plan.expect(StepPhase.BLOCKS, "on_block_reply")
        if self.carry.in_flight is not None and self.must_settle(plan, reply):
            raise StepOrderError("on_block_reply: this reply preempts; apply the step in flight first")
        pairs = _answers(plan.request.ops)
        if len(pairs) != len(reply.results):
            raise BlockReplyMismatch(f"{len(reply.results)} results for {len(pairs)} answers expected")
        self.block_stats = reply.stats
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
            seq = self._seqs.get(sid)
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
                    self._apply_table(plan, seq, res)
                    plan.scheduled[sid] = (seq, res.num_scheduled_tokens)
                else:
                    failed.append((seq, k))
            elif type(op) is bm.Fork:
                assert res is not None
                self._apply_table(plan, seq, res)
                plan.new_seqs.append(seq)
            elif type(op) is bm.SwapOut:
                assert res is not None
                group = self._seq_group[sid]
                if res.status is bm.Status.OK:
                    seq.num_blocks = 0
                elif group not in swap_refused:
                    swap_refused.append(group)
            else:  # Allocate, SwapIn: all or nothing per group
                assert res is not None
                group = self._seq_group[sid]
                if res.status is not bm.Status.OK or group.request_id in refused:
                    refused.add(group.request_id)
                    continue
                self._apply_table(plan, seq, res)
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
        more: list[bm.Op] = [bm.Free(sid) for sid in self._settle_admissions(plan, refused)]
        for group in swap_refused:
            # No CPU room: fall back to recomputation for this group.
            self.swapped.remove(group)
            more += self._recompute(group)
        if failed:
            more += self._preempt_for(plan, failed)
        plan.request = bm.StepRequest(more, continues_step=True)
        if not more:
            plan.phase = StepPhase.SETTLED
        return plan.request if more else None

    def _chunk_cap(self, group: SequenceGroup, seq: Sequence) -> int:
        """Tokens one prefill chunk may take. A hybrid KV cache's sliding groups
        hold a whole chunk plus their window, so a chunk is cut until the
        sequence's whole life fits most of the pool (a context that fits the
        windows is never refused for its chunk). Dense models: no cap."""
        cfg = self.cfg
        if not cfg.kv_group_windows or not cfg.enable_chunked_prefill:
            return cfg.max_num_batched_tokens
        total = min(seq.num_prompt_tokens + group.params.max_tokens, cfg.max_model_len)
        room = int(self.pool.num_gpu_blocks * 0.9)
        c = cfg.max_num_batched_tokens
        while c > cfg.block_size and cfg.blocks_held(total, c) > room:
            c //= 2
        return max(c, cfg.block_size)

    @staticmethod
    def _append_op(seq: Sequence, k: int) -> bm.Append:
        """Slots for the next ``k`` tokens. The ids the blockmgr lacks go with
        it: those of its unknown slots first; a token still being sampled
        (async scheduling) gets a lookahead slot."""
        n = seq.num_computed_tokens
        known = min(len(seq.token_ids), n + k)
        return bm.Append(seq.seq_id, seq.token_ids[n - seq.num_unknown_slots:known], n + k - known)

    @staticmethod
    def _apply_table(plan: StepPlan, seq: Sequence, res: bm.SeqResult) -> None:
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

    def _settle_admissions(self, plan: StepPlan, refused: set[str]) -> list[int]:
        """Admits the groups that got everything; returns the seq ids to free."""
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
            if group in self.swapped:
                self.swapped.remove(group)
            else:
                self.waiting.remove(group)
                if group.queue_time_s is None:
                    group.queue_time_s = max(0.0, time.time() - group.arrival_time)
                    group.num_cached_tokens = group.seqs[0].num_computed_tokens  # Allocate set it to the hit
            for s in group.live_seqs:
                s.status = SeqStatus.RUNNING
            self.running.append(group)
        self.running.sort(key=lambda g: g.arrival_order)
        if refused and not self.running and not self.swapped and self.waiting:
            head = self.waiting[0]
            if head.request_id in refused and (self.block_stats is None or
                                               self.block_stats.num_free_gpu_blocks == self.block_stats.num_gpu_blocks):
                # Nothing else holds memory, so waiting cannot help: fail instead of hanging.
                self.waiting.popleft()
                self._finish_group(head, FinishReason.ERROR, "request does not fit in the KV cache",
                                   ErrorKind.KV_CACHE)
        plan.admitted = []
        return frees

    def build_execute(self, plan: StepPlan) -> wk.ExecuteStep | None:
        """The worker's half of the plan; None when nothing is left to run.
        Sent, it is the plan in flight until its result is applied."""
        plan.expect(StepPhase.SETTLED, "build_execute")
        if self.carry.in_flight is not None:
            raise StepOrderError("build_execute: the step in flight is not applied yet")
        new_seqs = []
        for seq in plan.new_seqs:
            group = self._seq_group[seq.seq_id]
            # Its blocks follow as diffs (applied after new_seqs): the worker's
            # table is built from the blockmgr's diffs only.
            new_seqs.append(wk.NewSeq(seq.seq_id, list(seq.token_ids), seq.num_computed_tokens,
                                      self._worker_params(group, seq), seq.num_prompt_tokens))
            seq.known_to_worker = True
        # A sequence freed or recomputed later in the step is not (or no longer) the worker's.
        diffs = [d for d in plan.block_diffs if (s := self._seqs.get(d.seq_id)) is not None and s.known_to_worker]
        # One that finished meanwhile (async scheduling: a stop token in the step
        # before) does not run; its slots are freed with it.
        scheduled = []
        unknown = plan.unknown_slots
        for s, k in plan.scheduled.values():
            if k <= 0 or s.is_finished:
                continue
            scheduled.append(wk.ScheduledSeq(s.seq_id, k))
            # Counted as computed when sent: the next step may be planned before this one returns.
            s.num_computed_tokens += k
            s.num_unknown_slots = unknown.get(s.seq_id, 0)
            s.num_pending = 1 if s.num_computed_tokens == len(s.token_ids) else 0
        drops = self.carry.take_drops()
        # A step with nothing to run still goes while grammars compile: it asks and brings answers.
        if not (scheduled or new_seqs or drops or plan.copies or plan.swap_in or plan.swap_out or plan.compile
                or self.grammars.waiting):
            plan.phase = StepPhase.APPLIED
            return None
        self.num_steps += 1
        plan.step_id, plan.phase = next(self._step_ids), StepPhase.SENT
        self.carry.in_flight = plan
        return wk.ExecuteStep(plan.step_id, new_seqs, diffs, scheduled, drops,
                              plan.copies, plan.swap_in, plan.swap_out, plan.compile)
