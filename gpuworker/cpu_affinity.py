"""Pins the CPU worker's OpenMP threads one per core, before torch loads.

Unpinned, two compute threads on two cores collapse whenever anything else
runs: every parallel op waits at its barrier for a thread the kernel moved
onto a busy core (measured here: Alpaca-like at 64 requests, 28 tok/s
unpinned vs 141 with one thread; vLLM's CPU build pins for the same reason).
libgomp reads ``GOMP_CPU_AFFINITY`` when it is loaded, so this must run before
``import torch``; ``pagedserve.cli`` calls it for the gpuworker command.
No torch imports here.

``short_spin`` shortens how long those threads spin after a parallel region
before they sleep, for the same reason: it too is read when libgomp loads.
"""
from __future__ import annotations

import argparse
import os

from pagedserve.common.config import add_engine_args, env_flag, worker_threads  # no torch there

ENV = "WORKER_BIND"  # PAGEDSERVE_WORKER_BIND=0: leave thread placement to the OS


def bind_worker_threads(argv: list[str]) -> list[int]:
    """Sets GOMP_CPU_AFFINITY to the cores this process may use (one OpenMP
    thread each) for a single-rank CPU worker; returns them ([] if not bound)."""
    if not env_flag(ENV, True):
        return []
    if "GOMP_CPU_AFFINITY" in os.environ or "OMP_PROC_BIND" in os.environ or "OMP_PLACES" in os.environ:
        return []  # the deployment chose already
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    args, _ = p.parse_known_args(argv)  # the worker's own parser reports bad flags later
    if args.device != "cpu" or args.tensor_parallel_size != 1:
        return []  # GPU workers, or ranks that would pin onto the same cores
    cores = sorted(os.sched_getaffinity(0))
    threads = worker_threads()
    if threads:
        cores = cores[: max(1, threads)]
    os.environ["GOMP_CPU_AFFINITY"] = " ".join(map(str, cores))
    return cores


def bound_cores() -> list[int] | None:
    """The cores ``bind_worker_threads`` pinned this process's threads to (None:
    not pinned, or pinned by the deployment in a form other than a plain list)."""
    spec = os.environ.get("GOMP_CPU_AFFINITY", "")
    try:
        return [int(c) for c in spec.split()] or None
    except ValueError:
        return None


# libgomp's threads spin 300,000 rounds after a parallel region before they sleep. After a step's
# last region that spin holds the other core while the scheduler, the frontend and this process's
# ZeroMQ thread need it: one SmolLM2 Q8_0 stream over HTTP went from ~140-150 to ~180 tok/s with
# 10,000 (2-core VM, 2026-12-07), which still spans the gaps between one step's regions (sleeping
# there instead, OMP_WAIT_POLICY=PASSIVE, gave ~80).
SPIN_ROUNDS = "10000"


def short_spin() -> bool:
    """Sets GOMP_SPINCOUNT for the worker command (on CUDA it reaches only torch's host threads)
    unless the deployment chose a spin or wait policy."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS
    return True
