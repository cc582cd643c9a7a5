"""Applying the worker's ``StepResult``, part of the ``Scheduler``: computed
counts, sampled tokens, stop conditions, beam steps and the deltas streamed
to the frontend; and what each sequence's worker-side sampling params are."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import msgspec

from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import ErrorKind, TokenDelta
from pagedserve.common.messages.types import SamplingParams
from pagedserve.scheduler.beam import Hypothesis
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.grammar_gate import GrammarGate
from pagedserve.scheduler.plan import StepOrderError, StepPhase, StepPlan
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


class Results:
    """Mixed into ``Scheduler``; the state it reads is the scheduler's."""

    cfg: SchedulerConfig
    running: list[SequenceGroup]
    groups: dict[str, SequenceGroup]
    _seq_group: dict[int, SequenceGroup]
    _seq_ids: "itertools.count[int]"
    carry: StepCarry
    _deltas: list[TokenDelta]

    if TYPE_CHECKING:  # provided by the class this is mixed into
        def _seq_by_id(self, seq_id: int) -> Sequence: ...
        def _track(self, group: SequenceGroup, seq: Sequence) -> None: ...
        def _untrack(self, seq_id: int) -> None: ...
        def on_grammars(self, statuses: list[wk.GrammarStatus]) -> None: ...
        grammars: GrammarGate
        def take_deltas(self) -> list[TokenDelta]: ...
        def _finish_seq(self, seq: Sequence, reason: FinishReason) -> None: ...
        def _finish_group(self, group: SequenceGroup, reason: FinishReason, error: str | None = None,
                          kind: ErrorKind = ErrorKind.INTERNAL) -> None: ...
        def _forget(self, group: SequenceGroup) -> None: ...

    @staticmethod
    def _worker_params(group: SequenceGroup, seq: Sequence) -> SamplingParams:
        p = group.params
        if group.beam is not None:
            # Each beam reports its best continuations; the scheduler chooses.
            return msgspec.structs.replace(p, temperature=0.0, seed=None, n=1, beam_width=1,
                                           logprobs=group.beam.candidates_per_beam)
        if p.n > 1:
            return p.for_sample(seq.index)  # sharing must not change results
        return p

    def _land(self, plan: StepPlan, step_id: int | None, call: str) -> None:
        """The plan in flight, and only it, takes its result (carry.py)."""
        plan.expect(StepPhase.SENT, call)
        if self.carry.in_flight is not plan:
            raise StepOrderError(f"{call}: step {plan.step_id} is not the step in flight")
        if step_id is not None and step_id != plan.step_id:
            raise StepOrderError(f"{call}: the result of step {step_id} for step {plan.step_id}")
        self.carry.in_flight, plan.phase = None, StepPhase.APPLIED

    def on_step_result(self, plan: StepPlan, result: wk.StepResult) -> list[TokenDelta]:
        self._land(plan, result.step_id, "on_step_result")
        self.on_grammars(result.grammars)
        for seq, _ in plan.scheduled.values():
            seq.num_pending = 0  # computed counts moved on when the step was sent (build_execute)
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
            delta = TokenDelta(group.request_id, seq.index, [st.token_id], reason,
                               seq.num_prompt_tokens)
            if group.params.logprobs is not None:
                delta.logprobs = [(st.logprob if st.logprob is not None else 0.0, st.top_logprobs)]
            if group.params.prompt_logprobs is not None and not group.prompt_logprobs_sent:
                delta.prompt_logprobs, group.prompt_logprobs_sent = group.prompt_logprobs, True
            if not group.queue_time_sent:
                delta.queue_time_s, group.queue_time_sent = group.queue_time_s, True
                delta.num_cached_tokens = group.num_cached_tokens
            self._deltas.append(delta)
            if reason is not None:
                delta.num_preemptions = group.num_preemptions
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
            self.carry.forks.append(bm.Fork(parent.seq_id, child.seq_id))
            children.append(child)
        for s in live:
            self._finish_seq(s, FinishReason.STOP)  # frees its blocks after the forks above
            self._untrack(s.seq_id)
        group.seqs = children
        if beam.done:
            for i, hyp in enumerate(beam.results(max(1, group.params.n))):
                reason = FinishReason.STOP if hyp.token_ids and hyp.token_ids[-1] in self.cfg.eos_token_ids \
                    else FinishReason.LENGTH
                self._deltas.append(TokenDelta(group.request_id, i, hyp.token_ids, reason,
                                               live[0].num_prompt_tokens, replace=True,
                                               cumulative_logprob=hyp.score, num_preemptions=group.num_preemptions))
            self.running.remove(group)
            self._forget(group)

    def on_step_failed(self, plan: StepPlan, message: str) -> list[TokenDelta]:
        """The worker failed the step: fail the requests it held, keep serving."""
        self._land(plan, None, "on_step_failed")
        self.grammars.unask(plan.compile)
        # A group aborted while the step ran (async scheduling) is gone already.
        hit = {g.request_id for s, _ in plan.scheduled.values() if (g := self._seq_group.get(s.seq_id)) is not None}
        for rid in hit:
            group = self.groups[rid]
            # Normally running; a protocol error (a sequence the worker does not
            # hold) can name a group elsewhere, and failing it must not crash the loop.
            for queue in (self.running, self.waiting, self.swapped):
                if group in queue:
                    queue.remove(group)
            self._finish_group(group, FinishReason.ERROR, message)
        return self.take_deltas()

    def _stop_reason(self, group: SequenceGroup, seq: Sequence, tok: int) -> FinishReason | None:
        p = group.params
        if seq.num_output_tokens >= p.min_tokens:
            if tok in self.cfg.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP
            if tok in p.stop_token_ids:
                return FinishReason.STOP
        if group.long_enough(seq, self.cfg.max_model_len):  # num_pending is 0 once the token is in
            return FinishReason.LENGTH
        return None
