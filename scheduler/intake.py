"""Request intake, part of the ``Scheduler``: adding a request, aborting it,
the queue of deltas produced outside a worker step, and the bookkeeping of
which sequence belongs to which group (tracking, finishing, forgetting)."""
from __future__ import annotations

import itertools
from collections import deque

from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AddRequest, ErrorKind, TokenDelta
from pagedserve.scheduler.beam import BeamSearch
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import PoolSize, SchedulerConfig
from pagedserve.scheduler.grammar_gate import GrammarGate
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


class Intake:
    """Mixed into ``Scheduler``; the state it reads is the scheduler's."""

    cfg: SchedulerConfig
    pool: PoolSize
    waiting: deque[SequenceGroup]
    running: list[SequenceGroup]
    swapped: list[SequenceGroup]
    groups: dict[str, SequenceGroup]
    grammars: GrammarGate
    _seq_group: dict[int, SequenceGroup]
    _seqs: dict[int, Sequence]
    _seq_ids: "itertools.count[int]"
    _arrivals: "itertools.count[int]"
    carry: StepCarry
    _deltas: list[TokenDelta]
    block_stats: bm.BlockStats | None

    # ------------------------------------------------------------ requests
    def add_request(self, req: AddRequest) -> None:
        # A resumed sample of a parallel-sampling request is sent as "ID/INDEX" (frontend/resume.py;
        # "/" is never in a frontend request id): the original group reached this scheduler too.
        if req.resume and "/" in req.request_id and req.request_id.rpartition("/")[0] in self.groups:
            return
        if req.request_id in self.groups:
            if req.resume:  # the original reached this scheduler too: it runs already
                return
            self._deltas.append(TokenDelta(req.request_id, 0, [], FinishReason.ERROR,
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
                              req.cache_salt, needs_fork=fork_later)
        if p.beam_width > 1:
            group.beam = BeamSearch(p.beam_width, len(prompt), min(len(prompt) + p.max_tokens, self.cfg.max_model_len),
                                    self.cfg.eos_token_ids, p.length_penalty, p.early_stopping)
        # A hybrid KV cache counts each group's blocks (a sliding group holds about its
        # window, prefilling in chunks as small as a block if it must: Scheduler._chunk_cap).
        blocks_needed = self.cfg.blocks_held(len(req.prompt_token_ids) + 1, self.cfg.block_size
                                             if self.cfg.enable_chunked_prefill else None)
        if blocks_needed > self.pool.num_gpu_blocks:
            self._finish_group(group, FinishReason.ERROR,
                               f"prompt of {len(req.prompt_token_ids)} tokens needs {blocks_needed} KV blocks; "
                               f"the pool has {self.pool.num_gpu_blocks}", ErrorKind.KV_CACHE)
            return
        self.groups[group.request_id] = group
        for s in seqs:
            self._track(group, s)
        if self.grammars.admit(group):
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
            else:
                self.grammars.remove(group)
            self._finish_group(group, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.carry or self.grammars.waiting)

    def requeue_all(self) -> int:
        """Recovery by recompute (docs/fault-tolerance.md): the gpuworker or the
        blockmgr lost its state, so every running and swapped group goes back
        to waiting with no K/V and no blocks, and resumes by recomputing its
        prompt plus the tokens generated so far, as a recompute preemption
        does. The components were reset, so nothing is owed (carry cleared),
        and a step in flight is forgotten (its result never came, so none of
        its tokens were emitted). Returns how many groups were in flight."""
        in_flight = [*self.running, *self.swapped]
        groups = sorted([*self.waiting, *in_flight], key=lambda g: g.arrival_order)
        self.running, self.swapped = [], []
        for group in groups:
            group.beam_tops = {}  # a half-reported beam step is sampled again
            for s in group.live_seqs:
                s.status = SeqStatus.WAITING
                s.num_computed_tokens = 0
                s.num_blocks = 0
                s.num_pending, s.num_unknown_slots = 0, 0
                s.known_to_worker = False
        # The restarted worker compiled nothing: constrained requests wait for their grammar again.
        self.grammars.reset()
        self.waiting = deque(g for g in groups if self.grammars.admit(g))
        # Beam forks name parents the reset blockmgr no longer has: each new beam
        # is prefilled from its own tokens instead.
        self.carry.clear()
        self.block_stats = None
        return len(in_flight)

    @property
    def num_waiting(self) -> int:
        """Queued for scheduling, or for their grammar (vLLM counts both as waiting)."""
        return len(self.waiting) + len(self.grammars.waiting)

    def on_grammars(self, statuses: list[wk.GrammarStatus]) -> None:
        """Compiles the worker finished: their requests queue in arrival order, or fail."""
        if not statuses:
            return
        ready, failed = self.grammars.on_compiled(statuses)
        if ready:
            self.waiting = deque(sorted([*self.waiting, *ready], key=lambda g: g.arrival_order))
        for group, why in failed:
            self._finish_group(group, FinishReason.ERROR, f"invalid structured output: {why}",
                               ErrorKind.INVALID_REQUEST)

    def take_deltas(self) -> list[TokenDelta]:
        out, self._deltas = self._deltas, []
        return out

    def put_back(self, deltas: list[TokenDelta]) -> None:
        """Deltas taken but not delivered: the next ``take_deltas`` returns them first."""
        self._deltas[:0] = deltas

    # ------------------------------------------------------------ bookkeeping
    def _seq_by_id(self, seq_id: int) -> Sequence:
        return self._seqs[seq_id]

    def _track(self, group: SequenceGroup, seq: Sequence) -> None:
        self._seq_group[seq.seq_id] = group
        self._seqs[seq.seq_id] = seq

    def _untrack(self, seq_id: int) -> None:
        self._seq_group.pop(seq_id, None)
        self._seqs.pop(seq_id, None)

    def _finish_seq(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            running = seq.status is SeqStatus.RUNNING
            self.carry.frees[seq.seq_id] = self.cfg.table_blocks(seq.num_blocks) if running else 0
        if seq.known_to_worker:
            self.carry.drops.append(seq.seq_id)
            seq.known_to_worker = False
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.num_blocks = 0

    def _finish_group(self, group: SequenceGroup, reason: FinishReason, error: str | None = None,
                      kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        for seq in group.seqs:
            if not seq.is_finished:
                self._finish_seq(seq, reason)
                self._deltas.append(TokenDelta(group.request_id, seq.index, [], reason,
                                               seq.num_prompt_tokens, error, error_kind=kind))
        self._forget(group)

    def _forget(self, group: SequenceGroup) -> None:
        self.groups.pop(group.request_id, None)
        for s in group.seqs:
            self._untrack(s.seq_id)
