"""Every live request of the scheduler: its ``SequenceGroup`` by request id,
each sequence by seq id, and which queue the group is in (waiting, running,
swapped; a group waiting for its grammar is in ``GrammarGate`` instead).

``Requests`` is the one writer of these maps and queues; the other parts of
the scheduler read them and move groups only through its methods. Every
queue keeps arrival order (FCFS; preemption takes the latest arrivals)."""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from pagedserve.scheduler.sequence import Sequence, SequenceGroup


class Requests:
    def __init__(self) -> None:
        self.groups: dict[str, SequenceGroup] = {}
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._seqs: dict[int, Sequence] = {}
        self._group_of: dict[int, SequenceGroup] = {}
        self._seq_ids = itertools.count(1)
        self._arrivals = itertools.count()

    # ------------------------------------------------------------ ids and lookups
    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def next_arrival(self) -> int:
        return next(self._arrivals)

    def seq(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    def group_of(self, seq_id: int) -> SequenceGroup | None:
        return self._group_of.get(seq_id)

    def register(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group
        for s in group.seqs:
            self.track(group, s)

    def track(self, group: SequenceGroup, seq: Sequence) -> None:
        self._group_of[seq.seq_id] = group
        self._seqs[seq.seq_id] = seq

    def untrack(self, seq_id: int) -> None:
        self._group_of.pop(seq_id, None)
        self._seqs.pop(seq_id, None)

    def forget(self, group: SequenceGroup) -> None:
        self.groups.pop(group.request_id, None)
        for s in group.seqs:
            self.untrack(s.seq_id)

    # ------------------------------------------------------------ queues
    def enqueue(self, group: SequenceGroup) -> None:
        """A new arrival: the tail of the waiting queue."""
        self.waiting.append(group)

    def requeue(self, group: SequenceGroup) -> None:
        """Back to waiting (recompute), ahead of every later arrival."""
        self.waiting.append(group)
        self.waiting = deque(sorted(self.waiting, key=lambda g: g.arrival_order))

    def merge_waiting(self, groups: Iterable[SequenceGroup]) -> None:
        """Groups whose grammar is ready join the waiting queue in arrival order."""
        self.waiting = deque(sorted([*self.waiting, *groups], key=lambda g: g.arrival_order))

    def swap_out(self, group: SequenceGroup) -> None:
        self.running.remove(group)
        self.swapped.append(group)
        self.swapped.sort(key=lambda g: g.arrival_order)

    def admit(self, group: SequenceGroup) -> bool:
        """Waiting or swapped -> running (``sort_running`` restores the order
        after a round of admissions); True if it came back from swap."""
        swapped = group in self.swapped
        (self.swapped if swapped else self.waiting).remove(group)
        self.running.append(group)
        return swapped

    def sort_running(self) -> None:
        self.running.sort(key=lambda g: g.arrival_order)

    def stop_running(self, group: SequenceGroup) -> None:
        self.running.remove(group)

    def unswap(self, group: SequenceGroup) -> None:
        self.swapped.remove(group)

    def pop_waiting_head(self) -> SequenceGroup:
        return self.waiting.popleft()

    def unqueue(self, group: SequenceGroup) -> bool:
        """Out of whichever queue holds it; False if none does."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
                return True
        return False

    def take_all(self) -> list[SequenceGroup]:
        """Empties the queues; every queued group, in arrival order (recovery)."""
        groups = sorted([*self.waiting, *self.running, *self.swapped], key=lambda g: g.arrival_order)
        self.waiting, self.running, self.swapped = deque(), [], []
        return groups
