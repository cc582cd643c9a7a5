"""Request intake: a request becomes a ``SequenceGroup`` and queues (or waits
for its grammar), an abort ends it wherever it is, compiled grammars release
the requests that waited for them, and recovery puts every request back to
waiting. ``Intake`` keeps no state of its own: it moves requests through
``Requests`` and ``GrammarGate`` and ends them through ``Finisher``."""
from __future__ import annotations

from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AddRequest, ErrorKind, TokenDelta
from pagedserve.scheduler.beam import BeamSearch
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import PoolSize, SchedulerConfig
from pagedserve.scheduler.finish import Finisher
from pagedserve.scheduler.grammar_gate import GrammarGate
from pagedserve.scheduler.requests import Requests
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


class Intake:
    def __init__(self, cfg: SchedulerConfig, requests: Requests, grammars: GrammarGate, carry: StepCarry,
                 finisher: Finisher) -> None:
        self._cfg = cfg
        self._requests = requests
        self._grammars = grammars
        self._carry = carry
        self._finisher = finisher

    def add(self, req: AddRequest, pool: PoolSize) -> None:
        requests = self._requests
        # A resumed sample of a parallel-sampling request is sent as "ID/INDEX" (frontend/core/resume.py;
        # "/" is never in a frontend request id): the original group reached this scheduler too.
        if req.resume and "/" in req.request_id and req.request_id.rpartition("/")[0] in requests.groups:
            return
        if req.request_id in requests.groups:
            if req.resume:  # the original reached this scheduler too: it runs already
                return
            self._finisher.emit(TokenDelta(req.request_id, 0, [], FinishReason.ERROR, len(req.prompt_token_ids),
                                           f"duplicate request_id {req.request_id!r}"))
            return
        cfg = self._cfg
        p = req.params
        prompt = list(req.prompt_token_ids)
        # n > 1: one sequence prefills the prompt, the others fork from it later
        # (a one-token prompt has nothing to share). Beam search starts from one beam.
        fork_later = p.beam_width <= 1 and p.n > 1 and len(prompt) > 1
        width = 1 if fork_later or p.beam_width > 1 else max(1, p.n)
        n_prompt = len(prompt) - req.num_output_tokens
        seqs = [Sequence(requests.new_seq_id(), i, list(prompt), n_prompt) for i in range(width)]
        group = SequenceGroup(req.request_id, seqs, p, req.arrival_time, requests.next_arrival(),
                              req.cache_salt, needs_fork=fork_later)
        if p.beam_width > 1:
            group.beam = BeamSearch(p.beam_width, len(prompt), min(len(prompt) + p.max_tokens, cfg.max_model_len),
                                    cfg.eos_token_ids, p.length_penalty, p.early_stopping)
        # A hybrid KV cache counts each group's blocks (a sliding group holds about its
        # window, prefilling in chunks as small as a block if it must: Scheduler._chunk_cap).
        blocks_needed = cfg.blocks_held(len(req.prompt_token_ids) + 1,
                                        cfg.block_size if cfg.enable_chunked_prefill else None)
        if blocks_needed > pool.num_gpu_blocks:
            self._finisher.finish_group(group, FinishReason.ERROR,
                                        f"prompt of {len(req.prompt_token_ids)} tokens needs {blocks_needed} "
                                        f"KV blocks; the pool has {pool.num_gpu_blocks}", ErrorKind.KV_CACHE)
            return
        requests.register(group)
        if self._grammars.admit(group):
            requests.enqueue(group)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            group = self._requests.groups.get(rid)
            if group is None:
                continue
            if not self._requests.unqueue(group):
                self._grammars.remove(group)
            self._finisher.finish_group(group, FinishReason.ABORT)

    def on_grammars(self, statuses: list[wk.GrammarStatus]) -> None:
        """Compiles the worker finished: their requests queue in arrival order, or fail."""
        if not statuses:
            return
        ready, failed = self._grammars.on_compiled(statuses)
        if ready:
            self._requests.merge_waiting(ready)
        for group, why in failed:
            self._finisher.finish_group(group, FinishReason.ERROR, f"invalid structured output: {why}",
                                        ErrorKind.INVALID_REQUEST)

    def requeue_all(self) -> int:
        """Every running and swapped group back to waiting with no K/V and no
        blocks (``Scheduler.requeue_all``); returns how many were in flight."""
        requests = self._requests
        in_flight = len(requests.running) + len(requests.swapped)
        groups = requests.take_all()
        for group in groups:
            group.beam_tops = {}  # a half-reported beam step is sampled again
            for s in group.live_seqs:
                s.status = SeqStatus.WAITING
                s.num_computed_tokens = 0
                s.num_blocks = 0
                s.num_pending, s.num_unknown_slots = 0, 0
                s.known_to_worker = False
        # The restarted worker compiled nothing: constrained requests wait for their grammar again.
        self._grammars.reset()
        for g in groups:
            if self._grammars.admit(g):
                requests.enqueue(g)
        # Beam forks name parents the reset blockmgr no longer has: each new beam
        # is prefilled from its own tokens instead.
        self._carry.clear()
        return in_flight

