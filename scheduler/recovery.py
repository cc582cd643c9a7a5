"""Recovery by recompute (issue 11): when the gpuworker or the blockmgr lost
its state (killed and restarted, by the ``serve`` launcher or by compose),
the scheduler re-initialises both, and every request resumes by recomputing
its prompt plus the tokens generated so far, exactly as a recompute
preemption does. Only tokens the worker samples after that are emitted, so
a stream sees no duplicate and no gap; seeded sampling draws the same tokens
(the sampler's randomness is a function of (seed, position)).
"""
from __future__ import annotations

from collections import deque

from pagedserve.scheduler.core import Scheduler
from pagedserve.scheduler.sequence import SeqStatus


def requeue_all(sch: Scheduler) -> int:
    """Moves every running and swapped group back to waiting with no K/V and
    no blocks. The components were reset, so no frees or drops are owed, and
    a step in flight is forgotten (its result never came, so none of its
    tokens were emitted). Returns how many groups were in flight."""
    in_flight = [*sch.running, *sch.swapped]
    groups = sorted([*sch.waiting, *in_flight], key=lambda g: g.arrival_order)
    sch.running, sch.swapped = [], []
    for group in groups:
        group.beam_tops = {}  # a half-reported beam step is sampled again
        for s in group.live_seqs:
            s.status = SeqStatus.WAITING
            s.num_computed_tokens = 0
            s.num_blocks = 0
            s.num_pending, s.num_unknown_slots = 0, 0
            s.known_to_worker = False
    # The restarted worker compiled nothing: constrained requests wait for their grammar again.
    sch.grammars.reset()
    sch.waiting = deque(g for g in groups if sch.grammars.admit(g))
    # Beam forks name parents the reset blockmgr no longer has: each new beam
    # is prefilled from its own tokens instead.
    sch._pending_forks, sch._pending_frees, sch._pending_drops = [], {}, []
    sch.block_stats = None
    return len(in_flight)
