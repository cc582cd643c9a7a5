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
"""
from __future__ import annotations

import signal
import threading
import time

from benchmarks.peer_engines import Engine, RunResult, engine_pids, signal_all


def sliced_round(engines: dict[str, Engine], order: list[str], workload: str,
                 slice_s: float) -> dict[str, tuple[RunResult, float]]:
    """Each engine's run of ``workload`` and its seconds on the machine; ``order``: who goes first."""
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
    finally:
        for e in order:
            signal_all(trees[e], signal.SIGCONT)
    if errors:
        raise next(iter(errors.values()))
    return {e: (results[e], active[e]) for e in order}
