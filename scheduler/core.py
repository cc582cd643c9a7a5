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
arrivals (last come, first preempted, whole groups) and retries. Planning and
sending a step are here; the other parts are collaborators, each the one
writer of its own state: ``requests.py`` (groups, sequences, queues),
``carry.py`` (what a step leaves for the next), ``grammar_gate.py``,
``finish.py`` (ending requests; the deltas owed), ``preemption.py`` (the
preemption count); ``intake.py`` (add, abort, requeue), ``replies.py`` (the
blockmgr's reply) and ``results.py`` (the worker's result) keep none.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq  # not the scheduler's Sequence

from pagedserve.common.blocks import cdiv
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AddRequest, TokenDelta
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import PoolSize, SchedulerConfig
from pagedserve.scheduler.finish import Finisher
from pagedserve.scheduler.grammar_gate import GrammarGate
from pagedserve.scheduler.intake import Intake
from pagedserve.scheduler.plan import StepOrderError, StepPhase, StepPlan, append_op
from pagedserve.scheduler.preemption import Preemptor
from pagedserve.scheduler.replies import BlockReplies, answers, must_settle
from pagedserve.scheduler.requests import Requests
from pagedserve.scheduler.results import StepResults, worker_params
from pagedserve.scheduler.sequence import Sequence, SequenceGroup, SeqStatus


class BlockReplyMismatch(ValueError):
    """A StepReply whose results do not pair with the request's ops."""


class Scheduler:
    """The scheduler's one interface, driven by ``EngineCore``. It plans and
    sends steps and owns what planning needs (the pool size, the blockmgr's
    last counts, the step count); each other piece of state has one owner
    among its parts: ``Requests`` (groups, sequences, the queues),
    ``StepCarry``, ``GrammarGate``, ``Finisher`` (the deltas owed) and
    ``Preemptor`` (the preemption count). ``Intake``, ``BlockReplies`` and
    ``StepResults`` hold none (docs/architecture.md, "The scheduler's parts")."""

    def __init__(self, cfg: SchedulerConfig, pool: PoolSize) -> None:
        self.cfg = cfg
        self.pool = pool
        self.block_stats: bm.BlockStats | None = None  # the blockmgr's, from its last reply
        self.num_steps = 0
        self._step_ids = itertools.count()
        self.requests = Requests()
        self.carry = StepCarry()
        self.grammars = GrammarGate()
        self.finisher = Finisher(cfg, self.requests, self.carry)
        self.preemptor = Preemptor(cfg, self.requests, self.carry, self.finisher)
        self._intake = Intake(cfg, self.requests, self.grammars, self.carry, self.finisher)
        self._results = StepResults(cfg, self.requests, self.carry, self.finisher)
        self._replies = BlockReplies(self.requests, self.finisher, self.preemptor)

    # ------------------------------------------------------------ what the engine reads
    @property
    def waiting(self) -> Seq[SequenceGroup]:
        return self.requests.waiting

    @property
    def running(self) -> Seq[SequenceGroup]:
        return self.requests.running

    @property
    def swapped(self) -> Seq[SequenceGroup]:
        return self.requests.swapped

    @property
    def groups(self) -> Mapping[str, SequenceGroup]:
        return self.requests.groups

    @property
    def num_preemptions(self) -> int:
        return self.preemptor.num_preemptions

    @property
    def num_waiting(self) -> int:
        """Queued for scheduling, or for their grammar (vLLM counts both as waiting)."""
        return len(self.requests.waiting) + len(self.grammars.waiting)

    def has_work(self) -> bool:
        r = self.requests
        return bool(r.waiting or r.running or r.swapped or self.carry or self.grammars.waiting)

    def resize(self, pool: PoolSize) -> None:
        """A restarted worker sized its pools anew (``EngineCore.recover``)."""
        self.pool = pool

    # ------------------------------------------------------------ requests
    def add_request(self, req: AddRequest) -> None:
        self._intake.add(req, self.pool)

    def abort(self, request_ids: list[str]) -> None:
        self._intake.abort(request_ids)

    def requeue_all(self) -> int:
        """Recovery by recompute (docs/fault-tolerance.md): the gpuworker or the
        blockmgr lost its state, so every running and swapped group goes back
        to waiting with no K/V and no blocks, and resumes by recomputing its
        prompt plus the tokens generated so far, as a recompute preemption
        does. The components were reset, so nothing is owed (carry cleared),
        and a step in flight is forgotten (its result never came, so none of
        its tokens were emitted). Returns how many groups were in flight."""
        n = self._intake.requeue_all()
        self.block_stats = None
        return n

    def take_deltas(self) -> list[TokenDelta]:
        return self.finisher.take()

    def put_back(self, deltas: list[TokenDelta]) -> None:
        """Deltas taken but not delivered: the next ``take_deltas`` returns them first."""
        self.finisher.put_back(deltas)

    # ------------------------------------------------------------ results
    def on_step_result(self, plan: StepPlan, result: wk.StepResult) -> list[TokenDelta]:
        self.carry.land(plan, result.step_id, "on_step_result")
        self._intake.on_grammars(result.grammars)
        self._results.apply(plan, result)
        return self.finisher.take()

    def on_step_failed(self, plan: StepPlan, message: str) -> list[TokenDelta]:
        """The worker failed the step: fail the requests it held, keep serving."""
        self.carry.land(plan, None, "on_step_failed")
        self.grammars.unask(plan.compile)
        self._results.fail(plan, message)
        return self.finisher.take()

    # ------------------------------------------------------------ planning
    def _fork_children(self, group: SequenceGroup) -> list[bm.Op]:
        """The first sequence has prefilled all but the prompt's last token:
        the other n-1 fork from it, and each computes that token (copy-on-write
        gives each its own copy of a shared, partly filled last block)."""
        parent = group.seqs[0]
        ops: list[bm.Op] = []
        for i in range(1, group.params.n):
            child = Sequence(self.requests.new_seq_id(), i, list(parent.token_ids), parent.num_prompt_tokens,
                             parent.num_computed_tokens, status=SeqStatus.RUNNING,
                             num_unknown_slots=parent.num_unknown_slots)
            group.seqs.append(child)
            self.requests.track(group, child)
            ops.append(bm.Fork(parent.seq_id, child.seq_id))
        group.needs_fork = False
        return ops

    def schedule(self) -> StepPlan | None:
        """Plan a step: every memory op of it, in order, in ``plan.request``; None if idle."""
        requests = self.requests
        ops, freed = self.carry.take_memory_ops()
        for group in requests.running:
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
        for group in requests.running:
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
                ops.append(append_op(seq, k))
                if room is not None:
                    room -= G * max(0, cdiv(seq.num_computed_tokens + k, bs) - seq.num_blocks)
        num_seqs = sum(g.batch_width for g in requests.running)
        # Swapped groups resume before new admissions.
        for group in requests.swapped:
            live = group.live_seqs
            if num_seqs + len(live) > self.cfg.max_num_seqs:
                break
            ops.append(bm.SwapIn([s.seq_id for s in live]))
            num_seqs += len(live)
            plan.admitted.append(group)
        if not requests.swapped:
            for group in requests.waiting:
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
        return must_settle(plan, reply)

    def on_block_reply(self, plan: StepPlan, reply: bm.StepReply) -> bm.StepRequest | None:
        """Apply the blockmgr's answer to ``plan.request``; returns the next
        round's request (preemption, releases), or None when the step is settled."""
        plan.expect(StepPhase.BLOCKS, "on_block_reply")
        if self.carry.in_flight is not None and must_settle(plan, reply):
            raise StepOrderError("on_block_reply: this reply preempts; apply the step in flight first")
        pairs = answers(plan.request.ops)
        if len(pairs) != len(reply.results):
            raise BlockReplyMismatch(f"{len(reply.results)} results for {len(pairs)} answers expected")
        self.block_stats = reply.stats
        more = self._replies.apply(plan, pairs, reply, self.pool.num_cpu_blocks)
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

    def build_execute(self, plan: StepPlan) -> wk.ExecuteStep | None:
        """The worker's half of the plan; None when nothing is left to run.
        Sent, it is the plan in flight until its result is applied."""
        plan.expect(StepPhase.SETTLED, "build_execute")
        if self.carry.in_flight is not None:  # checked again by carry.send, before anything changed
            raise StepOrderError("build_execute: the step in flight is not applied yet")
        new_seqs = []
        for seq in plan.new_seqs:
            group = self.requests.group_of(seq.seq_id)
            assert group is not None
            # Its blocks follow as diffs (applied after new_seqs): the worker's
            # table is built from the blockmgr's diffs only.
            new_seqs.append(wk.NewSeq(seq.seq_id, list(seq.token_ids), seq.num_computed_tokens,
                                      worker_params(group, seq), seq.num_prompt_tokens))
            seq.known_to_worker = True
        # A sequence freed or recomputed later in the step is not (or no longer) the worker's.
        diffs = [d for d in plan.block_diffs if (s := self.requests.seq(d.seq_id)) is not None and s.known_to_worker]
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
        self.carry.send(plan)
        return wk.ExecuteStep(plan.step_id, new_seqs, diffs, scheduled, drops,
                              plan.copies, plan.swap_in, plan.swap_out, plan.compile)
