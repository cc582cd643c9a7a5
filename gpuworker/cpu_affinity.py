"""Pins the CPU worker's OpenMP threads one per core, before torch loads.

Unpinned, two compute threads on two cores collapse whenever anything else
runs: every parallel op waits at its barrier for a thread the kernel moved
onto a busy core (measured here: Alpaca-like at 64 requests, 28 tok/s
unpinned vs 141 with one thread; vLLM's CPU build pins for the same reason).
libgomp reads ``GOMP_CPU_AFFINITY`` when it is loaded, so this must run before
``import torch``; ``pagedserve.cli`` calls it for the gpuworker command.
No torch imports here.
"""
from __future__ import annotations

import os

DISABLE_ENV = "PAGEDSERVE_WORKER_BIND"  # "0": leave thread placement to the OS


def _flag(argv: list[str], names: tuple[str, ...], env: str, default: str) -> str:
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(tuple(n + "=" for n in names)):
            return a.split("=", 1)[1]
    return os.environ.get(env) or default


def bind_worker_threads(argv: list[str]) -> list[int]:
    """Sets GOMP_CPU_AFFINITY to the cores this process may use (one OpenMP
    thread each) for a single-rank CPU worker; returns them ([] if not bound)."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return []
    if "GOMP_CPU_AFFINITY" in os.environ or "OMP_PROC_BIND" in os.environ or "OMP_PLACES" in os.environ:
        return []  # the deployment chose already
    if _flag(argv, ("--device",), "PAGEDSERVE_DEVICE", "cpu") != "cpu":
        return []
    if _flag(argv, ("--tensor-parallel-size", "-tp"), "PAGEDSERVE_TENSOR_PARALLEL_SIZE", "1") != "1":
        return []  # ranks would pin onto the same cores
    cores = sorted(os.sched_getaffinity(0))
    threads = os.environ.get("PAGEDSERVE_WORKER_THREADS")
    if threads:
        cores = cores[: max(1, int(threads))]
    os.environ["GOMP_CPU_AFFINITY"] = " ".join(map(str, cores))
    return cores
