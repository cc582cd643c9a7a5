"""A CPU step under oversubscription (issue 23, the TTFT stall under guidellm):
steps of the embedded SmolLM2 on an in-process worker, timed on a quiet
machine and then beside 1, 2 and N busy-looping processes (4 s each): a
64-token prefill, or with ``--decode B`` a decode step of B sequences.
The thread count and placement come from the environment, as in the server:

    GOMP_CPU_AFFINITY="0 1" .venv/bin/python scripts/experiments/oversubscription.py --hogs 6   # the server's
    GOMP_CPU_AFFINITY="0 1" OMP_NUM_THREADS=1 .venv/bin/python ...                              # one pinned thread
    OMP_NUM_THREADS=1 .venv/bin/python scripts/experiments/oversubscription.py --decode 2       # one unpinned
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from pagedserve.bench.kv_fp8 import batch_runner, decode_step
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq

HOG = "import time\nt = time.time()\nwhile time.time() - t < 4: pass"
PROMPT = list(range(1000, 1064))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hogs", type=int, default=6, help="the largest number of busy loops")
    p.add_argument("--decode", type=int, default=0, help="B: time decode steps of B sequences, not prefills")
    p.add_argument("--steps", type=int, default=12, help="steps timed per condition (the median is printed)")
    args = p.parse_args()
    b = max(1, args.decode)
    runner, first = batch_runner("auto", [PROMPT] * b, 4096 if args.decode else 8)
    runner.execute(first)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    count, prev = 0, 0

    def step_ms() -> float:
        nonlocal count, prev
        count += 1
        if args.decode:
            step = decode_step(count, b)
        else:  # a fresh sequence each time, on the blocks of the one it replaces
            sid, blocks = 1000 + count, list(range(5))
            step = ExecuteStep(count, [NewSeq(sid, PROMPT, 0, params, 64)], [BlockDiff(sid, 0, blocks)],
                               [ScheduledSeq(sid, 64)], [prev])
            prev = sid
        t = time.perf_counter()
        runner.execute(step)
        return (time.perf_counter() - t) * 1000

    what = f"decode step of {b} seqs" if args.decode else "64-token prefill"
    print(f"{what}; torch threads {torch.get_num_threads()}, GOMP_CPU_AFFINITY={os.environ.get('GOMP_CPU_AFFINITY')!r}")
    for _ in range(3):
        step_ms()
    print(f"  quiet: median {statistics.median(step_ms() for _ in range(args.steps)):.0f} ms")
    for hogs in sorted({1, 2, args.hogs}):
        procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
        time.sleep(0.3)
        times = []
        while len(times) < args.steps and all(pr.poll() is None for pr in procs):
            times.append(step_ms())
        print(f"  beside {hogs} busy loops: median {statistics.median(times):.0f} ms over {len(times)} steps")
        for pr in procs:
            pr.kill()
            pr.wait()


if __name__ == "__main__":
    main()
