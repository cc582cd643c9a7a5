"""``pagedserve bench blockmgr``: step round-trip latency of the block manager.

A synthetic trace of sequence lifetimes (ShareGPT-like lengths; each step
frees the finished sequences, appends one token to every running one, and
admits replacements, a tenth of them as parallel-sampling pairs via Fork and
a third of them behind a shared 64-token system prompt, so prefix-cache hits
happen) keeps a fixed number of sequences running. The same pre-built
``StepRequest`` list is replayed against ``BlockManager.step`` in this
process and against the real ``pagedserve blockmgr`` process over ZeroMQ
IPC; the final stats of both must agree. Reported: p50/p99/mean round trip
and sequence-steps per second (running sequences x steps / time).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import zmq

from pagedserve.bench.workloads import machine_info, sharegpt_like
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.ipc import ReqClient
from pagedserve.common.messages.blockmgr import (
    Ack,
    Allocate,
    Append,
    BlockStats,
    ErrorReply,
    Fork,
    Free,
    InitRequest,
    Reply,
    ResetRequest,
    StatsRequest,
    StepReply,
    StepRequest,
)

BLOCK_SIZE = 16
SYSTEM_PROMPTS = [[10_000 + 97 * k + j for j in range(64)] for k in range(4)]


def build_trace(num_running: int, num_steps: int, seed: int) -> tuple[list[StepRequest], int]:
    """Step requests keeping ``num_running`` sequences alive, and a GPU pool
    size that never runs out (the trace does not depend on replies)."""
    rng = random.Random(seed)
    lengths = iter(sharegpt_like(num_running * 4 + num_steps * num_running // 50 + 64, seed))
    next_id = 0
    remaining: dict[int, int] = {}  # seq -> tokens still to generate
    steps: list[StepRequest] = []
    for _ in range(num_steps):
        ops: list = []
        for seq in [s for s, left in remaining.items() if left == 0]:
            ops.append(Free(seq))
            del remaining[seq]
        for seq in remaining:
            ops.append(Append(seq, [rng.randrange(32000)]))
            remaining[seq] -= 1
        while len(remaining) < num_running:
            req = next(lengths)
            prompt = [rng.randrange(32000) for _ in range(req.prompt_len)]
            if rng.random() < 1 / 3:
                prompt = SYSTEM_PROMPTS[rng.randrange(4)] + prompt
            ops.append(Allocate(next_id, prompt, len(prompt)))
            remaining[next_id] = req.output_len
            next_id += 1
            if rng.random() < 0.1 and len(remaining) < num_running:
                ops.append(Fork(next_id - 1, next_id))
                remaining[next_id] = max(1, req.output_len // 2)
                next_id += 1
        steps.append(StepRequest(ops))
    num_gpu_blocks = num_running * (2048 + 64 + BLOCK_SIZE) // BLOCK_SIZE + 2
    return steps, num_gpu_blocks


def _percentile(sorted_s: list[float], q: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))]


def _summary(times: list[float], seq_steps: int) -> dict[str, float]:
    s = sorted(times)
    return {
        "p50_us": _percentile(s, 0.50) * 1e6,
        "p99_us": _percentile(s, 0.99) * 1e6,
        "mean_us": sum(s) / len(s) * 1e6,
        "seq_steps_per_s": seq_steps / sum(s),
    }


def run_in_process(steps: list[StepRequest], num_gpu_blocks: int, warmup: int) -> tuple[dict, BlockStats]:
    mgr = BlockManager(num_gpu_blocks, 0, BLOCK_SIZE)
    gc.collect()
    gc.freeze()  # the pool's blocks live forever, as in the service
    times = []
    seq_steps = 0
    perf = time.perf_counter
    for i, req in enumerate(steps):
        t = perf()
        mgr.step(req)
        dt = perf() - t
        if i >= warmup:
            times.append(dt)
            seq_steps += sum(1 for op in req.ops if type(op) is Append)
    gc.unfreeze()
    return _summary(times, seq_steps), mgr.stats()


def run_ipc(client: ReqClient, steps: list[StepRequest], num_gpu_blocks: int, warmup: int) -> tuple[dict, BlockStats]:
    assert client.call(InitRequest(num_gpu_blocks, 0, BLOCK_SIZE), timeout_s=60) == Ack()
    gc.collect()
    gc.freeze()
    times = []
    seq_steps = 0
    perf = time.perf_counter
    for i, req in enumerate(steps):
        t = perf()
        reply = client.call(req, timeout_s=30)
        dt = perf() - t
        if not isinstance(reply, StepReply):
            raise RuntimeError(f"blockmgr answered {reply!r}")
        if i >= warmup:
            times.append(dt)
            seq_steps += sum(1 for op in req.ops if type(op) is Append)
    gc.unfreeze()
    stats = client.call(StatsRequest(), timeout_s=30)
    assert client.call(ResetRequest(), timeout_s=30) == Ack()
    assert isinstance(stats, BlockStats)
    return _summary(times, seq_steps), stats


def start_blockmgr(addr: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "blockmgr", "--blockmgr-addr", addr],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench blockmgr", description=__doc__.split("\n\n")[0])
    p.add_argument("--running", default="32,256,1024", help="comma-separated running-sequence counts")
    p.add_argument("--steps", type=int, default=400, help="measured steps per count")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured first steps (the initial admissions)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    counts = [int(x) for x in args.running.split(",")]

    run_dir = tempfile.mkdtemp(prefix="pagedserve-bench-")
    addr = f"ipc://{run_dir}/blockmgr.sock"
    proc = start_blockmgr(addr)
    ctx = zmq.Context()
    client: ReqClient = ReqClient(ctx, addr, Reply)
    rows = []
    try:
        first = client.call(StatsRequest(), timeout_s=60)  # waits for the process to come up
        assert isinstance(first, ErrorReply), first
        for n in counts:
            steps, num_blocks = build_trace(n, args.steps + args.warmup, args.seed)
            local, local_stats = run_in_process(steps, num_blocks, args.warmup)
            remote, remote_stats = run_ipc(client, steps, num_blocks, args.warmup)
            if local_stats != remote_stats:
                raise RuntimeError(f"in-process and IPC runs disagree: {local_stats} vs {remote_stats}")
            rows.append({
                "running": n,
                "steps": args.steps,
                "in_process": local,
                "ipc": remote,
                "ipc_over_in_process_p50": remote["p50_us"] / local["p50_us"],
                "prefix_hit_rate": local_stats.prefix_cache_hits / max(1, local_stats.prefix_cache_queries),
            })
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
        ctx.term()
        os.rmdir(run_dir) if os.path.isdir(run_dir) and not os.listdir(run_dir) else None

    machine = machine_info()
    print(f"blockmgr step round trip, {machine}")
    print(f"{'running':>8} {'mode':>10} {'p50 us':>9} {'p99 us':>9} {'mean us':>9} {'seq-steps/s':>12}")
    for r in rows:
        for mode in ("in_process", "ipc"):
            m = r[mode]
            print(f"{r['running']:>8} {mode:>10} {m['p50_us']:>9.1f} {m['p99_us']:>9.1f} {m['mean_us']:>9.1f} "
                  f"{m['seq_steps_per_s']:>12.0f}")
        print(f"{'':>8} {'ipc/in-proc p50':>21} {r['ipc_over_in_process_p50']:.2f}x, "
              f"prefix hit rate {r['prefix_hit_rate']:.1%}")
    print(json.dumps({"bench": "blockmgr", "machine": machine, "block_size": BLOCK_SIZE, "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
