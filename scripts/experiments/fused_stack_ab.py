"""The decoder stack in one compiled call against layer by layer (issue 23):
the embedded SmolLM2 on an in-process worker, B greedy sequences decoding,
whole ``execute`` steps (inputs, forward, LM head, sampling) timed, the two
paths alternating step by step in one process so both see the same machine.

    .venv/bin/python scripts/experiments/fused_stack_ab.py --batches 1,4,16,64 --dtype float32

Also prefill steps of --prefill tokens (one sequence), alternating the same way.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from pagedserve.bench import kv_fp8
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq
from pagedserve.gpuworker import cpu_fused

FLAG = "PAGEDSERVE_" + cpu_fused.ENV


def alternate(runner, make_step, steps: int) -> tuple[list[float], list[float]]:
    """Step times with the stack and layer by layer, interleaved (ABBA so neither always goes first).
    ``make_step(i)``: the i-th step to run, i = 0, 1, 2, ..."""
    model = runner.model
    model.fused = None
    count = iter(range(1 << 30))
    runner.execute(make_step(next(count)))  # builds the stack
    stack = model.fused
    assert stack is not None, "the fused stack did not build"
    times: dict[bool, list[float]] = {True: [], False: []}
    for s in range(1, steps + 1):
        for fused in ((True, False) if s % 2 else (False, True)):
            os.environ[FLAG] = "1" if fused else "0"
            model.fused = stack if fused else None
            step = make_step(next(count))
            t = time.perf_counter()
            runner.execute(step)
            times[fused].append(time.perf_counter() - t)
    os.environ.pop(FLAG, None)
    return times[True], times[False]


def line(label: str, on: list[float], off: list[float]) -> str:
    a, b = statistics.median(on), statistics.median(off)
    return f"{label:<28} fused {a * 1e3:7.2f} ms   per-op {b * 1e3:7.2f} ms   per-op / fused {b / a:5.2f}x"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=30, help="decode steps per path and batch")
    p.add_argument("--prefill", type=int, default=512)
    args = p.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"{args.dtype}; medians of whole worker steps")
    for b in (int(x) for x in args.batches.split(",")):
        batch = (kv_fp8.prompts(64) * 8)[:b]
        # Each of the 2 * steps decodes of both paths appends a token: room for all of them.
        runner, prefill = kv_fp8.batch_runner("auto", batch, 2 * args.steps + 4, args.dtype, logprobs=None)
        runner.execute(prefill)
        on, off = alternate(runner, lambda s, b=b: kv_fp8.decode_step(1000 + s, b), args.steps)
        print(line(f"decode, batch {b}", on, off), flush=True)
    if args.prefill:
        n = args.prefill
        runner, _ = kv_fp8.batch_runner("auto", [[1] * n], 1, args.dtype, logprobs=None)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        blocks = -(-n // 16)

        def prefill_step(s: int) -> ExecuteStep:  # a new sequence each time, over the same blocks
            return ExecuteStep(2000 + s, [NewSeq(s + 1, list(range(5, 5 + n)), 0, params, n)],
                               [BlockDiff(s + 1, 0, list(range(blocks)))], [ScheduledSeq(s + 1, n)], [s] if s else [])
        on, off = alternate(runner, prefill_step, max(4, args.steps // 6))
        print(line(f"prefill, {n} tokens", on, off), flush=True)


if __name__ == "__main__":
    main()
