"""The panel linear kernel (kernels/cpu_linear.cpp) against oneDNN's packed
GEMM in a whole decode step: the embedded SmolLM2 on an in-process worker, B
greedy sequences decoding together, the two layouts taking turns on the same
runner (``--steps`` steps each, ``--rounds`` rounds), so the VM's drifting
speed hits both alike. ``--prefill N`` times one prefill of N tokens instead.

    .venv/bin/python scripts/experiments/linear_layouts.py --batch 1,2,4,8,16,32,64 --dtype float32
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import msgspec

from pagedserve.bench import kv_fp8
from pagedserve.common.messages.worker import ExecuteStep
from pagedserve.gpuworker import cpu_gemm


def again(first: ExecuteStep, step_id: int) -> ExecuteStep:
    """``first``'s prefill as a new sequence over the same blocks, the one before it finished."""
    def renamed(items: list[Any]) -> list[Any]:
        return [msgspec.structs.replace(item, seq_id=step_id) for item in items]
    return ExecuteStep(step_id, renamed(first.new_seqs), renamed(first.block_diffs), renamed(first.scheduled),
                       [step_id - 1])


def compare(batch_size: int, dtype: str, rounds: int, steps: int, prefill: int) -> tuple[float, float]:
    """Median step (s) with oneDNN's layout and with the panels for every linear layer."""
    if prefill:
        batch, max_tokens = [list(range(100, 100 + prefill))], 1
    else:
        batch, max_tokens = (kv_fp8.prompts(64) * 8)[:batch_size], rounds * steps * 2 + 2
    runner, first = kv_fp8.batch_runner("auto", batch, max_tokens, dtype, logprobs=None)
    layers = [m for m in runner.model.modules() if getattr(m, "packed", None) is not None]
    packs = {layout: [cpu_gemm.pack(m.weight, 64, layout) for m in layers] for layout in cpu_gemm.Layout}
    medians: dict[cpu_gemm.Layout, list[float]] = {layout: [] for layout in cpu_gemm.Layout}
    step_id = 1
    runner.execute(first)
    for _ in range(rounds):
        for layout, out in medians.items():
            for m, p in zip(layers, packs[layout]):
                m.packed = p
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                if prefill:  # the same prompt again into the same slots: a fresh prefill each time
                    runner.execute(again(first, step_id))
                else:
                    runner.execute(kv_fp8.decode_step(step_id, batch_size))
                step_id += 1
                times.append(time.perf_counter() - t)
            out.append(statistics.median(times))
    return statistics.median(medians[cpu_gemm.Layout.ONEDNN]), statistics.median(medians[cpu_gemm.Layout.PANELS])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,2,4,8,16,32,64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill", type=int, default=0, help="time a prefill of this many tokens instead")
    args = p.parse_args()
    for b in ([1] if args.prefill else [int(x) for x in args.batch.split(",")]):
        onednn, panels = compare(b, args.dtype, args.rounds, args.steps, args.prefill)
        what = f"prefill of {args.prefill} tokens" if args.prefill else f"{b} seqs: decode step"
        print(f"{args.dtype}, {what} {onednn * 1e3:.1f} ms with oneDNN, {panels * 1e3:.1f} ms with the "
              f"panels: {onednn / panels:.2f}x", flush=True)


if __name__ == "__main__":
    main()
