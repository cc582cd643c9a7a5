"""Where a CPU decode step goes (issue 23, acceptance 1): the embedded SmolLM2
on an in-process worker, B greedy sequences decoding together, per-step wall
time, and the time per step in the oneDNN linears and in each fused op.

    .venv/bin/python scripts/experiments/decode_step_profile.py --batch 64 --dtype bfloat16

Decode steps only: the first (prefill) step is left out of every figure.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.bench import kv_fp8
from pagedserve.gpuworker import linear as tp_linear
from pagedserve.kernels import backend, cpu_ops

CALLS: dict[str, list[float]] = defaultdict(list)
RECORD = {"on": False}


def timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = fn(*a, **k)
        if RECORD["on"]:
            CALLS[label].append(time.perf_counter() - t)
        return out
    return run


def install_hooks() -> None:
    """Time every linear, the attention and each fused op into CALLS (while RECORD is on)."""
    for name in ("silu_and_mul", "add_rms_norm", "rope_and_cache"):
        setattr(cpu_ops, name, timed(name, getattr(cpu_ops, name)))
    tp_linear.linear = timed("linear", tp_linear.linear)  # type: ignore[assignment]
    backend.paged_attention_cpu = timed("attention", backend.paged_attention_cpu)  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    install_hooks()
    batch = (kv_fp8.prompts(64) * 8)[:args.batch]
    runner, prefill = kv_fp8.batch_runner("auto", batch, args.steps + 2, args.dtype, logprobs=None)
    runner.execute(prefill)
    steps = []
    RECORD["on"] = True
    for s in range(1, args.steps + 1):
        t = time.perf_counter()
        runner.execute(kv_fp8.decode_step(s, len(batch)))
        steps.append(time.perf_counter() - t)
    step = statistics.median(steps)
    print(f"{args.dtype}, batch {args.batch}, torch threads {torch.get_num_threads()}: decode step median "
          f"{step * 1e3:.1f} ms ({args.batch / step:.0f} tok/s)")
    mean_step = sum(steps) / len(steps)
    for label, xs in sorted(CALLS.items(), key=lambda kv: -sum(kv[1])):
        per_step = sum(xs) / len(steps)
        print(f"  {label:<15} {len(xs) / len(steps):5.0f} calls/step, {per_step * 1e3:6.1f} ms/step, "
              f"{per_step / mean_step * 100:5.1f} % of the mean step")
    rest = mean_step - sum(sum(xs) for xs in CALLS.values()) / len(steps)
    print(f"  {'everything else':<15} {'':>16} {rest * 1e3:6.1f} ms/step, {rest / mean_step * 100:5.1f} % "
          "(embedding, sampling, inputs, Python)")


if __name__ == "__main__":
    main()
