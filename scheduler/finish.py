"""Ending sequences and requests, and the deltas the frontend is owed.

``Finisher`` owns the outbox: every ``TokenDelta`` the scheduler produces
(sampled tokens, finishes, errors, aborts) waits here until the engine takes
it. Finishing a sequence owes the blockmgr its blocks (``StepCarry.owe_free``)
and the worker a drop (``StepCarry.owe_drop``); finishing a request ends its
open sequences with one delta each and forgets the request. The caller takes
the group out of its queue first (``Requests``)."""
from __future__ import annotations

from pagedserve.common.messages.frontend import ErrorKind, TokenDelta
from pagedserve.scheduler.carry import StepCarry
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.requests import Requests
from pagedserve.scheduler.sequence import FinishReason, Sequence, SequenceGroup, SeqStatus


class Finisher:
    def __init__(self, cfg: SchedulerConfig, requests: Requests, carry: StepCarry) -> None:
        self._cfg = cfg
        self._requests = requests
        self._carry = carry
        self._deltas: list[TokenDelta] = []

    def emit(self, delta: TokenDelta) -> None:
        self._deltas.append(delta)

    def take(self) -> list[TokenDelta]:
        out, self._deltas = self._deltas, []
        return out

    def put_back(self, deltas: list[TokenDelta]) -> None:
        """Deltas taken but not delivered: the next ``take`` returns them first."""
        self._deltas[:0] = deltas

    def finish_seq(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status in (SeqStatus.RUNNING, SeqStatus.SWAPPED):
            running = seq.status is SeqStatus.RUNNING
            self._carry.owe_free(seq.seq_id, self._cfg.table_blocks(seq.num_blocks) if running else 0)
        if seq.known_to_worker:
            self._carry.owe_drop(seq.seq_id)
            seq.known_to_worker = False
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.num_blocks = 0

    def finish_group(self, group: SequenceGroup, reason: FinishReason, error: str | None = None,
                     kind: ErrorKind = ErrorKind.INTERNAL) -> None:
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish_seq(seq, reason)
                self._deltas.append(TokenDelta(group.request_id, seq.index, [], reason,
                                               seq.num_prompt_tokens, error, error_kind=kind))
        self._requests.forget(group)
