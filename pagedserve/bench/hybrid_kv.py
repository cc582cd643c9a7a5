"""How many sequences fit at once with a hybrid KV cache (issue 38).

Runs the real scheduler (``EngineCore``) and block manager in-process over
the simulated worker (``SimWorker``, validating: every group's table must
read back each query's tokens), for a Gemma-3-shaped model (one full KV
cache group, five sliding ones of window W), with contexts of ``ctx_mult``
x W. The same ``--num-gpu-blocks`` (the same KV memory) is served twice:
with one table for every layer (full caching, ``--disable-hybrid-kv-cache-manager``),
and with KV cache groups (the pool is then G times the blocks of one group's
layers). Reported: the most sequences running at once, and the most whose
context was at least ``ctx_mult`` x W at that moment (prompts of ``ctx_mult`` x W
tokens, then ``max_tokens`` decoded; prefill in chunks of ``max_num_batched_tokens``).

    python -m pagedserve.bench.hybrid_kv [--window 32] [--num-gpu-blocks 129]

``--serve MODEL``: the throughput of the same kind of workload (prompts of
``ctx_mult`` x the model's window, all sent at once) through the real four
processes, with and without the hybrid cache at the same ``--num-gpu-blocks``,
in ``--rounds`` interleaved rounds with a fresh server each; the median ratio.
"""
from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass

from pagedserve.blockmgr.hybrid import make_block_manager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.sim_worker import SimWorker, expected_output
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient
from pagedserve.scheduler.sequence import SeqStatus


@dataclass
class FitResult:
    mode: str
    pool_blocks: int  # the blockmgr's usable blocks
    max_running: int  # sequences running at once, at most
    max_full_context: int  # of those, at once, whose context reached ctx_mult x W
    preemptions: int
    steps: int
    prefix_cache_hits: int = 0


def run(hybrid: bool, *, window: int = 32, block_size: int = 8, num_gpu_blocks: int = 129, ctx_mult: int = 8,
        num_requests: int = 48, max_tokens: int = 64, num_sliding: int = 5, swap: bool = False,
        prefix_caching: bool = True, seed: int = 0, chunk: int = 128, shared: int = 0,
        async_scheduling: bool = False) -> FitResult:
    windows = (0,) + (window,) * num_sliding
    G = len(windows)
    ctx = ctx_mult * window
    cfg = EngineConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, max_num_seqs=256,
                       max_num_batched_tokens=chunk, max_model_len=ctx + max_tokens, enable_prefix_caching=prefix_caching,
                       preemption_mode="swap" if swap else "recompute", swap_space=1 if swap else 0,
                       async_scheduling="on" if async_scheduling else "off")
    # The worker's pool for the same memory: G times the blocks of one group's layers (model_runner.init).
    blocks = (num_gpu_blocks - 1) * G + 1 if hybrid else num_gpu_blocks
    cpu = (64 * G if hybrid else 64) if swap else 0
    worker = SimWorker(blocks, block_size, cpu, vocab_size=500, max_model_len=ctx + max_tokens, validate=True,
                       kv_group_windows=windows if hybrid else ())
    core = EngineCore(cfg, InProcessBlockClient(lambda i: make_block_manager(i)), InProcessWorkerClient(worker))
    rng = random.Random(seed)
    common = [rng.randrange(1, 500) for _ in range(shared)]  # a prefix every prompt shares
    jobs = [common + [rng.randrange(1, 500) for _ in range(ctx - shared)] for _ in range(num_requests)]
    for i, p in enumerate(jobs):
        core.handle(AddRequest(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               0.0))
    sch = core.scheduler
    out: dict[str, list[int]] = {}
    max_running = max_full = 0
    for _ in range(100_000):
        if not core.has_work():
            break
        for d in core.step():
            out[d.request_id] = out.get(d.request_id, []) + d.token_ids
        live = [s for g in sch.running for s in g.live_seqs if s.status is SeqStatus.RUNNING]
        max_running = max(max_running, len(live))
        max_full = max(max_full, sum(1 for s in live if s.num_computed_tokens >= ctx))
    for i, p in enumerate(jobs):  # the simulated model's output, whatever was preempted
        assert out[f"r{i}"] == expected_output(p, max_tokens, 500), f"r{i}"
    mgr = core.blockmgr.manager  # type: ignore[attr-defined]
    mgr.check_integrity()
    st = mgr.stats()
    assert st.num_free_gpu_blocks == st.num_gpu_blocks and st.num_seqs == 0
    hits = st.prefix_cache_hits
    return FitResult("hybrid KV cache groups" if hybrid else "one table (full caching)", st.num_gpu_blocks,
                     max_running, max_full, sch.num_preemptions, sch.num_steps, hits)


def serve_throughput(model: str, *, ctx_mult: int, num_requests: int, max_tokens: int, num_gpu_blocks: int,
                     rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Output tok/s per round, hybrid and one table, rounds interleaved, a fresh server each."""
    from transformers import AutoConfig

    from pagedserve.bench.throughput import run_engine

    window = int(AutoConfig.from_pretrained(model).sliding_window)
    rng = random.Random(seed)
    jobs = [[rng.randrange(1, 500) for _ in range(ctx_mult * window)] for _ in range(num_requests)]
    args = ["--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", str(num_gpu_blocks), "--max-num-seqs", "256"]
    tps: dict[str, list[float]] = {"hybrid": [], "one table": []}
    for r in range(rounds):
        for mode in (("hybrid", "one table") if r % 2 == 0 else ("one table", "hybrid")):
            extra = ["--disable-hybrid-kv-cache-manager"] if mode == "one table" else []
            seconds = run_engine(model, jobs, max_tokens, args + extra)
            tps[mode].append(num_requests * max_tokens / seconds)
            print(f"  round {r + 1} {mode}: {tps[mode][-1]:.1f} tok/s", flush=True)
    return tps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-gpu-blocks", type=int, default=129)
    p.add_argument("--ctx-mult", type=int, default=8)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--swap", action="store_true")
    p.add_argument("--serve", metavar="MODEL", help="throughput through the real processes on this model folder")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if a.serve:
        tps = serve_throughput(a.serve, ctx_mult=a.ctx_mult, num_requests=a.num_requests, max_tokens=a.max_tokens,
                               num_gpu_blocks=a.num_gpu_blocks, rounds=a.rounds)
        ratios = [h / o for h, o in zip(tps["hybrid"], tps["one table"])]
        print(f"{a.serve}: {a.num_requests} requests of {a.ctx_mult} x the window, {a.max_tokens} tokens each, "
              f"--num-gpu-blocks {a.num_gpu_blocks}; hybrid / one table per round: "
              f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {statistics.median(ratios):.2f}x")
        return
    res = [run(h, window=a.window, block_size=a.block_size, num_gpu_blocks=a.num_gpu_blocks, ctx_mult=a.ctx_mult,
               num_requests=a.num_requests, swap=a.swap, chunk=a.max_num_batched_tokens) for h in (False, True)]
    print(f"SIMULATED worker (real scheduler and blockmgr): window {a.window}, block {a.block_size}, contexts {a.ctx_mult * a.window} tokens, "
          f"--num-gpu-blocks {a.num_gpu_blocks}, --max-num-batched-tokens {a.max_num_batched_tokens}")
    for r in res:
        print(f"  {r.mode:28s} pool {r.pool_blocks:5d} blocks: at most {r.max_running:3d} running, "
              f"{r.max_full_context:3d} at full context at once; {r.preemptions} preemptions, {r.steps} steps")
    print(f"  ratio (full context at once): {res[1].max_full_context / max(1, res[0].max_full_context):.2f}x")


if __name__ == "__main__":
    main()
