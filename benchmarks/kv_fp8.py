"""``python -m benchmarks kv_fp8``: what an fp8 KV cache (``--kv-cache-dtype``) costs
in accuracy and gives in throughput, against the model's own dtype, in one run.

accuracy    greedy tokens of N requests on the embedded SmolLM2 (an in-process
            worker, every request in one batch), fp8 KV against an
            unquantized KV pool: requests whose tokens are identical;
            requests vLLM's own fp8 tests would pass (identical, or at the
            first difference each token is in the other's top 8 logprobs,
            their ``check_logprobs_close``); and |delta logprob| of the chosen
            tokens over the positions where both runs still agree (mean, max).
throughput  a workload limited by KV memory: the real four processes, all
            requests in flight over gRPC, a small ``--kv-cache-memory`` so
            an fp32 pool holds a few sequences and preempts (recompute) often;
            the same memory as fp8 holds four times the tokens. Rounds
            alternate the two pools, a fresh server each, and the ratio is of
            the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.common.config import EngineConfig
from pagedserve.common.default_model import resolve_model
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq

CLOSE_TOP = 8  # NUM_LOG_PROBS of vLLM's fp8 KV tests
TOPICS = ["the sea", "a paged memory allocator", "the French revolution", "bread baking", "black holes",
          "a KV cache", "chess openings", "volcanoes"]
ASKS = ["Write two sentences about {}.", "Explain {} to a child.", "List three facts about {}.",
        "What is the history of {}?", "Give a short poem about {}.", "Why does {} matter?",
        "Describe {} in one paragraph.", "What are common mistakes about {}?"]


def prompts(n: int) -> list[list[int]]:
    """``n`` distinct chat prompts (topic x question) tokenized for SmolLM2."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    texts = [ASKS[i // len(TOPICS) % len(ASKS)].format(TOPICS[i % len(TOPICS)]) + ("" if i < 64 else f" ({i})")
             for i in range(n)]
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]) for t in texts]


def batch_runner(kv_cache_dtype: str, batch: list[list[int]], max_tokens: int, dtype: str = "float32",
                 block_size: int = 16, model: str | None = None, backend: str = "auto",
                 logprobs: int | None = 0) -> tuple[Any, ExecuteStep]:
    """An in-process worker with blocks for every prompt of ``batch`` plus
    ``max_tokens``, and its first step: every prompt prefilled, greedy
    (``logprobs`` 0: the chosen token's logprob; None: none)."""
    from pagedserve.gpuworker.model_runner import ModelRunner

    per_seq = -(-(max(len(p) for p in batch) + max_tokens) // block_size)
    cfg = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                       num_gpu_blocks=len(batch) * per_seq + 1, max_num_seqs=len(batch), attention_backend=backend)
    runner = ModelRunner(cfg)
    runner.init()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    new = [NewSeq(i, list(p), 0, params, len(p)) for i, p in enumerate(batch)]
    diffs = [BlockDiff(i, 0, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(len(batch))]
    return runner, ExecuteStep(0, new, diffs, [ScheduledSeq(i, len(p)) for i, p in enumerate(batch)], [])


def decode_step(step_id: int, num_seqs: int) -> ExecuteStep:
    """One more token for each of sequences 0 .. num_seqs - 1."""
    return ExecuteStep(step_id, [], [], [ScheduledSeq(i, 1) for i in range(num_seqs)], [])


@dataclass
class Run:
    """One request's greedy tokens, their logprobs, and the top logprobs at
    each position (empty dicts unless asked for)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[int, float]] = field(default_factory=list)


def greedy_runs(kv_cache_dtype: str, batch: list[list[int]], max_tokens: int, dtype: str = "float32",
                block_size: int = 16, model: str | None = None, backend: str = "auto", top: int = 0) -> list[Run]:
    """Greedy, all prompts in one batch, on an in-process worker with the given
    KV pool (model None: SmolLM2); ``top`` logprobs kept at each position."""
    runner, step = batch_runner(kv_cache_dtype, batch, max_tokens, dtype, block_size, model, backend, top)
    out = [Run() for _ in batch]
    for s in range(max_tokens):
        for t in runner.execute(step).sampled:
            r = out[t.seq_id]
            r.tokens.append(t.token_id)
            r.logprobs.append(t.logprob if t.logprob is not None else float("nan"))
            r.tops.append(dict(t.top_logprobs))
        step = decode_step(s + 1, len(batch))
    return out


def greedy(kv_cache_dtype: str, batch: list[list[int]], max_tokens: int, dtype: str = "float32",
           block_size: int = 16, model: str | None = None,
           backend: str = "auto") -> list[tuple[list[int], list[float]]]:
    """(tokens, chosen logprobs) per prompt, as ``greedy_runs``."""
    return pairs(greedy_runs(kv_cache_dtype, batch, max_tokens, dtype, block_size, model, backend))


def pairs(runs: list[Run]) -> list[tuple[list[int], list[float]]]:
    """(tokens, chosen logprobs) of each run, what ``compare`` reads."""
    return [(r.tokens, r.logprobs) for r in runs]


def logprobs_close(base: list[Run], other: list[Run]) -> int:
    """Requests that vLLM's own quantization tests accept (``check_logprobs_close``
    over ``generate_greedy_logprobs``): identical, or at the first differing
    position each run's token is among the other's top logprobs; after that the
    contexts differ, so nothing later is compared."""
    n = 0
    for b, o in zip(base, other):
        i = next((i for i, (x, y) in enumerate(zip(b.tokens, o.tokens)) if x != y), None)
        n += i is None or (o.tokens[i] in b.tops[i] and b.tokens[i] in o.tops[i])
    return n


def compare(base: list[tuple[list[int], list[float]]],
            other: list[tuple[list[int], list[float]]]) -> dict[str, float]:
    """Identical requests, and |delta logprob| of the chosen tokens up to each request's first difference
    (both runs scored the same token in the same context there)."""
    same, deltas = 0, []
    for (bt, bl), (ot, ol) in zip(base, other):
        same += bt == ot
        for i in range(len(bt)):
            deltas.append(abs(bl[i] - ol[i]))
            if bt[i] != ot[i]:
                break
    return {"identical": same / len(base), "identical_count": same, "requests": len(base),
            "mean_abs_dlogprob": statistics.fmean(deltas), "max_abs_dlogprob": max(deltas), "positions": len(deltas)}


def accuracy(n: int, max_tokens: int, kinds: list[str], dtype: str = "float32",
             top: int = CLOSE_TOP) -> dict[str, dict[str, float]]:
    """``compare`` of each fp8 pool against the model's dtype, plus
    ``close_count``: requests ``logprobs_close`` accepts with ``top`` logprobs."""
    batch = prompts(n)
    out: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        base = greedy_runs("auto", batch, max_tokens, dtype, top=top)
        for kind in kinds:
            runs = greedy_runs(kind, batch, max_tokens, dtype, top=top)
            out[kind] = {**compare(pairs(base), pairs(runs)), "close_count": logprobs_close(base, runs),
                         "close_top": top}
    return out


def throughput(kv_cache_memory: str, n: int, max_tokens: int, rounds: int, kind: str = "fp8",
               extra: list[str] | None = None) -> dict[str, object]:
    """Seconds of the KV-limited workload per round, the unquantized pool
    (fp32 on CPU) and ``kind`` alternating, a fresh server each time."""
    from pagedserve.bench.throughput import run_engine

    batch = prompts(n)
    base_args = ["--kv-cache-memory", kv_cache_memory, "--max-num-seqs", str(n), *(extra or [])]
    times: dict[str, list[float]] = {"auto": [], kind: []}
    for _ in range(rounds):
        for k in times:
            times[k].append(run_engine(None, batch, max_tokens, [*base_args, "--kv-cache-dtype", k]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds": times, "median_s": med, "tokens": n * max_tokens,
            "tokens_per_s": {k: n * max_tokens / v for k, v in med.items()}, "ratio": med["auto"] / med[kind]}


def main(argv: list[str]) -> int:
    from pagedserve.bench.throughput import machine

    p = argparse.ArgumentParser(prog="python -m benchmarks kv_fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64, help="requests of the accuracy run")
    p.add_argument("--accuracy-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's dtype in the accuracy run; the baseline pool has it (bfloat16: a 16-bit KV)")
    p.add_argument("--kinds", default="fp8,fp8_e5m2", help="fp8 pools compared for accuracy")
    p.add_argument("--close-top", type=int, default=CLOSE_TOP,
                   help="top logprobs of the close count (vLLM's fp8 tests: 8; 2: divergences that swap the top two)")
    p.add_argument("--kv-cache-memory", default="16MiB", help="the throughput workload's KV memory")
    p.add_argument("--tp-requests", type=int, default=32, help="requests of the throughput workload")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request, throughput workload")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args(argv)
    result: dict[str, object] = {"bench": "kv_fp8", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                                 "torch": torch.__version__}
    if not args.skip_accuracy:
        acc = accuracy(args.requests, args.accuracy_tokens, args.kinds.split(","), args.dtype, args.close_top)
        result["accuracy"], result["accuracy_dtype"] = acc, args.dtype
        print(f"greedy, {args.requests} requests x {args.accuracy_tokens} tokens, SmolLM2 {args.dtype}, "
              f"vs a {args.dtype} KV pool")
        top = args.close_top
        print(f"{'kv dtype':<10}{'identical':>12}{'close@' + str(top):>12}{'mean |dlp|':>12}{'max |dlp|':>12}")
        for kind, r in acc.items():
            print(f"{kind:<10}{r['identical_count']:>8}/{r['requests']:<3}{r['close_count']:>8}/{r['requests']:<3}"
                  f"{r['mean_abs_dlogprob']:>12.2e}{r['max_abs_dlogprob']:>12.2e}")
        print(f"close@{top}: identical, or at the first difference each token is in the other's top {top} "
              f"(vLLM's check_logprobs_close)")
    if not args.skip_throughput:
        tp = throughput(args.kv_cache_memory, args.tp_requests, args.tokens, args.rounds)
        result["throughput"] = tp
        print(f"KV-limited: {args.tp_requests} requests x {args.tokens} tokens, --kv-cache-memory {args.kv_cache_memory}")
        for k, s in tp["seconds"].items():  # type: ignore[union-attr]
            print(f"{'fp32' if k == 'auto' else k:<10} rounds {', '.join(f'{x:.1f}' for x in s)} s, "
                  f"{tp['tokens_per_s'][k]:.1f} tok/s")  # type: ignore[index]
        print(f"ratio fp8 / fp32 KV: {tp['ratio']:.2f}x")
    print(json.dumps(result))
    return 0
