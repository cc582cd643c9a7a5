"""A/B of two builds of the CPU kernel library on a whole decode step's linears, in one process,
interleaved rep by rep (the VM's read rate drifts 45-70 GB/s within seconds, so only ratios
within one run count). Outputs of the two builds are checked equal.

    python scripts/experiments/linear_prefetch_ab.py ROWS OLD.so NEW.so [--kind panels|quant]
        [--shape 1b|smol] [--qtype Q8_0] [--reps 9]

ROWS: comma list of M. panels: the bf16 packed linears (cpu_linear.cpp); quant: a GGUF type's
blocks (quant_cpu.cpp), bf16 activations. Prints each build's median ms and the median of the
per-rep ratios (old / new: above 1, the new build is faster)."""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from pagedserve.kernels import cpu_build, cpu_ops
from pagedserve.kernels.quant import prepare, quant_linear
from pagedserve.kernels.quant_bench import LAYERS, SHAPES, random_weight


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("libs", nargs=2)
    ap.add_argument("--kind", choices=("panels", "quant"), default="panels")
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--qtype", default="Q8_0")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    libs = {}
    for path in a.libs:
        lib = ctypes.CDLL(path)
        for name, args in cpu_build.SIGNATURES.items():
            if (f := getattr(lib, name, None)) is not None:
                f.argtypes, f.restype = args, ctypes.c_int
        libs[path] = lib
    rows = [int(r) for r in a.rows.split(",")]
    layers = [(n, k) for label, n, k in SHAPES[a.shape] if label != "lm_head"] * LAYERS[a.shape]
    layers.append(next((n, k) for label, n, k in SHAPES[a.shape] if label == "lm_head"))
    torch.manual_seed(0)
    xs = {m: {k: torch.randn(m, k).to(torch.bfloat16) for _, k in layers} for m in rows}
    if a.kind == "panels":
        pbs = [cpu_ops.pack_linear((torch.randn(n, k) * 0.02).to(torch.bfloat16)) for n, k in layers]

        def step(lib: ctypes.CDLL, m: int, i: int = -1) -> torch.Tensor:
            out = torch.empty(0)
            for (n, k), pb in ([(layers[i], pbs[i])] if i >= 0 else zip(layers, pbs)):
                out = torch.empty(m, n, dtype=torch.bfloat16)
                lib.pagedserve_linear(1, xs[m][k].data_ptr(), pb.data_ptr(), None, out.data_ptr(), m, n, k)
            return out
    else:
        ws = [prepare(random_weight(a.qtype, n, k, seed=i), keep_blocks=False) for i, (n, k) in enumerate(layers)]

        def step(lib: ctypes.CDLL, m: int, i: int = -1) -> torch.Tensor:
            cpu_build.load = lambda: lib  # quant_linear calls the library load() returns
            out = torch.empty(0)
            for w in ([ws[i]] if i >= 0 else ws):
                out = quant_linear(xs[m][w.shape[1]], w)
            return out
    times: dict[tuple[int, str], list[float]] = {(m, p): [] for m in rows for p in libs}
    for rep in range(a.reps):
        for m in rows:
            for path, lib in (list(libs.items()) if rep % 2 == 0 else list(libs.items())[::-1]):
                t0 = time.perf_counter()
                step(lib, m)
                times[(m, path)].append(time.perf_counter() - t0)
    old, new = a.libs
    for m in rows:
        assert torch.equal(step(libs[old], m, 2), step(libs[new], m, 2)), f"outputs differ at M={m}"
        ratio = statistics.median(x / y for x, y in zip(times[(m, old)], times[(m, new)]))
        print(f"{a.kind} {a.qtype if a.kind == 'quant' else 'bf16'} {a.shape} M={m:3d}: "
              f"{statistics.median(times[(m, old)]) * 1e3:7.1f} / {statistics.median(times[(m, new)]) * 1e3:7.1f} ms, "
              f"{ratio:.2f}x ({os.path.basename(os.path.dirname(old))} / {os.path.basename(os.path.dirname(new))})",
              flush=True)


if __name__ == "__main__":
    main()
