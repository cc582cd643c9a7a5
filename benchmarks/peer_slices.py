"""Time-sliced rounds for ``bench peers --slice S``: every engine runs the workload at
once, but only one holds the machine at a time.

This VM's memory read rate is not one number: a 2-thread read loop held ~50 GB/s for
48 s, then ~87 GB/s for 10 s, then ~50 again (2026-12-07). A decode step of a few rows
is bound by that rate, so two engines measured one after the other, each for a ~20 s
round, can meet different rates, and a round's ratio moved 1.04-1.23x between rounds.
Here each engine in turn runs for ``S`` seconds while the others are SIGSTOPped, until
all have finished; an engine's time is the sum of its own slices up to its last token.
With slices much shorter than the rate's phases, every engine meets the same mix.
pagedserve's worker then runs with its thread governor off (PAGEDSERVE_WORKER_ADAPTIVE=0):
a step stopped midway has a low CPU time over wall time, which the governor reads as
another process on its cores (one run with it on: 70 of 342 steps on one thread).

With ``--roofline`` a read-rate probe (``python -m benchmarks roofline --probe``: a 1B decode
step of bf16 panels at one row, over and over) takes a slice of its own in each turn, so the
rate it reads is the mix the engines met, and each round gets its least time (roofline.py's
bound at that rate and torch's bf16 peak): how close an engine came, and how far any could go.
Slicing is not free, and not equally: on a Zen 4 VM (2026-12-07) vLLM's sliced 1B rounds ran
5-22 % over its whole ones, ours 0-13 %, so report whole rounds beside sliced ones.
"""
from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import threading
import time

from benchmarks.peer_engines import Engine, RunResult, engine_pids, signal_all


class ReadProbe:
    """The probe process and its samples, read by a thread as they come; stopped between slices."""

    def __init__(self, shape: str = "1b") -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks", "roofline", "--probe", shape],
                                     stdout=subprocess.PIPE, text=True)
        first = self.proc.stdout.readline() if self.proc.stdout else ""  # measured before any round runs
        if not first:
            raise RuntimeError("the read-rate probe did not start")
        self.peak_gflop_s: float = json.loads(first)["peak_gflop_s"]
        self.samples: list[tuple[float, int, float]] = []  # (seconds, bytes, Unix end time)
        self.pids = [self.proc.pid]
        self._first_sample = threading.Event()  # its panels packed: only then is it stopped
        threading.Thread(target=self._read, daemon=True).start()
        if not self._first_sample.wait(300) or not self.samples:  # set at the end of its output too
            self.close()
            raise RuntimeError("the read-rate probe took no sample (see its stderr)")
        signal_all(self.pids, signal.SIGSTOP)

    def _read(self) -> None:
        for line in self.proc.stdout or []:
            d = json.loads(line)
            self.samples.append((d["s"], d["bytes"], d["end"]))
            self._first_sample.set()
        self._first_sample.set()  # it ended: no waiting for a sample that will not come

    def sample(self, seconds: float) -> None:
        """Run alone for ``seconds`` (the caller has paused the engines)."""
        signal_all(self.pids, signal.SIGCONT)
        time.sleep(seconds)
        signal_all(self.pids, signal.SIGSTOP)

    def rate_since(self, i: int) -> float:
        """GB/s over the samples from index ``i``, leaving out those a stop cut through (> 3x the median)."""
        time.sleep(0.2)  # the last sample through the pipe
        got = self.samples[i:]
        if not got:
            raise RuntimeError("the read-rate probe took no sample in its time")
        cut = 3 * statistics.median(s for s, _, _ in got)
        kept = [(s, b) for s, b, _ in got if s <= cut]
        return sum(b for _, b in kept) / sum(s for s, _ in kept) / 1e9

    def close(self) -> None:
        signal_all(self.pids, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


def sliced_round(engines: dict[str, Engine], order: list[str], workload: str, slice_s: float,
                 probe: ReadProbe | None = None) -> dict[str, tuple[RunResult, float]]:
    """Each engine's run of ``workload`` and its seconds on the machine; ``order``: who goes first;
    ``probe``: a slice of its own after each turn of the engines."""
    trees = {e: engine_pids(engines[e]) for e in order}  # once: walking /proc costs ms a slice
    for e in order:
        signal_all(trees[e], signal.SIGSTOP)
    results: dict[str, RunResult] = {}
    errors: dict[str, BaseException] = {}

    def run(e: str) -> None:
        try:
            results[e] = engines[e].run(workload)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[e] = exc

    threads = {e: threading.Thread(target=run, args=(e,), daemon=True) for e in order}
    for t in threads.values():
        t.start()  # the clients submit; the stopped servers take the requests when they run
    active = dict.fromkeys(order, 0.0)
    try:
        while any(t.is_alive() for t in threads.values()):
            for e in order:
                if not threads[e].is_alive():
                    continue
                signal_all(trees[e], signal.SIGCONT)
                t0 = time.perf_counter()
                threads[e].join(slice_s)
                active[e] += time.perf_counter() - t0
                signal_all(trees[e], signal.SIGSTOP)
            if probe is not None and any(t.is_alive() for t in threads.values()):
                probe.sample(slice_s)
    finally:
        for e in order:
            signal_all(trees[e], signal.SIGCONT)
    if errors:
        raise next(iter(errors.values()))
    return {e: (results[e], active[e]) for e in order}
