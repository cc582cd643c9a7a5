"""Per-step time of a single-stream decode, in one process, for the ways the worker can run
one GGUF file: its blocks through the compiled stack (``quant-fused``), its blocks layer by
layer (``quant-layers``), and the file dequantized to bfloat16 through the stack
(``bf16-fused``). The configurations take turns step by step, so load on the machine falls
on each alike; a round's figure is the median ms of its decode steps (forward, LM head and
sampling, as ``ModelRunner.execute`` runs them), the result the median over rounds.

    python -m benchmarks quant-step --files Q4_1,Q8_0 --steps 64 --rounds 5 --out FILE
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Any

CONFIGS = {  # name -> (GGUF_DEQUANTIZE, CPU_FUSED_LAYERS)
    "quant-fused": ("0", "1"),
    "quant-layers": ("0", "0"),
    "bf16-fused": ("1", "1"),
}


def file_path(which: str) -> str:
    """A SmolLM2 type (Q4_1: the embedded file; Q8_0: its llama.cpp conversion) or any GGUF path."""
    from pagedserve.common.default_model import cache_dir, gguf_path

    if which.endswith(".gguf"):
        return which
    return str(gguf_path()) if which == "Q4_1" else str(cache_dir() / f"SmolLM2-135M-Instruct.{which}.gguf")


def make_runner(path: str, dequantize: str, seqs: int = 1, prompt: int = 64, steps: int = 64) -> Any:
    from pagedserve.common.config import EngineConfig
    from pagedserve.gpuworker.model_runner import ModelRunner

    os.environ["PAGEDSERVE_GGUF_DEQUANTIZE"] = dequantize
    blocks = seqs * -(-(prompt + steps + 1) // 16) + 1
    r = ModelRunner(EngineConfig(model=path, dtype="bfloat16", block_size=16, num_gpu_blocks=blocks,
                                 max_num_seqs=max(4, seqs), max_num_batched_tokens=max(2048, seqs * prompt)))
    r.init()
    return r


def start(r: Any, prompt: int, steps: int, seqs: int) -> None:
    """Prefills ``seqs`` sequences of ``prompt`` tokens (untimed)."""
    from pagedserve.common.messages.types import SamplingParams
    from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    per = -(-(prompt + steps + 1) // 16)
    new, diffs = [], []
    for i in range(seqs):
        ids = [(7 * k + 13 * i + 3) % 5000 + 100 for k in range(prompt)]
        new.append(NewSeq(i, ids, 0, params, prompt))
        diffs.append(BlockDiff(i, 0, list(range(1 + i * per, 1 + (i + 1) * per))))
    r.model.fused = None
    r.execute(ExecuteStep(0, new, diffs, [ScheduledSeq(i, prompt) for i in range(seqs)], []))


def step_ms(r: Any, fused: str, step: int, seqs: int) -> float:
    """ms of one decode step of every sequence."""
    from pagedserve.common.messages.worker import ExecuteStep, ScheduledSeq

    os.environ["PAGEDSERVE_CPU_FUSED_LAYERS"] = fused  # read whenever no stack is built (each step layer by layer)
    t0 = time.perf_counter()
    r.execute(ExecuteStep(step, [], [], [ScheduledSeq(i, 1) for i in range(seqs)], []))
    ms = (time.perf_counter() - t0) * 1e3
    if (r.model.fused is not None) != (fused == "1"):
        raise RuntimeError(f"the compiled stack {'was' if r.model.fused is not None else 'was not'} built "
                           f"with CPU_FUSED_LAYERS={fused}")
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default="Q4_1,Q8_0")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seqs", default="1", help="decode batch sizes, e.g. 1,64 (64: acceptance 3's shape)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as the worker sets them)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "command": "python -m benchmarks quant-step " + " ".join(
                                  f"--{k} {v}" for k, v in vars(args).items() if v is not None),
                              "baseline": "bf16-fused (the same file dequantized to bfloat16)", "files": {}}
    for which in args.files.split(","):
        path = file_path(which)
        most = max(int(n) for n in args.seqs.split(","))
        runners = {name: make_runner(path, deq, most, args.prompt, args.steps) for name, (deq, _) in CONFIGS.items()}
        for seqs in (int(n) for n in args.seqs.split(",")):
            rounds: dict[str, list[float]] = {name: [] for name in CONFIGS}
            for _ in range(args.rounds):
                samples: dict[str, list[float]] = {name: [] for name in CONFIGS}
                for name, (_, fused) in CONFIGS.items():
                    os.environ["PAGEDSERVE_CPU_FUSED_LAYERS"] = fused
                    start(runners[name], args.prompt, args.steps, seqs)
                for step in range(1, args.steps + 1):  # the configurations take turns step by step
                    for name, (_, fused) in CONFIGS.items():
                        samples[name].append(step_ms(runners[name], fused, step, seqs))
                for name in CONFIGS:
                    runners[name].reset()
                    rounds[name].append(statistics.median(samples[name]))
            med = {name: statistics.median(v) for name, v in rounds.items()}
            result["files"][f"{which}/seqs={seqs}"] = {
                "rounds_ms": rounds, "median_ms": med, "quant_fused_vs_layers": med["quant-layers"] / med["quant-fused"],
                "quant_fused_vs_bf16": med["bf16-fused"] / med["quant-fused"]}
            print(which, f"seqs={seqs}", {k: round(v, 3) for k, v in med.items()}, flush=True)
        del runners
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
