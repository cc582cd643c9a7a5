"""A CPU step under oversubscription (issue 23, the TTFT stall under guidellm):
64-token prefills of the embedded SmolLM2 on an in-process worker, timed on a
quiet machine and then beside N busy-looping processes (4 s).

    .venv/bin/python scripts/experiments/oversubscription.py 6
    OMP_NUM_THREADS=1 .venv/bin/python scripts/experiments/oversubscription.py 6
"""
from __future__ import annotations

import subprocess
import sys
import time

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq
from pagedserve.gpuworker.model_runner import ModelRunner

HOG = "import time\nt = time.time()\nwhile time.time() - t < 4: pass"


def main() -> None:
    hogs = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    runner = ModelRunner(EngineConfig(model=None, dtype="float32", block_size=16, num_gpu_blocks=2000,
                                      max_num_seqs=256))
    runner.init()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    count = 0

    def prefill_ms() -> int:
        nonlocal count
        i, count = count, count + 1
        step = ExecuteStep(i, [NewSeq(i, list(range(1000, 1064)), 0, params, 64)],
                           [BlockDiff(i, 0, list(range(i * 5, i * 5 + 5)))], [ScheduledSeq(i, 64)], [])
        t = time.perf_counter()
        runner.execute(step)
        return round((time.perf_counter() - t) * 1000)

    for _ in range(3):
        prefill_ms()
    print("quiet, ms per 64-token prefill:", [prefill_ms() for _ in range(5)])
    procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
    time.sleep(0.3)
    print(f"beside {hogs} busy loops:", [prefill_ms() for _ in range(5)])
    for p in procs:
        p.wait()


if __name__ == "__main__":
    main()
