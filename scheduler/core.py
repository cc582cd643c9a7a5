"""The pure scheduler: iteration-level (continuous) batching, FCFS, a token
budget per step, chunked prefill, and preemption by recompute or swap.

It never touches a socket. One engine step is a small conversation:

    req = sched.schedule()                 # StepRequest for the blockmgr, or None
    while isinstance(req, StepRequest):
        req = sched.on_block_reply(blockmgr.step(req))   # another round only to preempt
    if req is not None:                    # an ExecuteStep for the worker
        deltas = sched.on_step_result(worker.execute(req))

Normally that is one blockmgr round trip per step; when a running sequence
finds no room, the reply drives a second round that preempts the latest
arrivals (last come, first preempted, whole groups) and retries.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AddRequest, TokenDelta
from pagedserve.common.messages.types import SamplingParams
from pagedserve.scheduler.beam import BeamSearch, Hypothesis
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    preemption_mode: str = "recompute"  # recompute | swap | auto
    num_cpu_blocks: int = 0
    kv_watermark: float = 0.01  # must match the blockmgr's


@dataclass
class _StepPlan:
    """Scratch state of the step being planned."""

    await_append: dict[int, tuple[Sequence, int]] = field(default_factory=dict)
    await_swap_out: dict[int, SequenceGroup] = field(default_factory=dict)
    await_fork: dict[int, Sequence] = field(default_factory=dict)
    await_alloc: dict[int, Sequence] = field(default_factory=dict)
    admitted: list[SequenceGroup] = field(default_factory=list)
    scheduled: dict[int, tuple[Sequence, int]] = field(default_factory=dict)  # insertion = batch order
    new_seqs: list[Sequence] = field(default_factory=list)
    block_diffs: list[wk.BlockDiff] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []  # arrival order
        self.swapped: list[SequenceGroup] = []
        self.groups: dict[str, SequenceGroup] = {}
        self._seq_group: dict[int, SequenceGroup] = {}
        self._seqs: dict[int, Sequence] = {}
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()
        self._pending_forks: list[bm.Fork] = []  # beam search: new beams, before their parents' frees
        self._pending_frees: list[int] = []  # seq ids to free in the blockmgr next round
        self._pending_free_blocks = 0  # at most this many blocks come back with them
        self._pending_drops: list[int] = []  # seq ids whose worker state to drop next step
        self._deltas: list[TokenDelta] = []  # produced outside a worker step (errors, aborts)
        self._plan: _StepPlan | None = None
        self.block_stats: bm.BlockStats | None = None
        self.num_preemptions = 0
        self.num_steps = 0

    # ------------------------------------------------------------ requests
    def add_request(self, req: AddRequest) -> None:
        # A resumed sample of a parallel-sampling request is sent as "ID/INDEX" (frontend/resume.py;
        # "/" is never in a frontend request id): the original group reached this scheduler too.
        if req.resume and "/" in req.request_id and req.request_id.rpartition("/")[0] in self.groups:
            return
        if req.request_id in self.groups:
            if req.resume:  # the original reached this scheduler too: it runs already
                return
            self._deltas.append(TokenDelta(req.request_id, 0, [], FinishReason.ERROR.value,
                                           len(req.prompt_token_ids), f"duplicate request_id {req.request_id!r}"))
            return
        p = req.params
        prompt = list(req.prompt_token_ids)
        # n > 1: one sequence prefills the prompt, the others fork from it later
        # (a one-token prompt has nothing to share). Beam search starts from one beam.
        fork_later = p.beam_width <= 1 and p.n > 1 and len(prompt) > 1
        width = 1 if fork_later or p.beam_width > 1 else max(1, p.n)
        n_prompt = len(prompt) - req.num_output_tokens
        seqs = [Sequence(next(self._seq_ids), i, list(prompt), n_prompt) for i in range(width)]
        group = SequenceGroup(req.request_id, seqs, p, req.arrival_time, next(self._arrivals),
                              req.cache_salt, forked=not fork_later)
        if p.beam_width > 1:
            group.beam = BeamSearch(p.beam_width, len(prompt), min(len(prompt) + p.max_tokens, self.cfg.max_model_len),
                                    self.cfg.eos_token_ids, p.length_penalty, p.early_stopping)
        blocks_needed = -(-(len(req.prompt_token_ids) + 1) // self.cfg.block_size)
        if blocks_needed > self.cfg.num_gpu_blocks:
            self._finish_group(group, FinishReason.ERROR,
                               f"prompt of {len(req.prompt_token_ids)} tokens needs {blocks_needed} KV blocks; "
                               f"the pool has {self.cfg.num_gpu_blocks}")
            return
        self.groups[group.request_id] = group
        for s in seqs:
            self._track(group, s)
        self.waiting.append(group)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            if group in self.waiting:
                self.waiting.remove(group)
            elif group in self.running:
                self.running.remove(group)
            elif group in self.swapped:
                self.swapped.remove(group)
            self._finish_group(group, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._pending_frees or self._pending_drops
                    or self._pending_forks)

    def take_deltas(self) -> list[TokenDelta]:
        out, self._deltas = self._deltas, []
        return out

    # ------------------------------------------------------------ planning
    def _todo(self, group: SequenceGroup, seq: Sequence) -> int:
        """Tokens the sequence still has to compute before it can sample."""
        end = len(seq.token_ids) - (1 if group.needs_fork else 0)
        return end - seq.num_computed_tokens

    def _width(self, group: SequenceGroup) -> int:
        if group.needs_fork:
            return group.params.n
        return max(len(group.live_seqs), group.params.beam_width if group.beam else 1)

    def _fork_children(self, plan: _StepPlan, group: SequenceGroup) -> list[bm.Op]:
        """The first sequence has prefilled all but the prompt's last token:
        the other n-1 fork from it, and each computes that token (copy-on-write
        gives each its own copy of a shared, partly filled last block)."""
        parent = group.seqs[0]
        ops: list[bm.Op] = []
        for i in range(1, group.params.n):
            child = Sequence(next(self._seq_ids), i, list(parent.token_ids), parent.num_prompt_tokens,
                             parent.num_computed_tokens, status=SeqStatus.RUNNING)
            group.seqs.append(child)
            self._track(group, child)
            ops.append(bm.Fork(parent.seq_id, child.seq_id))
            plan.await_fork[child.seq_id] = child
        group.forked = True
        return ops

    def schedule(self) -> bm.StepRequest | None:
        """Plan a step; returns the blockmgr request, or None if idle."""
        assert self._plan is None, "previous step not finished"
        plan = self._plan = _StepPlan()
        # Forks first: a new beam's parent may be freed by this same request.
        ops: list[bm.Op] = list(self._pending_forks)
        for f in self._pending_forks:
            plan.await_fork[f.child_seq_id] = self._seq_by_id(f.child_seq_id)
        self._pending_forks = []
        ops += [bm.Free(s) for s in self._pending_frees]
        self._pending_frees = []
        for group in self.running:
            if group.needs_fork and self._todo(group, group.seqs[0]) == 0:
                ops += self._fork_children(plan, group)
        budget = self.cfg.max_num_batched_tokens
        bs = self.cfg.block_size
        # Blocks likely free for admissions: the last reply's count, plus what
        # this step's frees return, minus what the appends take. Only an
        # estimate (prefix hits and sharing move it), used to avoid sending
        # admissions that are sure to be refused.
        room = None
        if self.block_stats is not None:
            room = (self.block_stats.num_free_gpu_blocks + self._pending_free_blocks
                    - int(self.cfg.kv_watermark * self.block_stats.num_gpu_blocks))
        self._pending_free_blocks = 0
        for group in self.running:
            for seq in group.live_seqs:
                k = min(self._todo(group, seq), budget)
                if k <= 0:
                    continue
                budget -= k
                ops.append(self._append_op(seq, k))
                plan.await_append[seq.seq_id] = (seq, k)
                if room is not None:
                    room -= max(0, -(-(seq.num_computed_tokens + k) // bs) - seq.num_blocks)
        num_seqs = sum(self._width(g) for g in self.running)
        # Swapped groups resume before new admissions.
        for group in self.swapped:
            live = group.live_seqs
            if num_seqs + len(live) > self.cfg.max_num_seqs:
                break
            ops.append(bm.SwapIn([s.seq_id for s in live]))
            num_seqs += len(live)
            for s in live:
                plan.await_alloc[s.seq_id] = s
            plan.admitted.append(group)
        if not self.swapped:
            for group in self.waiting:
                width = self._width(group)
                if budget <= 0 or num_seqs + width > self.cfg.max_num_seqs:
                    break
                allocs = []
                need = 0
                for seq in group.live_seqs:
                    tokens = seq.token_ids[:-1] if group.needs_fork else seq.token_ids
                    k = min(len(tokens), budget)
                    budget -= k
                    need += -(-k // bs)
                    allocs.append(bm.Allocate(seq.seq_id, list(tokens), k, group.cache_salt))
                # The queue's head is always tried (its prefix may be cached); later
                # groups only while the estimate says they may fit.
                if room is not None and plan.admitted and need > room:
                    break
                if room is not None:
                    room -= need
                for op, seq in zip(allocs, group.live_seqs):
                    ops.append(op)
                    plan.await_alloc[seq.seq_id] = seq
                num_seqs += width
                plan.admitted.append(group)
        if not ops and not self._pending_drops:
            self._plan = None
            return None
        return bm.StepRequest(ops)

    def _seq_by_id(self, seq_id: int) -> Sequence:
        return self._seqs[seq_id]

    def _track(self, group: SequenceGroup, seq: Sequence) -> None:
        self._seq_group[seq.seq_id] = group
        self._seqs[seq.seq_id] = seq

    def _untrack(self, seq_id: int) -> None:
        self._seq_group.pop(seq_id, None)
        self._seqs.pop(seq_id, None)

    def on_block_reply(self, reply: bm.StepReply) -> bm.StepRequest | wk.ExecuteStep | None:
        plan = self._plan
        assert plan is not None
        self.block_stats = reply.stats
        plan.copies += reply.copies
        plan.swap_in += reply.swap_in
        plan.swap_out += reply.swap_out
        failed: list[tuple[Sequence, int]] = []
        refused: set[str] = set()
        swap_refused: list[SequenceGroup] = []
        for res in reply.results:
            if (child := plan.await_fork.pop(res.seq_id, None)) is not None:
                # A fork result comes before the child's own append result.
                self._apply_table(plan, child, res)
                plan.new_seqs.append(child)
            elif (entry := plan.await_append.pop(res.seq_id, None)) is not None:
                seq = entry[0]
                if res.status is bm.Status.OK:
                    self._apply_table(plan, seq, res)
                    plan.scheduled[seq.seq_id] = (seq, res.num_scheduled_tokens)
                else:
                    failed.append(entry)
            elif (group := plan.await_swap_out.pop(res.seq_id, None)) is not None:
                if res.status is bm.Status.OK:
                    for s in group.seqs:
                        if s.seq_id == res.seq_id:
                            s.block_table = []
                elif group not in swap_refused:
                    swap_refused.append(group)
            elif (seq := plan.await_alloc.pop(res.seq_id, None)) is not None:
                group = self._seq_group[seq.seq_id]
                if res.status is bm.Status.OK and group.request_id not in refused:
                    self._apply_table(plan, seq, res)
                    if seq.status is SeqStatus.SWAPPED:
                        seq.status = SeqStatus.RUNNING
                    else:
                        seq.num_computed_tokens = res.num_cached_tokens
                        plan.scheduled[seq.seq_id] = (seq, res.num_scheduled_tokens)
                        plan.new_seqs.append(seq)
                else:
                    refused.add(group.request_id)
        # An append that needed no new block gets no result: it succeeded.
        for seq, k in plan.await_append.values():
            plan.scheduled[seq.seq_id] = (seq, k)
        plan.await_append.clear()
        # A refused group's sequences that did get blocks free them in this
        # same step (an extra round): their blocks hold no K/V, and freed before
        # the next step's commit they never become prefix-cache hits.
        ops: list[bm.Op] = [bm.Free(sid) for sid in self._settle_admissions(plan, refused)]
        for group in swap_refused:
            # No CPU room: fall back to recomputation for this group.
            self.swapped.remove(group)
            ops += self._recompute(group)
        if failed:
            ops += self._preempt_for(plan, failed)
        if ops:
            return bm.StepRequest(ops, continues_step=True)
        return self._build_execute(plan)

    def _append_op(self, seq: Sequence, k: int) -> bm.Append:
        n = seq.num_computed_tokens
        return bm.Append(seq.seq_id, seq.token_ids[n:n + k])

    def _apply_table(self, plan: _StepPlan, seq: Sequence, res: bm.SeqResult) -> None:
        if not res.block_ids and res.table_start == seq.num_blocks:
            return
        del seq.block_table[res.table_start:]
        seq.block_table += res.block_ids
        if seq.known_to_worker:
            plan.block_diffs.append(wk.BlockDiff(seq.seq_id, res.table_start, list(res.block_ids)))

    def _settle_admissions(self, plan: _StepPlan, refused: set[str]) -> list[int]:
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
                        s.block_table, s.num_computed_tokens = [], 0
                continue
            if group in self.swapped:
                self.swapped.remove(group)
            else:
                self.waiting.remove(group)
                if group.queue_time_s is None:
                    group.queue_time_s = max(0.0, time.time() - group.arrival_time)
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
                self._finish_group(head, FinishReason.ERROR, "request does not fit in the KV cache")
        plan.admitted = []
        return frees

    def _preempt_for(self, plan: _StepPlan, failed: list[tuple[Sequence, int]]) -> list[bm.Op]:
        """Preempt the latest arrivals until each failed append can be retried.
        Blocks a victim releases may be shared, so this is an estimate; a
        retry that still finds no room comes back for another round."""
        ops: list[bm.Op] = []
        released = 0
        for seq, k in failed:
            group = self._seq_group[seq.seq_id]
            need = max(1, -(-(seq.num_computed_tokens + k) // self.cfg.block_size) - seq.num_blocks)
            while group.request_id not in plan.preempted and released < need:
                victim = self.running[-1]
                if victim is group and len(self.running) == 1:
                    # Alone and still no room: waiting cannot help.
                    self.running.remove(group)
                    plan.preempted.add(group.request_id)
                    self._unschedule(plan, group)
                    self._finish_group(group, FinishReason.ERROR, "sequence outgrew the KV cache")
                    ops += [bm.Free(s) for s in self._pending_frees]
                    self._pending_frees = []
                    break
                released += victim_blocks(victim)
                ops += self._preempt(plan, victim)
            if group.request_id not in plan.preempted:
                released -= need
                ops.append(self._append_op(seq, k))
                plan.await_append[seq.seq_id] = (seq, k)
        return ops

    def _unschedule(self, plan: _StepPlan, group: SequenceGroup) -> None:
        for s in group.seqs:
            plan.scheduled.pop(s.seq_id, None)
            plan.await_append.pop(s.seq_id, None)
            if s in plan.new_seqs:
                plan.new_seqs.remove(s)

    def _preempt(self, plan: _StepPlan, group: SequenceGroup) -> list[bm.Op]:
        self.num_preemptions += 1
        group.num_preemptions += 1
        plan.preempted.add(group.request_id)
        self.running.remove(group)
        self._unschedule(plan, group)
        live = group.live_seqs
        if self._use_swap(group):
            for s in live:
                s.status = SeqStatus.SWAPPED
                plan.await_swap_out[s.seq_id] = group
            self.swapped.append(group)
            self.swapped.sort(key=lambda g: g.arrival_order)
            return [bm.SwapOut([s.seq_id for s in live])]
        # An append earlier in this step may have given the victim a block: the
        # worker drops it (finished) before applying diffs, so none may name it.
        ids = {s.seq_id for s in live}
        plan.block_diffs = [d for d in plan.block_diffs if d.seq_id not in ids]
        return self._recompute(group)

    def _recompute(self, group: SequenceGroup) -> list[bm.Op]:
        """Drop the group's K/V; it is prefilled again (prompt + output so far)."""
        live = group.live_seqs
        for s in live:
            s.status = SeqStatus.WAITING
            s.num_computed_tokens = 0
            s.block_table = []
            if s.known_to_worker:
                self._pending_drops.append(s.seq_id)
                s.known_to_worker = False
        # Back to the queue, ahead of every later arrival.
        self.waiting.append(group)
        self.waiting = deque(sorted(self.waiting, key=lambda g: g.arrival_order))
        return [bm.Free(s.seq_id) for s in live]

    def _use_swap(self, group: SequenceGroup) -> bool:
        live = group.live_seqs
        if self.cfg.num_cpu_blocks == 0 or not all(s.known_to_worker for s in live):
            return False
        if self.cfg.preemption_mode == "swap":
            return True
        if self.cfg.preemption_mode == "auto":
            # The paper (sec. 7.3): recomputation is never much slower than swapping
            # at block sizes >= 16, and needs no CPU memory; swapping pays when a
            # group's sequences share blocks (parallel sampling, beam search), which
            # recomputation would have to rebuild once per sequence.
            return len(live) > 1
        return False

    def _build_execute(self, plan: _StepPlan) -> wk.ExecuteStep | None:
        new_seqs = []
        for seq in plan.new_seqs:
            group = self._seq_group[seq.seq_id]
            new_seqs.append(wk.NewSeq(seq.seq_id, list(seq.token_ids), list(seq.block_table),
                                      seq.num_computed_tokens, self._worker_params(group, seq),
                                      seq.num_prompt_tokens))
            seq.known_to_worker = True
        scheduled = [wk.ScheduledSeq(s.seq_id, k) for s, k in plan.scheduled.values() if k > 0]
        drops, self._pending_drops = self._pending_drops, []
        if not scheduled and not new_seqs and not drops and not plan.copies and not plan.swap_in and not plan.swap_out:
            self._plan = None
            return None
        self.num_steps += 1
        return wk.ExecuteStep(next(self._step_ids), new_seqs, plan.block_diffs, scheduled, drops,
                              plan.copies, plan.swap_in, plan.swap_out)

    @staticmethod
    def _worker_params(group: SequenceGroup, seq: Sequence) -> SamplingParams:
        p = group.params
        if group.beam is not None:
            # Each beam reports its best continuations; the scheduler chooses.
            return msgspec.structs.replace(p, temperature=0.0, seed=None, n=1, beam_width=1,
                                           logprobs=group.beam.candidates_per_beam)
        if p.n > 1:
            # Each sample has its own seed stream: the same outputs as n separate
            # requests seeded seed, seed+1, ... (sharing must not change results).
            return msgspec.structs.replace(p, n=1, seed=None if p.seed is None else p.seed + seq.index)
        return p

    # ------------------------------------------------------------ results
    def on_step_result(self, result: wk.StepResult) -> list[TokenDelta]:
        plan = self._plan
        assert plan is not None
        self._plan = None
        for seq, k in plan.scheduled.values():
            seq.num_computed_tokens += k
        for pl in result.prompt_logprobs:
            group = self._seq_group.get(pl.seq_id)
            if group is None or group.prompt_logprobs_sent:
                continue
            # Entries start at position 1; a recompute after preemption sends known ones again.
            have = 1 + len(group.prompt_logprobs)
            group.prompt_logprobs += pl.entries[max(0, have - pl.start):]
        beam_groups: list[SequenceGroup] = []
        for st in result.sampled:
            group = self._seq_group.get(st.seq_id)
            if group is None:
                continue
            seq = self._seq_by_id(st.seq_id)
            if seq.is_finished:
                continue
            if group.beam is not None:
                group.beam_tops[seq.seq_id] = st.top_logprobs
                if group not in beam_groups:
                    beam_groups.append(group)
                continue
            seq.token_ids.append(st.token_id)
            reason = self._stop_reason(group, seq, st.token_id)
            delta = TokenDelta(group.request_id, seq.index, [st.token_id], reason.value if reason else None,
                               seq.num_prompt_tokens)
            if group.params.logprobs is not None:
                delta.logprobs = [(st.logprob if st.logprob is not None else 0.0, st.top_logprobs)]
            if group.params.prompt_logprobs is not None and not group.prompt_logprobs_sent:
                delta.prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
            if not group.queue_time_sent:
                delta.queue_time_s, group.queue_time_sent = group.queue_time_s, True
            self._deltas.append(delta)
            if reason is not None:
                self._finish_seq(seq, reason)
                if group.is_finished:
                    self.running.remove(group)
                    self._forget(group)
        for group in beam_groups:
            live = group.live_seqs
            if all(s.seq_id in group.beam_tops for s in live):
                self._beam_step(group, live)
        return self.take_deltas()

    def _beam_step(self, group: SequenceGroup, live: list[Sequence]) -> None:
        """Every live beam has reported: choose the next beams. Each new beam
        forks its parent (sharing all its blocks); the old beams are freed."""
        beam = group.beam
        assert beam is not None
        tops = [group.beam_tops[s.seq_id] for s in live]
        group.beam_tops = {}
        if not any(tops):
            self.running.remove(group)
            self._finish_group(group, FinishReason.ERROR, "beam search needs top logprobs, and the worker sent none")
            return
        running = [Hypothesis(s.token_ids[s.num_prompt_tokens:], s.cum_logprob) for s in live]
        choices = beam.step(running, tops)
        children: list[Sequence] = []
        for i, c in enumerate(choices):
            parent = live[c.parent]
            child = Sequence(next(self._seq_ids), i, parent.token_ids + [c.token_id], parent.num_prompt_tokens,
                             len(parent.token_ids), status=SeqStatus.RUNNING, cum_logprob=c.cum_logprob)
            self._track(group, child)
            self._pending_forks.append(bm.Fork(parent.seq_id, child.seq_id))
            children.append(child)
        for s in live:
            self._finish_seq(s, FinishReason.STOP)  # frees its blocks after the forks above
            self._untrack(s.seq_id)
        group.seqs = children
        if beam.done:
            for i, hyp in enumerate(beam.results(max(1, group.params.n))):
                reason = FinishReason.STOP if hyp.token_ids and hyp.token_ids[-1] in self.cfg.eos_token_ids \
                    else FinishReason.LENGTH
                self._deltas.append(TokenDelta(group.request_id, i, hyp.token_ids, reason.value,
                                               live[0].num_prompt_tokens, replace=True,
                                               cumulative_logprob=hyp.score))
            self.running.remove(group)
            self._forget(group)

    def on_step_failed(self, message: str) -> list[TokenDelta]:
        """The worker failed the step: fail the requests it held, keep serving."""
        plan = self._plan
        assert plan is not None
        self._plan = None
        hit = {self._seq_group[s.seq_id].request_id for s, _ in plan.scheduled.values()}
        for rid in hit:
            group = self.groups[rid]
            self.running.remove(group)
            self._finish_group(group, FinishReason.ERROR, message)
        return self.take_deltas()

    def _stop_reason(self, group: SequenceGroup, seq: Sequence, tok: int) -> FinishReason | None:
        p = group.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if tok in self.cfg.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP
            if tok in p.stop_token_ids:
                return FinishReason.STOP
        if n_out >= p.max_tokens or len(seq.token_ids) >= self.cfg.max_model_len:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------ bookkeeping
    def _finish_seq(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            self._pending_frees.append(seq.seq_id)
            if seq.status is SeqStatus.RUNNING:
                self._pending_free_blocks += seq.num_blocks
        if seq.known_to_worker:
            self._pending_drops.append(seq.seq_id)
            seq.known_to_worker = False
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.block_table = []

    def _finish_group(self, group: SequenceGroup, reason: FinishReason, error: str | None = None) -> None:
        group.error = error
        for seq in group.seqs:
            if not seq.is_finished:
                self._finish_seq(seq, reason)
                self._deltas.append(TokenDelta(group.request_id, seq.index, [], reason.value,
                                               seq.num_prompt_tokens, error))
        self._forget(group)

    def _forget(self, group: SequenceGroup) -> None:
        self.groups.pop(group.request_id, None)
        for s in group.seqs:
            self._untrack(s.seq_id)


def victim_blocks(group: SequenceGroup) -> int:
    return sum(s.num_blocks for s in group.live_seqs)
