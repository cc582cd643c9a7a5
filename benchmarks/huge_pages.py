"""``python -m benchmarks huge-pages``: a decode step's linears read from 2 MiB pages
(``kernels/cpu_memory.py``) against the same weights in 4 KiB pages, in one process.

Every weight of a shape's step (its layers' qkv, o, gate_up and down, and the LM head)
is packed twice, once inside ``cpu_memory.small_pages()``; then each repeat times the
whole step from one copy and from the other, in alternating order, so the machine's
drifting read rate (this VM's moves between ~50 and ~87 GB/s within seconds) meets
both alike. Reported per row count: the median of the paired ratios (small / huge)
with its quartiles, and each copy's median time.

    python -m benchmarks huge-pages [--shape 1b] [--rows 1,4,8,16,32] [--kind bf16,Q8_0] [--repeats 25]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.bench.workloads import machine_info
from pagedserve.kernels import cpu_memory, cpu_ops
from pagedserve.kernels.quant import QuantWeight, prepare, quant_linear
from pagedserve.kernels.quant_bench import LAYERS, SHAPES, random_weight


def anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))


def packed_step(shape: str, kind: str, huge: bool) -> Callable[[dict[int, torch.Tensor]], None]:
    """The step's linears over weights packed with huge pages on or off; call with {K: x}."""
    with contextlib.nullcontext() if huge else cpu_memory.small_pages():
        layers = [(n, k) for _, n, k in SHAPES[shape][:-1]] * LAYERS[shape] + [SHAPES[shape][-1][1:]]
        if kind == "bf16":
            panels = [cpu_ops.pack_linear(torch.randn(n, k).to(torch.bfloat16)) for n, k in layers]
            return lambda xs: [cpu_ops.packed_linear(xs[k], p, n, None) for (n, k), p in zip(layers, panels)]
        blocks = {(n, k): random_weight(kind, n, k).data for n, k in set(layers)}  # quantized once per shape
        weights = [prepare(QuantWeight(blocks[n, k], kind, (n, k)), keep_blocks=False) for n, k in layers]
        return lambda xs: [quant_linear(xs[w.shape[1]], w) for w in weights]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks huge-pages", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,4,8,16,32")
    p.add_argument("--kind", default="bf16,Q8_0", help="bf16 (panels) and/or GGUF types")
    p.add_argument("--repeats", type=int, default=25)
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    out: dict[str, Any] = {"bench": "huge-pages", "machine": machine_info(), "thp": cpu_memory.thp_mode(),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": args.shape,
                           "repeats": args.repeats, "results": {}}
    for kind in args.kind.split(","):
        steps = {False: packed_step(args.shape, kind, False)}
        before = anon_huge_kb()
        steps[True] = packed_step(args.shape, kind, True)
        out["results"][kind] = res = {"huge_copy_in_huge_pages_mib": (anon_huge_kb() - before) // 1024}
        for m in rows:
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, _, k in SHAPES[args.shape]}}  # as the 1B serves
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(args.repeats + 1):
                for huge in ((False, True) if i % 2 else (True, False)):
                    t0 = time.perf_counter()
                    steps[huge](xs)
                    if i:  # the first round warms up
                        times[huge].append(time.perf_counter() - t0)
            ratios = sorted(s / h for s, h in zip(times[False], times[True]))
            q = len(ratios) // 4
            res[m] = {"small_ms": 1e3 * statistics.median(times[False]), "huge_ms": 1e3 * statistics.median(times[True]),
                      "ratio": statistics.median(ratios), "q1": ratios[q], "q3": ratios[-1 - q]}
            print(f"{kind} M={m:3d}: 4 KiB {res[m]['small_ms']:6.1f} ms, 2 MiB {res[m]['huge_ms']:6.1f} ms, paired "
                  f"{res[m]['ratio']:.3f}x (quartiles {res[m]['q1']:.3f}-{res[m]['q3']:.3f})", file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
