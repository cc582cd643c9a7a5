"""Sequences and sequence groups, the scheduler's unit of work.

A request becomes a ``SequenceGroup``: its prompt is prefilled once, and with
``n > 1`` (or beam search) the group holds several sequences that share the
prompt's blocks. Preemption and FCFS order act on whole groups.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.common.messages.frontend import FinishReason  # noqa: F401 - the scheduler's name for it
from pagedserve.common.messages.types import SamplingParams
from pagedserve.scheduler.beam import BeamSearch


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    index: int  # position among the group's outputs
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    num_computed_tokens: int = 0  # tokens whose K/V is in the pool
    # Length of its GPU block table. The table itself is the blockmgr's; the
    # scheduler relays its diffs to the worker and keeps only this count.
    num_blocks: int = 0
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    known_to_worker: bool = False
    cum_logprob: float = 0.0  # beam search: sum of the chosen tokens' logprobs
    # Async scheduling: the step in flight samples this many tokens for it (0
    # or 1; not in token_ids yet), and this many of its blockmgr slots wait
    # for their token ids (Append.num_lookahead).
    num_pending: int = 0
    num_unknown_slots: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class SequenceGroup:
    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival_time: float
    arrival_order: int  # ties broken by submission order
    cache_salt: str | None = None
    num_preemptions: int = 0
    # Parallel sampling: the prompt (minus its last token) is prefilled once by
    # the first sequence, then the others fork from it and share its blocks.
    needs_fork: bool = False
    beam: BeamSearch | None = None
    beam_tops: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # this step's reports
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprob_ranks: list[int] = field(default_factory=list)  # per entry; empty from an older worker
    prompt_logprobs_sent: bool = False
    queue_time_s: float | None = None  # set at first admission
    queue_time_sent: bool = False
    num_cached_tokens: int = 0  # prompt tokens the first admission found in the prefix cache

    def tokens_to_compute(self, seq: Sequence) -> int:
        """Tokens the sequence still has to compute before it can sample
        (before the fork, the first sequence stops short of the last prompt token)."""
        end = len(seq.token_ids) + seq.num_pending - (1 if self.needs_fork else 0)
        return end - seq.num_computed_tokens

    def long_enough(self, seq: Sequence, max_model_len: int) -> bool:
        """Its tokens, counting one still being sampled, reach max_tokens or the
        model's length: it stops by length (after that pending token, if any)."""
        n = len(seq.token_ids) + seq.num_pending
        return n - seq.num_prompt_tokens >= self.params.max_tokens or n >= max_model_len

    @property
    def batch_width(self) -> int:
        """Sequences the group takes in a batch (what max_num_seqs counts)."""
        if self.needs_fork:
            return self.params.n
        return max(len(self.live_seqs), self.params.beam_width if self.beam else 1)

    @property
    def live_seqs(self) -> list[Sequence]:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, on the hot path: no new list
            return seqs if seqs[0].status is not SeqStatus.FINISHED else []
        return [s for s in seqs if s.status is not SeqStatus.FINISHED]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
