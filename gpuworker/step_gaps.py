"""How long the worker sits idle between two steps while work continues: the
time from one step's reply to the next step's arrival, which scheduling on the
critical path costs (gaps over ``busy_gap_s`` are idle time with no work, not
scheduling, and are left out).

With ``trace`` (PAGEDSERVE_STEP_TRACE=1), one line per step: its batch, wall
time and the process's CPU time (all threads). CPU time well above the quiet
figure, or wall time well above CPU time over threads, says the cores are
shared with other processes (docs/benchmarks.md, the guidellm start). Then the
step's context switches and page faults (getrusage): involuntary switches say
the kernel took a core away; voluntary ones and faults, that a thread waited.
Last, when the step ended (Unix time), to line steps up with a client's own
timestamps (a log reader can see the line much later on a busy machine)."""
from __future__ import annotations

import resource
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO


Counts = tuple[int, int, int]


def rusage_counts() -> Counts:
    """This process's (involuntary switches, voluntary switches, page faults) so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_nivcsw, r.ru_nvcsw, r.ru_minflt + r.ru_majflt


class StepGaps:
    def __init__(self, busy_gap_s: float = 0.5, keep: int = 8192, trace: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time,
                 counts: Callable[[], Counts] = rusage_counts, epoch: Callable[[], float] = time.time) -> None:
        self.busy_gap_s = busy_gap_s
        self.gaps: deque[float] = deque(maxlen=keep)
        self.busy_s = 0.0  # time inside steps
        self.trace = trace
        self._clock, self._cpu_clock, self._counts, self._epoch = clock, cpu_clock, counts, epoch
        self._last_end: float | None = None
        self._start = self._cpu_start = 0.0
        self._counts_start: Counts = (0, 0, 0)

    def begin(self) -> None:
        self._start = self._clock()
        if self.trace is not None:
            self._cpu_start = self._cpu_clock()
            self._counts_start = self._counts()
        if self._last_end is not None and (gap := self._start - self._last_end) < self.busy_gap_s:
            self.gaps.append(gap)

    def end(self, num_seqs: int = 0, num_tokens: int = 0) -> None:
        self._last_end = self._clock()
        wall = self._last_end - self._start
        self.busy_s += wall
        if self.trace is not None:
            cpu = self._cpu_clock() - self._cpu_start
            inv, vol, faults = (b - a for a, b in zip(self._counts_start, self._counts()))
            print(f"pagedserve gpuworker: step of {num_seqs} seqs, {num_tokens} tokens: "
                  f"wall {wall * 1000:.1f} ms, cpu {cpu * 1000:.1f} ms; preempted {inv}, waited {vol}, "
                  f"faults {faults}; ended {self._epoch():.3f}", file=self.trace, flush=True)

    def summary(self) -> str:
        if not self.gaps:
            return "no consecutive steps"
        g = sorted(self.gaps)
        pct = lambda q: g[min(len(g) - 1, int(q * len(g)))] * 1000  # noqa: E731
        return (f"idle between consecutive steps: p50 {pct(0.5):.2f} ms, p99 {pct(0.99):.2f} ms, "
                f"{sum(g) / (sum(g) + self.busy_s) * 100:.1f} % of busy time, over {len(g)} gaps")
