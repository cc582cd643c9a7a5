"""One unpinned thread while other processes take the worker's cores.

The CPU worker runs one OpenMP thread per core, pinned. When another process
takes a core, every parallel region waits at its barrier for the thread whose
core is taken: beside busy loops one thread that the kernel may move is
1.2-1.5x faster, and on a quiet machine 1.7x slower (docs/benchmarks.md, the
guidellm section). Two signals say the cores are taken:

- the step's parallel efficiency: the process's CPU time over the step's wall
  time, about 1.8 of 2 threads when quiet; below ``min_efficiency`` of the
  threads, the barriers are waiting;
- between steps, the CPU time other processes used on the worker's cores
  (``/proc/stat`` minus our own): above ``busy_share`` of the cores (a load
  generator starting, a build), the next step already runs on one thread.
  The idle worker samples it too (``ThreadGovernor.idle``, every poll), so a
  step after a pause sees the last window's load, not the pause's average.

On one thread it goes back to every thread when the others use less than
``quiet_cores``, or tries every thread for one step after ``probe_s`` (doubled
after each failed try, up to ``max_probe_s``), keeping them if that step is
efficient. PAGEDSERVE_WORKER_ADAPTIVE=0 turns it off.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TextIO, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ContentionPolicy:
    full_threads: int
    min_efficiency: float = 0.65  # CPU time / wall time / threads of efficient steps, at least
    busy_share: float = 0.75  # share of the cores other processes used that means taken
    quiet_cores: float = 0.35  # cores the others use, below which every thread comes back
    window_s: float = 0.2  # the shortest span measured (the step wall time, or /proc/stat's 10 ms ticks)
    probe_s: float = 1.0
    max_probe_s: float = 8.0


class ContentionGovernor:
    """Pure: fed the load between steps and each step's times, says how many
    threads the next step runs."""

    def __init__(self, policy: ContentionPolicy) -> None:
        self.policy = policy
        self.threads = policy.full_threads
        self.others_cores = 0.0  # the last measured load of the other processes
        self.efficiency = 1.0  # of the last measured full-thread steps
        self._last: tuple[float, float, float] | None = None  # (at, busy, own) of the last load sample
        self._wall = self._cpu = 0.0  # full-thread steps not yet judged
        self._probe_at = 0.0
        self._probe_s = policy.probe_s
        self._probing = False

    def observe(self, at_s: float, busy_s: float, own_s: float) -> None:
        """Measures the others' load since the last sample (at most once a window):
        ``busy_s``, CPU time of all processes on the worker's cores; ``own_s``, ours."""
        p = self.policy
        last = self._last
        if last is None or at_s - last[0] >= p.window_s:
            self._last = (at_s, busy_s, own_s)
            if last is not None:
                self.others_cores = max(0.0, (busy_s - last[1]) - (own_s - last[2])) / (at_s - last[0])
                if self.others_cores > p.busy_share * p.full_threads:
                    self._down(at_s)
                elif self.threads == 1 and self.others_cores < p.quiet_cores:
                    self._up()

    def before_step(self, at_s: float, busy_s: float, own_s: float) -> int:
        """The threads the next step runs, after a load sample (``observe``)."""
        self.observe(at_s, busy_s, own_s)
        if self.threads == 1 and at_s >= self._probe_at:
            self.threads, self._probing = self.policy.full_threads, True
        return self.threads

    def after_step(self, at_s: float, wall_s: float, cpu_s: float) -> None:
        if self.threads == 1:
            return
        self._wall += wall_s
        self._cpu += cpu_s
        if self._wall <= 0.0 or (self._wall < self.policy.window_s and not self._probing):
            return
        self.efficiency = self._cpu / self._wall / self.threads
        self._wall = self._cpu = 0.0
        if self.efficiency < self.policy.min_efficiency:
            if self._probing:  # still taken: wait longer before the next try
                self._probe_s = min(self.policy.max_probe_s, self._probe_s * 2)
            self._down(at_s)
        elif self._probing:
            self._up()

    def _down(self, at_s: float) -> None:
        self.threads, self._probing = 1, False
        self._wall = self._cpu = 0.0
        self._probe_at = at_s + self._probe_s

    def _up(self) -> None:
        self.threads, self._probing = self.policy.full_threads, False
        self._probe_s = self.policy.probe_s


BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq (not idle, iowait, steal)


def busy_seconds(proc_stat: str, cores: Iterable[int], tick_s: float) -> float:
    """CPU time spent busy on ``cores``, from /proc/stat's per-CPU lines."""
    want = {f"cpu{c}" for c in cores}
    total = 0
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if name in want:
            fields = rest.split()
            total += sum(int(fields[i]) for i in BUSY_FIELDS)
    return total * tick_s


def _proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


class ThreadGovernor:
    """The governor on this process: reads the counters, and switches torch's
    threads and the calling thread's cores (the OpenMP master; the pool's
    other threads stay pinned, idle while one thread runs)."""

    def __init__(self, cores: set[int], set_threads: Callable[[int], None],
                 read_stat: Callable[[], str] = _proc_stat, clock: Callable[[], float] = time.monotonic,
                 own_cpu: Callable[[], float] = time.process_time, log: TextIO | None = None,
                 policy: ContentionPolicy | None = None) -> None:
        self.cores = cores
        self.pinned = os.sched_getaffinity(0)  # the master's own core, as libgomp bound it
        self._set_threads, self._read_stat, self._clock, self._own_cpu = set_threads, read_stat, clock, own_cpu
        self._tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
        self.governor = ContentionGovernor(policy or ContentionPolicy(full_threads=len(cores)))
        self.threads = len(cores)  # what torch runs now
        self.log = log  # a line per switch (with the step trace)
        self.switches = 0
        self.steps_single = 0  # steps run on one thread
        self._began = self._cpu0 = 0.0

    def run(self, step: Callable[[], T]) -> T:
        """``step()`` on the threads the governor chose, its times measured."""
        self.before_step()
        try:
            return step()
        finally:
            self.after_step()

    def idle(self) -> None:
        """Between steps with nothing to run: a load sample, so that the first step
        after a pause is judged by the load just before it, not by the whole pause
        (a load generator that starts while the worker waits, guidellm's first request)."""
        self.governor.observe(self._clock(), busy_seconds(self._read_stat(), self.cores, self._tick_s), self._own_cpu())

    def before_step(self) -> None:
        now, own = self._clock(), self._own_cpu()
        want = self.governor.before_step(now, busy_seconds(self._read_stat(), self.cores, self._tick_s), own)
        if want != self.threads:
            self._switch(want)
        self.steps_single += want == 1
        self._began, self._cpu0 = now, own

    def after_step(self) -> None:
        now = self._clock()
        self.governor.after_step(now, now - self._began, self._own_cpu() - self._cpu0)

    def _switch(self, n: int) -> None:
        g = self.governor
        if self.log is not None:
            print(f"pagedserve gpuworker: {self.threads} -> {n} threads (others used {g.others_cores:.2f} cores, "
                  f"efficiency {g.efficiency:.2f})", file=self.log, flush=True)
        self._set_threads(n)
        os.sched_setaffinity(0, self.cores if n == 1 else self.pinned)
        self.threads = n
        self.switches += 1

    def summary(self) -> str:
        return (f"contention: {self.steps_single} steps on one unpinned thread, {self.switches} switches "
                f"(master pinned to {sorted(self.pinned)})")
