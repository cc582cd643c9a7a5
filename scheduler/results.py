"""Applying the worker's ``StepResult``: computed counts, sampled tokens, stop
conditions, beam steps and the deltas streamed to the frontend; and what each
sequence's worker-side sampling params are. ``StepResults`` keeps no state of
its own: it owes new beams' forks to ``StepCarry``, ends sequences and
requests through ``Finisher`` and moves groups through ``Requests``."""
from __future__ import annotations

import msgspec

from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import TokenDelta
from pagedserve.common.messages.types import SamplingParams
from pagedserve.scheduler.beam import Hypothesis
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.finish import Finisher
from pagedserve.scheduler.plan import StepPlan
from pagedserve.scheduler.requests import Requests
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


def worker_params(group: SequenceGroup, seq: Sequence) -> SamplingParams:
    """The sampling params the worker runs ``seq`` with."""
    p = group.params
    if group.beam is not None:
        # Each beam reports its best continuations; the scheduler chooses.
        return msgspec.structs.replace(p, temperature=0.0, seed=None, n=1, beam_width=1,
                                       logprobs=group.beam.candidates_per_beam)
    if p.n > 1:
        return p.for_sample(seq.index)  # sharing must not change results
    return p


class StepResults:
    def __init__(self, cfg: SchedulerConfig, requests: Requests, carry: StepCarry, finisher: Finisher) -> None:
        self._cfg = cfg
        self._requests = requests
        self._carry = carry
        self._finisher = finisher

    def apply(self, plan: StepPlan, result: wk.StepResult) -> None:
        """The result of a landed plan (``StepCarry.land``): tokens, stops and
        beam steps; the deltas go to the ``Finisher``."""
        requests, finisher = self._requests, self._finisher
        for seq, _ in plan.scheduled.values():
            seq.num_pending = 0  # computed counts moved on when the step was sent (build_execute)
        for pl in result.prompt_logprobs:
            group = requests.group_of(pl.seq_id)
            if group is None or group.prompt_logprobs_sent:
                continue
            # Entries start at position 1; a recompute after preemption sends known ones again.
            have = 1 + len(group.prompt_logprobs)
            group.prompt_logprobs += pl.entries[max(0, have - pl.start):]
            if len(pl.ranks) == len(pl.entries):  # ranks only while every entry has one
                group.prompt_logprob_ranks += pl.ranks[max(0, have - pl.start):]
        beam_groups: list[SequenceGroup] = []
        for st in result.sampled:
            group = requests.group_of(st.seq_id)
            if group is None:
                continue
            seq = requests.seq(st.seq_id)
            assert seq is not None
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
                if len(group.prompt_logprob_ranks) == len(group.prompt_logprobs):
                    delta.prompt_logprob_ranks = group.prompt_logprob_ranks
            if not group.queue_time_sent:
                delta.queue_time_s, group.queue_time_sent = group.queue_time_s, True
                delta.num_cached_tokens = group.num_cached_tokens
            finisher.emit(delta)
            if reason is not None:
                delta.num_preemptions = group.num_preemptions
                finisher.finish_seq(seq, reason)
                if group.is_finished:
                    requests.stop_running(group)
                    requests.forget(group)
        for group in beam_groups:
            live = group.live_seqs
            if all(s.seq_id in group.beam_tops for s in live):
                self._beam_step(group, live)

    def _beam_step(self, group: SequenceGroup, live: list[Sequence]) -> None:
        """Every live beam has reported: choose the next beams. Each new beam
        forks its parent (sharing all its blocks); the old beams are freed."""
        requests = self._requests
        beam = group.beam
        assert beam is not None
        tops = [group.beam_tops[s.seq_id] for s in live]
        group.beam_tops = {}
        if not any(tops):
            requests.stop_running(group)
            self._finisher.finish_group(group, FinishReason.ERROR,
                                        "beam search needs top logprobs, and the worker sent none")
            return
        running = [Hypothesis(s.token_ids[s.num_prompt_tokens:], s.cum_logprob) for s in live]
        choices = beam.step(running, tops)
        children: list[Sequence] = []
        for i, c in enumerate(choices):
            parent = live[c.parent]
            child = Sequence(requests.new_seq_id(), i, parent.token_ids + [c.token_id], parent.num_prompt_tokens,
                             len(parent.token_ids), status=SeqStatus.RUNNING, cum_logprob=c.cum_logprob)
            requests.track(group, child)
            self._carry.owe_fork(bm.Fork(parent.seq_id, child.seq_id))
            children.append(child)
        for s in live:
            self._finisher.finish_seq(s, FinishReason.STOP)  # frees its blocks after the forks above
            requests.untrack(s.seq_id)
        group.seqs = children
        if beam.done:
            for i, hyp in enumerate(beam.results(max(1, group.params.n))):
                reason = FinishReason.STOP if hyp.token_ids and hyp.token_ids[-1] in self._cfg.eos_token_ids \
                    else FinishReason.LENGTH
                self._finisher.emit(TokenDelta(group.request_id, i, hyp.token_ids, reason,
                                               live[0].num_prompt_tokens, replace=True,
                                               cumulative_logprob=hyp.score, num_preemptions=group.num_preemptions))
            requests.stop_running(group)
            requests.forget(group)

    def fail(self, plan: StepPlan, message: str) -> None:
        """The worker failed the landed plan's step: fail the requests it held."""
        requests = self._requests
        # A group aborted while the step ran (async scheduling) is gone already.
        hit = {g.request_id for s, _ in plan.scheduled.values() if (g := requests.group_of(s.seq_id)) is not None}
        for rid in hit:
            group = requests.groups[rid]
            # Normally running; a protocol error (a sequence the worker does not
            # hold) can name a group elsewhere, and failing it must not crash the loop.
            requests.unqueue(group)
            self._finisher.finish_group(group, FinishReason.ERROR, message)

    def _stop_reason(self, group: SequenceGroup, seq: Sequence, tok: int) -> FinishReason | None:
        p = group.params
        if seq.num_output_tokens >= p.min_tokens:
            if tok in self._cfg.eos_token_ids and not p.ignore_eos:
                return FinishReason.STOP
            if tok in p.stop_token_ids:
                return FinishReason.STOP
        if group.long_enough(seq, self._cfg.max_model_len):  # num_pending is 0 once the token is in
            return FinishReason.LENGTH
        return None
