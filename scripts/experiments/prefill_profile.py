"""Where a CPU prefill goes: one prompt of N tokens on an in-process worker
(the embedded SmolLM2), three prefills after a first, the time in the linears,
the attention and each fused op (decode_step_profile.py's hooks).

    .venv/bin/python scripts/experiments/prefill_profile.py 2048 bfloat16
"""
from __future__ import annotations

import statistics
import sys
import time

import decode_step_profile as dsp  # siblings: the script's folder is on sys.path
from linear_layouts import again

from pagedserve.bench import kv_fp8


def main() -> None:
    dsp.install_hooks()
    n, dt = int(sys.argv[1]), sys.argv[2]
    runner, first = kv_fp8.batch_runner("auto", [list(range(100, 100 + n))], 1, dt, logprobs=None)
    runner.execute(first)
    dsp.RECORD["on"] = True
    ts = []
    for s in range(1, 4):
        t = time.perf_counter()
        runner.execute(again(first, s))
        ts.append(time.perf_counter() - t)
    print(f"{dt} prefill {n}: {statistics.median(ts) * 1e3:.0f} ms")
    for label, xs in sorted(dsp.CALLS.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {label:<15} {sum(xs) / len(ts) * 1e3:7.1f} ms/prefill {sum(xs) / sum(ts) * 100:5.1f} %")


if __name__ == "__main__":
    main()
