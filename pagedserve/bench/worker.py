"""``pagedserve bench worker``: the worker alone, no sockets. An in-process
ModelRunner is driven by a synthetic ExecuteStep stream, and transformers'
own forward on the same weights, in the same run, is the baseline.

Points (greedy, so both sides end each step with an argmax and a host sync):

  decode B   B sequences with ``--context`` tokens already cached, one new
             token each per step (the worker: paged KV, CUDA graphs on CUDA;
             transformers: a DynamicCache filled with random K/V of the same
             length, one forward of [B, 1] per step)
  prefill N  one fresh sequence of N tokens per step (transformers: one
             forward of [1, N] without cache)

Columns: steps/s, tokens/s (B or N per step), ``eager`` = the worker with CUDA
graphs off, ``hf`` = the baseline, ``vs_hf`` = worker tokens/s over the
baseline's. The KV contents of the decode points are not a real context
(throughput does not depend on them); the prefill point also reports the
relative logits error of the worker against transformers.

Model: the embedded SmolLM2-135M-Instruct by default, ``--model DIR`` for a
folder, or ``--random-weights NAME|config.json`` for random weights of a
known shape (``smollm2-135m``, ``llama-8b``), labelled as such; random weights
are drawn by transformers and the worker loads the same tensors.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.common.config import EngineConfig
from pagedserve.common.default_model import resolve_model
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq

# Shapes for --random-weights (Llama architecture; no checkpoint needed).
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
    "llama-8b": dict(  # Llama-3.1-8B's shape
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    ),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve bench worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="local Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    src.add_argument("--random-weights", default=None, metavar="NAME|CONFIG",
                     help=f"random weights of a shape: {', '.join(RANDOM_CONFIGS)} or a config.json path")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32, 128])
    p.add_argument("--context", type=int, default=None, help="cached tokens per decode sequence (512 on CUDA, 128 on CPU)")
    p.add_argument("--prefill", type=int, default=512, help="prefill length (0: none)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per point (30 on CUDA, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="the worker's max_model_len (capped at the model's); it bounds the CUDA-graph attention")
    p.add_argument("--no-baseline", action="store_true", help="skip transformers")
    p.add_argument("--no-cuda-graphs", action="store_true", help="worker eager only")
    p.add_argument("--seed", type=int, default=0)
    return p


def _hf_model(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> tuple[Any, Any, str]:
    """(transformers model, config, label); the model is None for a folder
    without baseline (random weights always need it: it draws them)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if args.random_weights is None:
        folder = resolve_model(args.model)
        label = "SmolLM2-135M-Instruct" if args.model is None else os.path.basename(os.path.normpath(folder))
        cfg = AutoConfig.from_pretrained(folder)
        if args.no_baseline:
            return None, cfg, label
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        except TypeError:  # transformers 4.x
            model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype)
        return model.to(device).eval(), cfg, label
    name = args.random_weights
    if name in RANDOM_CONFIGS:
        cfg = LlamaConfig(architectures=["LlamaForCausalLM"], **RANDOM_CONFIGS[name])
    else:
        with open(name) as f:
            cfg = AutoConfig.for_model(**json.load(f))
        name = os.path.basename(name)
    torch.manual_seed(args.seed)
    with torch.device(device):  # draw the random weights where they run
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except TypeError:
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model.to(device, dtype).eval(), cfg, f"{name} (random weights)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_steps(step: Callable[[], object], warmup: int, steps: int, device: torch.device) -> float:
    """Mean seconds per step (each step ends in a host sync of its tokens)."""
    for _ in range(warmup):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / steps


class WorkerDriver:
    """Synthetic ExecuteStep streams for one ModelRunner: each point gets
    fresh sequence ids and dedicated blocks, and finishes them afterwards."""

    def __init__(self, runner: Any, block_size: int, vocab: int, seed: int) -> None:
        self.runner, self.bs, self.vocab = runner, block_size, vocab
        self.rng = random.Random(seed)
        self.step_id = 0
        self.next_seq = 0
        self.last_prefill: int | None = None

    def _exec(self, new: list[NewSeq], diffs: list[BlockDiff], sched: list[ScheduledSeq],
              finished: list[int] | None = None) -> Any:
        self.step_id += 1
        return self.runner.execute(ExecuteStep(self.step_id, new, diffs, sched, finished or []))

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def decode(self, batch: int, context: int, total_steps: int) -> tuple[Callable[[], object], Callable[[], None]]:
        """Sequences whose first ``context`` tokens count as cached: each step
        computes one token per sequence. Returns (step, finish)."""
        per_seq = math.ceil((context + total_steps + 2) / self.bs)
        ids = list(range(self.next_seq, self.next_seq + batch))
        self.next_seq += batch
        new = [NewSeq(s, self.tokens(context + 1), context, GREEDY, context + 1) for s in ids]
        # Their tables arrive with them, as diffs, in the first step only.
        diffs = [BlockDiff(s, 0, list(range(i * per_seq, (i + 1) * per_seq))) for i, s in enumerate(ids)]
        sched = [ScheduledSeq(s, 1) for s in ids]
        pending = [(new, diffs)]

        def step() -> object:
            now_new, now_diffs = pending.pop() if pending else ([], [])
            return self._exec(now_new, now_diffs, sched)

        return step, lambda: self._exec([], [], [], ids) and None

    def prefill(self, length: int, first_block: int) -> Callable[[], object]:
        """Each step: a fresh sequence of ``length`` random tokens (the previous one finished)."""
        return lambda: self.run_prefill(self.tokens(length), first_block)

    def run_prefill(self, tokens: list[int], first_block: int) -> int:
        """One step prefilling a fresh sequence of ``tokens``; returns its id."""
        seq = self.next_seq
        self.next_seq += 1
        blocks = list(range(first_block, first_block + math.ceil(len(tokens) / self.bs)))
        finished = [seq - 1] if self.last_prefill == seq - 1 else []
        self._exec([NewSeq(seq, tokens, 0, GREEDY, len(tokens))], [BlockDiff(seq, 0, blocks)],
                   [ScheduledSeq(seq, len(tokens))], finished)
        self.last_prefill = seq
        return seq


def _hf_decode(model: Any, cfg: Any, batch: int, context: int, device: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    from transformers import DynamicCache

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, kv, context, head_dim, device=device, dtype=dtype)
        cache.update(k, torch.randn_like(k), layer)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    pos = [context]

    @torch.inference_mode()
    def step() -> object:
        nonlocal ids
        position = torch.full((batch, 1), pos[0], device=device, dtype=torch.long)
        out = model(input_ids=ids, past_key_values=cache, position_ids=position, use_cache=True)
        ids = out.logits[:, -1].argmax(-1, keepdim=True)
        pos[0] += 1
        return ids.tolist()

    return step


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")  # newer transformers renamed it
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA requested but not available", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    context = args.context if args.context is not None else (512 if cuda else 128)
    steps = args.steps if args.steps is not None else (30 if cuda else 3)
    dtype_name = args.dtype if args.dtype != "auto" else ("bfloat16" if cuda else "float32")
    dtype = DTYPES[dtype_name]
    torch.manual_seed(args.seed)

    from pagedserve.gpuworker.model_runner import ModelRunner, ModelSource

    hf, hf_cfg, label = _hf_model(args, dtype, device)  # None only for a folder without baseline
    max_len = min(args.max_model_len, int(getattr(hf_cfg, "max_position_embeddings", args.max_model_len)))
    longest = max(context + args.warmup + steps + 2, args.prefill)
    if longest > max_len:
        print(f"--context/--prefill need {longest} positions, above max_model_len {max_len}", file=sys.stderr)
        return 2
    per_seq = math.ceil((context + args.warmup + steps + 2) / args.block_size)
    blocks = max(args.batch_sizes) * per_seq + math.ceil(args.prefill / args.block_size) + 1
    cfg = EngineConfig(
        model=args.model, device=str(device), dtype=dtype_name, block_size=args.block_size, num_gpu_blocks=blocks,
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(args.prefill, max(args.batch_sizes)),
        max_model_len=max_len, seed=args.seed,
    )
    source = None
    if args.random_weights is not None:  # the worker loads the very tensors transformers drew
        source = ModelSource(hf_cfg, hf.state_dict().items, label)
    t0 = time.monotonic()
    runner = ModelRunner(cfg, source=source, cuda_graphs=not args.no_cuda_graphs, keep_logits=True)
    runner.init()
    init_s = time.monotonic() - t0
    del source
    if args.no_baseline:
        hf = None
        if cuda:
            torch.cuda.empty_cache()
    graphs = runner.graphs

    if cuda:
        machine = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    else:
        machine = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads), torch {torch.__version__}"
    print(f"bench worker on {machine}")
    print(f"model: {label}, {dtype_name}, attention={runner.backend.name}, CUDA graphs "
          f"{'on (batch <= %d)' % graphs.max_batch if graphs else 'off'}; worker init {init_s:.1f} s; "
          f"decode context {context} tokens, {steps} timed steps after {args.warmup} warm-up")

    drv = WorkerDriver(runner, args.block_size, hf_cfg.vocab_size, args.seed)
    results: list[dict[str, Any]] = []
    for b in args.batch_sizes:
        point: dict[str, Any] = {"phase": "decode", "batch": b, "tokens_per_step": b}
        modes = [("graphs", graphs)] if graphs is not None and b <= graphs.max_batch else []
        modes.append(("eager", None))
        for mode, g in modes:
            runner.graphs = g
            step, finish = drv.decode(b, context, args.warmup + steps)
            point[mode] = _time_steps(step, args.warmup, steps, device)
            finish()
        runner.graphs = graphs
        if hf is not None:
            point["hf"] = _time_steps(_hf_decode(hf, hf_cfg, b, context, device, dtype), args.warmup, steps, device)
        results.append(point)
        if cuda:
            torch.cuda.empty_cache()
    rel_err = None
    if args.prefill:
        point = {"phase": "prefill", "batch": 1, "tokens_per_step": args.prefill}
        first_block = max(args.batch_sizes) * per_seq
        point["eager"] = _time_steps(drv.prefill(args.prefill, first_block), args.warmup, steps, device)
        if hf is not None:
            ids = torch.tensor([drv.tokens(args.prefill)], device=device)

            @torch.inference_mode()
            def hf_prefill() -> object:
                return hf(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1).tolist()

            point["hf"] = _time_steps(hf_prefill, args.warmup, steps, device)
            # Agreement on the same tokens: the worker's last-position logits vs transformers'.
            seq = drv.run_prefill(ids[0].tolist(), first_block)
            with torch.inference_mode():
                ref = hf(input_ids=ids, use_cache=False).logits[0, -1].float()
            rel_err = float((runner.last_logits[seq].to(ref.device) - ref).abs().max() / ref.abs().max())
        results.append(point)

    rows = []
    for p in results:
        best = p.get("graphs", p["eager"])
        p["steps_per_s"] = 1.0 / best
        p["tokens_per_s"] = p["tokens_per_step"] / best
        p["eager_steps_per_s"] = 1.0 / p["eager"]
        if "graphs" in p:
            p["graphs_vs_eager"] = p["eager"] / p["graphs"]
        if "hf" in p:
            p["hf_steps_per_s"] = 1.0 / p["hf"]
            p["vs_hf"] = p["hf"] / best
        rows.append(p)
    header = f"{'phase':<8}{'batch':>6}{'tok/step':>9}{'steps/s':>10}{'tokens/s':>11}{'eager st/s':>11}{'graphs/eager':>13}{'hf st/s':>10}{'vs_hf':>8}"
    print(header)
    print("-" * len(header))
    for p in rows:
        ge = f"{p['graphs_vs_eager']:.2f}x" if "graphs_vs_eager" in p else "-"
        hs = f"{p['hf_steps_per_s']:.1f}" if "hf_steps_per_s" in p else "-"
        vs = f"{p['vs_hf']:.2f}x" if "vs_hf" in p else "-"
        print(f"{p['phase']:<8}{p['batch']:>6}{p['tokens_per_step']:>9}{p['steps_per_s']:>10.1f}{p['tokens_per_s']:>11.0f}"
              f"{p['eager_steps_per_s']:>11.1f}{ge:>13}{hs:>10}{vs:>8}")
    if rel_err is not None:
        print(f"prefill logits vs transformers: max relative error {rel_err:.2e} ({dtype_name})")
    summary = {
        "bench": "worker", "machine": machine, "device": str(device), "model": label,
        "weights": "random" if args.random_weights else "checkpoint", "dtype": dtype_name,
        "attention": runner.backend.name, "cuda_graphs": graphs is not None, "context": context, "steps": steps,
        "init_s": round(init_s, 2), "prefill_logits_rel_err": rel_err,
        "points": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in p.items()} for p in rows],
    }
    print(json.dumps(summary))
    return 0
