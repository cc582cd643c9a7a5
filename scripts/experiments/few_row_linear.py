"""The few-row linear kernel (kernels/cpu_gemv.cpp) against oneDNN's packed
GEMM in a whole decode step: the embedded SmolLM2 on an in-process worker, B
greedy sequences decoding together, the two paths taking turns on the same
runner (30 steps each, 6 rounds), so the VM's drifting speed hits both alike.

    .venv/bin/python scripts/experiments/few_row_linear.py --batch 1,2,3,4 --dtype float32
"""
from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.bench import kv_fp8


def compare(batch_size: int, dtype: str, rounds: int, steps: int) -> tuple[float, float]:
    """Median step (s) with oneDNN and with the few-row kernel for every linear layer."""
    batch = (kv_fp8.prompts(64) * 8)[:batch_size]
    runner, prefill = kv_fp8.batch_runner("auto", batch, rounds * steps * 2 + 2, dtype, logprobs=None)
    runner.execute(prefill)
    layers = [m for m in runner.model.modules() if hasattr(m, "small_rows")]
    medians: dict[int, list[float]] = {0: [], batch_size: []}
    step_id = 1
    for _ in range(rounds):
        for limit, out in medians.items():
            for layer in layers:
                layer.small_rows = limit
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                runner.execute(kv_fp8.decode_step(step_id, batch_size))
                times.append(time.perf_counter() - t)
                step_id += 1
            out.append(statistics.median(times))
    return statistics.median(medians[0]), statistics.median(medians[batch_size])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,2,3,4")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    for b in (int(x) for x in args.batch.split(",")):
        onednn, small = compare(b, args.dtype, args.rounds, args.steps)
        print(f"{args.dtype}, {b} seqs: step {onednn * 1e3:.1f} ms with oneDNN, {small * 1e3:.1f} ms with the "
              f"few-row kernel: {onednn / small:.2f}x", flush=True)


if __name__ == "__main__":
    main()
