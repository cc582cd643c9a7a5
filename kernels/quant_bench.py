"""Times ``quant_linear`` against torch's and the panels' matmuls on the dequantized weight.

    python -m pagedserve.kernels.quant_bench [--types Q8_0,Q4_1] [--rows 1,8,64] [--shapes smol,1b]

Per shape, type and rows M: microseconds, GFLOP/s (2 M N K per call) and GB/s
of weight bytes read (the quantized blocks; the bf16 / fp32 weight for the
baselines), all in one process: the best and the median of interleaved
repeats, so ratios hold on a noisy machine better than the absolute figures do.
Each variant cycles through copies of its weight that together exceed the
L3 cache (48 MB), so the weight comes from memory as in a decode step, not
from the cache the previous call left warm.

``--clock thread`` times by the calling thread's CPU time instead of the wall
clock: with ``OMP_NUM_THREADS=1`` (everything on that thread) it gives per-core
figures that other processes on a busy machine barely disturb.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_ops, quant_cpu
from pagedserve.kernels.quant import GGML_QUANT_TYPES, QuantWeight, dequantize, prepare, quant_linear

SHAPES = {  # name: [(label, out_features, in_features)]
    "smol": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
             ("lm_head", 49152, 576)],
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
           ("lm_head", 49152, 2048)],
}


def random_weight(qtype: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    """Random valid blocks: the quantized normal weights where gguf-py quantizes the type,
    else random bytes with small positive fp16 scales."""
    import numpy as np
    import gguf

    rng = np.random.default_rng(seed)
    qt = GGML_QUANT_TYPES[qtype]
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        raw = gguf.quants.quantize(rng.standard_normal((n, k), dtype=np.float32) * 0.02, t)
    else:
        raw = rng.integers(0, 256, (n, k // qt.block_size, qt.type_size), dtype=np.uint8)
        for off in {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype]:
            scales = rng.uniform(1e-4, 1e-3, raw.shape[:2]).astype(np.float16)
            raw[..., off:off + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(n, -1)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (n, k))


COLD_BYTES = 48 << 20  # more than the L3 cache


def _copies(nbytes: int) -> int:
    return max(1, -(-COLD_BYTES // max(nbytes, 1)))


CLOCK: Callable[[], float] = time.perf_counter


def _times_us(fns: dict[str, Callable[[int], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """(best, median) microseconds per variant; call i gets the argument i (its copy to use)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(0)  # warm up
    for i in range(1, repeats + 1):
        for j, (name, fn) in enumerate(fns.items()):  # interleaved, so drift hits every one alike
            t0 = CLOCK()
            fn(i * len(fns) + j)  # a copy the previous call did not touch (the quant variants share theirs)
            times[name].append(CLOCK() - t0)
    return {name: (min(ts) * 1e6, statistics.median(ts) * 1e6) for name, ts in times.items()}


def bench(qtype: str, label: str, n: int, k: int, rows: list[int], repeats: int) -> list[str]:
    w0 = prepare(random_weight(qtype, n, k))
    qbytes = w0.data.numel()
    ws = [w0] + [QuantWeight(w0.data, qtype, w0.shape, w0.packed.clone() if w0.packed is not None else None)
                 for _ in range(_copies(qbytes) - 1)]
    wf = dequantize(w0)
    wfs = [wf] + [wf.clone() for _ in range(_copies(wf.numel() * 4) - 1)]
    wbs = [wf.to(torch.bfloat16) for _ in range(_copies(wf.numel() * 2))]
    pbs = [cpu_ops.pack_linear(wb) for wb in wbs]
    lines = []
    for m in rows:
        x = torch.randn(m, k)
        xb = x.to(torch.bfloat16)
        fns: dict[str, Callable[[int], object]] = {
            "quant f32": lambda i: quant_linear(x, ws[i % len(ws)]),
            "quant bf16": lambda i: quant_linear(xb, ws[i % len(ws)]),
            "torch bf16": lambda i: F.linear(xb, wbs[i % len(wbs)]),
            "torch f32": lambda i: F.linear(x, wfs[i % len(wfs)]),
        }
        if pbs[0] is not None:
            fns["panels bf16"] = lambda i: cpu_ops.packed_linear(xb, pbs[i % len(pbs)], n, None)
        us = _times_us(fns, repeats)
        flop = 2.0 * m * n * k
        parts = []
        for name, (best, med) in us.items():
            nbytes = qbytes if name.startswith("quant") else n * k * (4 if name.endswith("f32") else 2)
            parts.append(f"{name} {best:7.0f} us (median {med:7.0f}) {flop / best / 1e3:6.1f} GF/s "
                         f"{nbytes / best / 1e3:5.1f} GB/s")
        lines.append(f"{qtype} {label:7s} {n:5d}x{k:<5d} M={m:<3d} | " + " | ".join(parts))
    return lines


def _at(rows: int, fn: Callable[[int], object]) -> Callable[[int], object]:
    """``fn`` with bf16 activations on the bf16 panels from ``rows`` rows up (1: a prompt step's
    path, ``quant_cpu.NEVER``: a decode step's int8 products), as the worker sets it per step."""
    def run(i: int) -> object:
        with quant_cpu.dequant_rows_at(rows):
            return fn(i)
    return run


LAYERS = {"smol": 30, "1b": 16}
PEAK_BAR = 0.6  # issue 40, acceptance 6: a decode step's linears at 60 % of torch's bf16 peak or more


def bf16_peak(repeats: int, size: int = 2048) -> float:
    """torch's own bf16 matmul at size^3 (issue 40's reference peak): best GFLOP/s of ``repeats``."""
    a, b = torch.randn(size, size).to(torch.bfloat16), torch.randn(size, size).to(torch.bfloat16)
    torch.mm(a, b)
    best = _times_us({"mm": lambda i: torch.mm(a, b)}, repeats)["mm"][0]
    return 2.0 * size ** 3 / best / 1e3


def step(shape: str, qtypes: list[str], rows: list[int], repeats: int, peak: float, prompt: bool = False) -> list[str]:
    """A whole decode step's linear layers (every layer's, then the LM head) at M rows: the
    weights of a real model size, so they stream from memory as in serving. Milliseconds per
    step, against the panels' bf16 (the CPU path's own) on the same dequantized weights, and
    each one's GFLOP/s as a share of ``peak`` (torch's bf16 matmul, measured in the same run).
    "quant" is a decode step's int8 products; "coded bf16" the panels with coded exponents
    (``cpu_coded.cpp``; the plain panels past ``coded_rows()`` rows); ``prompt`` adds "quant
    prompt", a prompt step's blocks decoded to bf16 panels (``quant_bf16.cpp``)."""
    layers = [(label, n, k) for label, n, k in SHAPES[shape] if label != "lm_head"] * LAYERS[shape]
    layers.append(next(s for s in SHAPES[shape] if s[0] == "lm_head"))
    lines = []
    for qtype in qtypes:
        ws = [prepare(random_weight(qtype, n, k, seed=i), keep_blocks=False) for i, (_, n, k) in enumerate(layers)]
        pbs = [cpu_ops.pack_linear(dequantize(w).to(torch.bfloat16)) for w in ws]
        cds = [cpu_ops.pack_coded(pb, n) for (_, n, _), pb in zip(layers, pbs)]  # None: no coded kernel here
        qbytes, cbytes = sum(w.nbytes for w in ws), sum(c.numel() for c in cds if c is not None)
        for m in rows:
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for _, _, k in layers}
            quant: Callable[[int], object] = lambda i: [quant_linear(xs[w.shape[1]], w) for w in ws]
            fns: dict[str, Callable[[int], object]] = {
                "quant": _at(quant_cpu.NEVER, quant),
                "panels bf16": lambda i: [cpu_ops.packed_linear(xs[k], pb, n, None)
                                          for (_, n, k), pb in zip(layers, pbs)],
                "coded bf16": lambda i: [cpu_ops.packed_linear(xs[k], pb, n, None, cd)
                                         for (_, n, k), pb, cd in zip(layers, pbs, cds)],
            }
            if prompt:
                fns["quant prompt"] = _at(1, quant)
            us = _times_us(fns, repeats)
            flop = 2.0 * m * sum(n * k for _, n, k in layers)
            read = {"quant": qbytes, "coded": cbytes if m <= cpu_ops.coded_rows() else flop / m}  # bytes a step reads
            parts = [f"{name} {best / 1e3:7.2f} ms (median {med / 1e3:7.2f}) {flop / best / 1e3:6.1f} GF/s "
                     f"= {flop / best / 1e3 / peak:4.0%} of peak "
                     f"({'meets' if flop / best / 1e3 >= PEAK_BAR * peak else 'under'} issue 40's {PEAK_BAR:.0%}), "
                     f"{read.get(name.split()[0], flop / m) / best / 1e3:5.1f} GB/s"
                     for name, (best, med) in us.items()]
            lines.append(f"{qtype} {shape} step ({len(layers)} linears) M={m:<3d} | " + " | ".join(parts))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q8_0,Q4_1,Q4_K,Q6_K")
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--shapes", default="smol,1b")
    ap.add_argument("--only", default="", help="comma-separated labels (qkv, o, gate_up, down, lm_head)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--step", action="store_true", help="time whole decode steps' linears instead")
    ap.add_argument("--prompt", action="store_true", help="with --step: also the prompt steps' path")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.thread_time if a.clock == "thread" else time.perf_counter
    print(f"torch threads {torch.get_num_threads()}, clock {a.clock}; best (median) of {a.repeats}", flush=True)
    rows = [int(r) for r in a.rows.split(",")]
    if a.step:
        peak = bf16_peak(a.repeats)
        print(f"peak: torch bf16 mm 2048^3 {peak:.1f} GFLOP/s (best of {a.repeats})", flush=True)
        for shape in a.shapes.split(","):
            for line in step(shape, a.types.split(","), rows, a.repeats, peak, a.prompt):
                print(line, flush=True)
        return
    for shape in a.shapes.split(","):
        for label, n, k in SHAPES[shape]:
            if a.only and label not in a.only.split(","):
                continue
            for qtype in a.types.split(","):
                for line in bench(qtype, f"{shape}.{label}", n, k, rows, a.repeats):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
