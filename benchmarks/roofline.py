"""``python -m benchmarks roofline``: the least time any engine can take for ``benchmarks peers``'
workload on this machine, from two rates measured in the same run, so an engine's time reads as a
share of what the hardware allows.

Each step of the schedule (every prompt prefilled first, then one decode step per output position
while any request still runs) costs at least the larger of
- its bytes over the memory read rate: every weight once (bf16 or the model's dtype), plus the KV of
  every running sequence's context;
- its FLOPs (2 x parameters of the linear layers and the LM head, per token) over torch's own
  bf16 matmul peak (2048^3).
The read rate is the best of ``torch.sum`` over 1 GiB and a 1B-shape decode step of the bf16 panels
at one row (the rate a kernel streaming weights reaches). Both are the most a 2-core run reached,
so the bound is optimistic: no engine meets it. On a shared VM the read rate moves within minutes
(27-44 GB/s on a Zen 4 VM on 2026-12-07), so ``bench peers --roofline`` reads it with ``--probe``
(the panel step over and over; the mean of its samples, not the best) alone around each run, or in
a slice of its own among the engines'; that bound is less strict: a run can meet a faster phase
than the probe did (ours came out at up to 110 % of it).

    python -m benchmarks roofline --model DIR --requests 32 [--max-output N] [--times peers.json]
    python -m benchmarks roofline --probe [1b|smol]   # for bench peers --roofline
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO


def model_shape(model_dir: str) -> dict[str, int]:
    """Linear parameters per token (layers and LM head) and KV bytes per token (bf16)."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return {"params": layers * per_layer + vocab * h, "kv_bytes": layers * 2 * kv * 2, "max_len": c.get(
        "max_position_embeddings", 4096), "vocab": vocab}


def panel_step(shape: str = "1b") -> tuple[Callable[[], object], int] | None:
    """A decode step of bf16 panels at one row (the layer linears of quant_bench's ``shape``:
    the 1B's 64 read 1.9 GB) and the bytes it reads; None where the panels do not build."""
    import torch

    from pagedserve.kernels import cpu_ops
    from pagedserve.kernels.quant_bench import LAYERS, SHAPES

    layers = [(n, k) for label, n, k in SHAPES[shape] if label != "lm_head"] * LAYERS[shape]
    panels = [cpu_ops.pack_linear(torch.randn(n, k).to(torch.bfloat16)) for n, k in layers]
    if panels[0] is None:
        return None
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for _, k in layers}
    return (lambda: [cpu_ops.packed_linear(xs[k], p, n, None) for (n, k), p in zip(layers, panels)],
            sum(n * k * 2 for n, k in layers))


def rates(repeats: int = 5) -> dict[str, float]:
    """GB/s read and bf16 GFLOP/s peak, best of ``repeats`` (quant_bench's timer and 1B decode step)."""
    import torch

    from pagedserve.kernels.quant_bench import _times_us, bf16_peak

    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    step = panel_step()
    fns: dict[str, Any] = {"sum": lambda i: big.sum()}
    if step is not None:
        fns["panels"] = lambda i: step[0]()
    best = {name: b / 1e6 for name, (b, _) in _times_us(fns, repeats).items()}
    sum_gb_s = big.numel() * 4 / best["sum"] / 1e9
    panels_gb_s = step[1] / best["panels"] / 1e9 if step is not None else 0.0
    return {"read_gb_s": max(sum_gb_s, panels_gb_s), "sum_gb_s": sum_gb_s, "panels_gb_s": panels_gb_s,
            "peak_gflop_s": bf16_peak(repeats)}


def probe(out: TextIO, shape: str = "1b") -> None:
    """``--probe``, for ``bench peers --roofline``: torch's bf16 peak as a first JSON line, then one
    line per panel step (its seconds, bytes and Unix end time) until killed. The bench continues
    this process only while the engines are stopped: around each run, or in a slice of its own."""
    from pagedserve.kernels.quant_bench import bf16_peak

    out.write(json.dumps({"peak_gflop_s": bf16_peak(5)}) + "\n")
    out.flush()
    step = panel_step(shape)
    if step is None:
        print("roofline --probe: the panels did not build (no C++ compiler?)", file=sys.stderr)
        return
    try:
        while True:
            t0 = time.perf_counter()
            step[0]()
            out.write(json.dumps({"s": time.perf_counter() - t0, "bytes": step[1], "end": time.time()}) + "\n")
            out.flush()
    except BrokenPipeError:  # the reader is gone
        return


def bound_seconds(work: list[tuple[int, int]], shape: dict[str, int], r: dict[str, float]) -> dict[str, float]:
    """The schedule's least time: prefill, then decode steps, each max(bytes / read, FLOPs / peak)."""
    wbytes, flop_tok = shape["params"] * 2, 2.0 * shape["params"]
    read, peak = r["read_gb_s"] * 1e9, r["peak_gflop_s"] * 1e9
    prompts = sum(p for p, _ in work)
    prefill = max(wbytes / read, flop_tok * prompts / peak)
    decode, steps = 0.0, max(o for _, o in work) - 1  # the first token comes from the prefill
    for s in range(1, steps + 1):
        running = [(p, o) for p, o in work if o > s]
        kv = sum(p + s for p, _ in running) * shape["kv_bytes"]
        decode += max((wbytes + kv) / read, flop_tok * len(running) / peak)
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode, "decode_steps": steps}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks roofline", description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", nargs="?", const="1b", choices=("1b", "smol"), default=None,
                   help="sample the read rate for ever, a step of this shape at a time (bench peers --roofline)")
    p.add_argument("--model", default=None, help="HF folder (its config.json); required but with --probe")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-output", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--times", default=None, help="a peers JSON: each engine's median time as a share of the bound")
    args = p.parse_args(argv)
    if args.probe:
        probe(sys.stdout, args.probe)
        return 0
    if args.model is None:
        p.error("--model is required")
    from benchmarks.peers import build_workload  # here: peers imports this module for its --roofline
    shape = model_shape(args.model)
    work = [(len(ids), o) for ids, o in build_workload(args.workload, args.requests, args.seed, shape["vocab"],
                                                         shape["max_len"], args.max_output)]
    r = rates()
    out: dict[str, Any] = {"rates": r, "shape": shape, "bound": bound_seconds(work, shape, r),
                           "output_tokens": sum(o for _, o in work), "prompt_tokens": sum(p for p, _ in work)}
    if args.times:
        eng = json.loads(Path(args.times).read_text())["workloads"][args.workload]["engines"]
        out["share_of_bound"] = {e: out["bound"]["total_s"] / sorted(v["seconds"])[len(v["seconds"]) // 2]
                                 for e, v in eng.items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
