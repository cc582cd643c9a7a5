"""``pagedserve bench pod-resources``: each component's peak memory and CPU
under a short mixed load, at two ``--kv-cache-memory`` sizes, so the
Kubernetes manifests' requests and limits come from a measurement
(deploy/k8s/, tests/test_k8s_manifests.py reads the result).

The worker's memory grows with the KV pool; what it needs besides the pool
(weights, kernels, buffers) is its peak minus the pool at each size, and
the larger of the two is kept. The other three do not depend on the pool.

    python -m pagedserve bench pod-resources [--kv 256MiB,1GiB] [--out docs/results/pod-resources.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pagedserve.bench.serve_proc import start_serve
from pagedserve.client import GenerationClient
from pagedserve.common.config import parse_size

_PIDS = re.compile(r"\(pids (.*)\)")
PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def _rss_peak(pid: int) -> int:
    """VmHWM: the process's peak resident set, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _load(addr: str, n: int) -> None:
    """n concurrent streams of mixed lengths, as a chat load would send."""
    def one(i: int) -> None:
        with GenerationClient(addr) as c:
            c.generate("Tell me about the history of paged memory. " * (1 + i % 8), max_tokens=32 + 8 * (i % 5),
                       temperature=0.0, ignore_eos=True, timeout=600)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(kv: str, requests: int, model: str | None) -> dict[str, Any]:
    sp = start_serve(["--kv-cache-memory", kv, "--max-num-seqs", "16"], model=model)
    try:
        line = next(line for line in sp.log if "pagedserve: serving" in line)
        m = _PIDS.search(line)
        assert m is not None, line
        pids = {k: int(v) for k, v in (p.split("=") for p in m.group(1).split(", "))}
        cpu0 = {k: _cpu_s(p) for k, p in pids.items()}
        t0 = time.monotonic()
        _load(sp.grpc_addr, requests)
        wall = time.monotonic() - t0
        comps = {k: {"peak_rss_bytes": _rss_peak(p), "cpu_seconds": round(_cpu_s(p) - cpu0[k], 2)}
                 for k, p in pids.items()}
    finally:
        sp.stop()
    return {"kv_cache_memory_bytes": parse_size(kv), "load_wall_s": round(wall, 2), "components": comps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench pod-resources", description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", default="256MiB,1GiB", help="two or more --kv-cache-memory sizes, comma-separated")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--model", default=None, help="none: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", default="docs/results/pod-resources.json")
    args = p.parse_args(argv)
    runs = [measure(kv, args.requests, args.model) for kv in args.kv.split(",")]
    worker_base = max(r["components"]["gpuworker"]["peak_rss_bytes"] - r["kv_cache_memory_bytes"] for r in runs)
    peaks = {name: max(r["components"][name]["peak_rss_bytes"] for r in runs)
             for name in ("frontend", "scheduler", "blockmgr")}
    result = {
        "what": "peak RSS (VmHWM) and CPU seconds per component under a mixed load, pagedserve serve",
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": args.model or "embedded SmolLM2-135M-Instruct (float32)",
        "runs": runs,
        "derived": {"gpuworker_bytes_besides_kv_pool": worker_base, "peak_rss_bytes": peaks},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in runs:
        print(f"kv {r['kv_cache_memory_bytes'] / 2**20:.0f} MiB: " + ", ".join(
            f"{k} {v['peak_rss_bytes'] / 2**20:.0f} MiB / {v['cpu_seconds']} cpu-s" for k, v in r["components"].items()))
    print(f"worker besides its KV pool: {worker_base / 2**20:.0f} MiB -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
