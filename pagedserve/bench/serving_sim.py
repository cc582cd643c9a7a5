"""``pagedserve bench serving-sim``: the paper's Figures 12 and 13, SIMULATED.

Poisson arrivals of ShareGPT-like or Alpaca-like requests (the generators
of ``bench memory``) are served by the REAL scheduler (``EngineCore`` and
``Scheduler``, in this process) with a SIMULATED worker whose step times
come from the OPT-13B / A100-40GB cost model (``gpuworker.sim_worker``):
the clock is simulated, advanced by each step's modelled time, and nothing
sleeps. The systems differ only in their KV memory manager:

* ``paged`` (ours): the real ``BlockManager`` (block size 16, no prefix
  caching: the prompts are distinct, as in the paper's traces);
* ``orca_max`` / ``orca_pow2`` / ``orca_oracle``: ``ContiguousBlockManager``
  (a buddy allocator over the same 15,728 slots), same scheduler;
* ``ft_static``: FasterTransformer-like static batching: the earliest
  arrived requests, up to the largest batch that fits at 2048 slots each
  (7), are admitted together and no request joins until all have finished.

Each request generates exactly its sampled output length (``ignore_eos``).
Every rate point simulates the same span of arrivals (``--duration``,
default 600 s, so rate x 600 requests): past a system's capacity the queue,
and so the latency, grows with the span, and a fixed request count would
give the high rates a shorter span to fall behind in. Reported per rate: normalized latency (mean over requests of end-to-end
latency / output length, s/token) and mean batch size (sequences per step
while requests arrive); per system, the highest rate it sustains under the
latency threshold (linear interpolation between the grid's rates).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pagedserve.bench.contiguous import ContiguousBlockManager
from pagedserve.bench.workloads import RequestLen, machine_info, poisson_arrivals, sample_lengths
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.sim_worker import CostModel, SimWorker
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

BLOCK_SIZE = 16
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 2048
SYSTEMS = ("paged", "orca_max", "orca_pow2", "orca_oracle", "ft_static")
LABELS = {"paged": "ours (paged)", "orca_max": "Orca-Max", "orca_pow2": "Orca-Pow2",
          "orca_oracle": "Orca-Oracle", "ft_static": "FT-static"}
RATES = {  # req/s; each includes the paper's Figure 13 rate
    "sharegpt": [0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5],
    "alpaca": [2.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0, 45.0, 50.0, 60.0],
}
QUICK_RATES = {"sharegpt": [0.5, 2.0], "alpaca": [10.0, 30.0]}
DURATION_S = 600.0  # of arrivals per rate point: the same horizon at every rate
QUICK_DURATION_S = {"sharegpt": 40.0, "alpaca": 4.0}
FIG13_RATE = {"sharegpt": 2.0, "alpaca": 30.0}
PAPER_BATCH = {  # Figure 13, OPT-13B, mean batch size
    "sharegpt": {"orca_max": 7.00, "orca_pow2": 9.81, "orca_oracle": 13.62, "paged": 30.42},
    "alpaca": {"orca_max": 7.00, "orca_pow2": 43.24, "orca_oracle": 72.75, "paged": 132.44},
}
PAPER_RATIO_VS_ORACLE = (1.7, 2.7)  # ShareGPT, vLLM over Orca-Oracle
THRESHOLD = 0.4  # s/token, normalized latency: our stand-in for the paper's knee


@dataclass
class Point:
    system: str
    workload: str
    rate: float
    num_requests: int
    normalized_latency: float  # s/token
    mean_latency: float  # s
    mean_batch: float  # sequences per step while requests arrive
    throughput: float  # finished requests per simulated second
    steps: int
    preemptions: int
    simulated_s: float
    wall_s: float


class _TimedWorker(InProcessWorkerClient):
    """Passes the modelled step time and batch size to the driver."""

    def __init__(self, runner: SimWorker) -> None:
        super().__init__(runner)
        self.step_time: float | None = None
        self.batch = 0
        self.on_step: Callable[[wk.ExecuteStep], None] | None = None

    def call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply:
        if self.on_step is not None and isinstance(req, wk.ExecuteStep):
            self.on_step(req)
        rep = super().call(req, timeout_s)
        if isinstance(rep, wk.StepResult):
            assert isinstance(req, wk.ExecuteStep)
            self.step_time = rep.forward_time_s
            self.batch = len(req.scheduled)
        return rep


def prompt_for(index: int, length: int) -> list[int]:
    """A distinct prompt whose first token names its request (the contiguous
    managers look the true lengths up by it)."""
    return [index] + [1 + (index * 31 + j) % 50_000 for j in range(length - 1)]


def build_engine(system: str, reqs: list[RequestLen], cost: CostModel,
                 validate: bool = False, paged_attention_factor: float = 1.0) -> tuple[EngineCore, _TimedWorker]:
    num_blocks = cost.kv_slots // BLOCK_SIZE + 1  # + the null block
    if system == "paged":
        cost = dataclasses.replace(cost, attention_kv_factor=cost.attention_kv_factor * paged_attention_factor)
    worker = _TimedWorker(SimWorker(num_blocks, BLOCK_SIZE, 0, vocab_size=50_272, max_model_len=2048,
                                    validate=validate, cost_model=cost))
    if system == "paged":
        def factory(init: bm.InitRequest) -> BlockManager:
            return BlockManager(init.num_gpu_blocks, init.num_cpu_blocks, init.block_size,
                                init.enable_prefix_caching, init.watermark)
    else:
        policy = "orca_max" if system == "ft_static" else system

        def factory(init: bm.InitRequest) -> ContiguousBlockManager:  # type: ignore[misc]
            return ContiguousBlockManager(init.num_gpu_blocks, init.block_size, policy, lambda t: reqs[t[0]])
    cfg = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                       preemption_mode="recompute", worker="sim",
                       # ours: the engine defaults (prefix caching, 5 % watermark); the contiguous
                       # managers have no watermark, so the scheduler must not assume one for them
                       kv_watermark=EngineConfig.kv_watermark if system == "paged" else 0.0)
    return EngineCore(cfg, InProcessBlockClient(factory), worker), worker


def static_batch_size(cost: CostModel) -> int:
    """FasterTransformer's batch: how many 2048-slot buffers the pool holds
    (on the same buddy allocator as Orca-Max)."""
    from pagedserve.bench.memory import BuddyAllocator

    b = BuddyAllocator(cost.kv_slots // BLOCK_SIZE * BLOCK_SIZE)
    n = 0
    while b.alloc(2048) is not None:
        n += 1
    return n


def simulate(system: str, workload: str, rate: float, num_requests: int, seed: int = 0,
             cost: CostModel | None = None, validate: bool = False,
             on_step: Callable[[float, wk.ExecuteStep, int], None] | None = None,
             paged_attention_factor: float = 1.0) -> Point:
    """One rate point. ``validate`` turns on the sim worker's slot-level
    checks; ``on_step(clock, step, num_finished_before)`` sees every step."""
    cost = cost or CostModel.opt13b_a100()
    reqs = sample_lengths(workload, num_requests, seed)
    arrivals = poisson_arrivals(num_requests, rate, seed + 1)
    core, worker = build_engine(system, reqs, cost, validate, paged_attention_factor)
    if on_step is not None:
        worker.on_step = lambda step: on_step(clock, step, len(finish))
    static = system == "ft_static"
    batch_cap = static_batch_size(cost) if static else num_requests
    t_wall = time.perf_counter()
    clock = 0.0
    nxt = 0  # next request to arrive
    queued: deque[int] = deque()  # arrived, not yet handed to the scheduler (static batching)
    finish: dict[int, float] = {}
    produced = [0] * num_requests
    batch_sum = batch_steps = steps = 0
    last_arrival = arrivals[-1]
    while len(finish) < num_requests:
        while nxt < num_requests and arrivals[nxt] <= clock:
            queued.append(nxt)
            nxt += 1
        if queued and (not static or not core.has_work()):
            for _ in range(min(len(queued), batch_cap)):
                i = queued.popleft()
                r = reqs[i]
                core.handle(AddRequest(str(i), prompt_for(i, r.prompt_len),
                                       SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                                       arrivals[i]))
        if not core.has_work():
            if nxt >= num_requests:
                raise RuntimeError(f"{system}: idle with {num_requests - len(finish)} requests unfinished")
            clock = max(clock, arrivals[nxt])
            continue
        worker.step_time = None
        deltas = core.step()
        if worker.step_time is not None:
            clock += worker.step_time
            steps += 1
            if clock <= last_arrival:
                batch_sum += worker.batch
                batch_steps += 1
        for d in deltas:
            i = int(d.request_id)
            produced[i] += len(d.token_ids)
            if d.finish_reason is not None:
                if d.finish_reason != "length" or produced[i] != reqs[i].output_len:
                    raise RuntimeError(f"{system}: request {i} ended {d.finish_reason!r} after {produced[i]} of "
                                       f"{reqs[i].output_len} tokens: {d.error}")
                finish[i] = clock
    lat = [finish[i] - arrivals[i] for i in range(num_requests)]
    return Point(system, workload, rate, num_requests,
                 normalized_latency=sum(x / r.output_len for x, r in zip(lat, reqs)) / num_requests,
                 mean_latency=sum(lat) / num_requests,
                 mean_batch=batch_sum / max(1, batch_steps),
                 throughput=num_requests / (max(finish.values()) - arrivals[0]),
                 steps=steps, preemptions=core.scheduler.num_preemptions, simulated_s=clock,
                 wall_s=time.perf_counter() - t_wall)


def sustained_rate(points: list[Point], threshold: float) -> tuple[float, str]:
    """Highest rate under ``threshold``, interpolated between the last rate
    under it and the first over it; ("<", ">=" or "=") says if it is a bound."""
    pts = sorted(points, key=lambda p: p.rate)
    if not pts or pts[0].normalized_latency > threshold:
        return (pts[0].rate if pts else 0.0), "<"
    for a, b in zip(pts, pts[1:]):
        if b.normalized_latency > threshold:
            frac = (threshold - a.normalized_latency) / (b.normalized_latency - a.normalized_latency)
            return a.rate + frac * (b.rate - a.rate), "="
    return pts[-1].rate, ">="


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(results: dict[str, list[Point]], thresholds: dict[str, float], path: str) -> None:
    import matplotlib  # optional: main() checks it is there

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (workload, pts) in zip(axes[0], results.items()):
        for system in SYSTEMS:
            sp = sorted((p for p in pts if p.system == system), key=lambda p: p.rate)
            if sp:
                ax.plot([p.rate for p in sp], [p.normalized_latency for p in sp], marker="o", ms=3,
                        label=LABELS[system])
        ax.axhline(thresholds[workload], color="grey", ls=":", lw=1)
        ax.set_ylim(0, 2.5 * thresholds[workload])
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title(f"{workload}-like, OPT-13B / A100 cost model (SIMULATED)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench serving-sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="sharegpt,alpaca")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--rates", default=None, help="comma-separated req/s, for every workload (default: per workload)")
    p.add_argument("--duration", type=float, default=None,
                   help=f"seconds of arrivals per rate point (default {DURATION_S:g}; rate x duration requests)")
    p.add_argument("--threshold", type=float, default=THRESHOLD, help="normalized-latency threshold, s/token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--paged-attention-factor", type=float, default=1.0,
                   help="slow our (paged) system's attention KV reads by this factor, e.g. 1.2 for the paper's "
                        "measured 20-26%% paged-kernel overhead (default 1.0: both at the roofline)")
    p.add_argument("--roofline", action="store_true",
                   help="cost model variant: linear layers take max(weight read, FLOPs) instead of their sum")
    p.add_argument("--plot", default="serving-sim.png", help="PNG path ('' for none)")
    p.add_argument("--quick", action="store_true", help="CI size: two rates, a few seconds of arrivals")
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    systems = args.systems.split(",")
    for s in systems:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {SYSTEMS}")
    cost = dataclasses.replace(CostModel.opt13b_a100(), roofline=args.roofline)
    thresholds = {w: args.threshold for w in workloads}

    results: dict[str, list[Point]] = {}
    durations: dict[str, float] = {}
    for w in workloads:
        rates = ([float(x) for x in args.rates.split(",")] if args.rates
                 else QUICK_RATES[w] if args.quick else RATES[w])
        duration = durations[w] = args.duration or (QUICK_DURATION_S[w] if args.quick else DURATION_S)
        pts: list[Point] = []
        for system in systems:
            over = 0
            for rate in sorted(rates):
                # Past its knee a system only gets slower: after two rates over
                # 3x the threshold, skip the rest (except the Figure 13 rate).
                if over >= 2 and not (rate == FIG13_RATE.get(w) and system != "ft_static"):
                    continue
                pt = simulate(system, w, rate, max(1, round(rate * duration)), args.seed, cost,
                              paged_attention_factor=args.paged_attention_factor)
                pts.append(pt)
                print(f"  [{w} {system} {rate:g} req/s: {pt.normalized_latency:.3f} s/token, "
                      f"batch {pt.mean_batch:.1f}, {pt.steps} steps, {pt.wall_s:.1f} s wall]", file=sys.stderr)
                over = over + 1 if pt.normalized_latency > 3 * thresholds[w] else 0
        results[w] = pts

    machine = machine_info()
    summary: dict[str, dict] = {}
    print(f"serving-sim: SIMULATED worker ({cost.name} cost model"
          + (f", paged attention x{args.paged_attention_factor:g}" if args.paged_attention_factor != 1.0 else "")
          + (", roofline variant" if args.roofline else "")
          + f"), real scheduler + memory managers; {machine}")
    for w, pts in results.items():
        rates = sorted({pt.rate for pt in pts})
        by = {(pt.system, pt.rate): pt for pt in pts}
        duration = durations[w]
        print(f"\n{w}-like, {duration:g} s of Poisson arrivals per rate (rate x {duration:g} requests); "
              f"normalized latency (s/token), SIMULATED")
        print(f"{'system':>13} " + " ".join(f"{r:>7g}" for r in rates))
        for s in systems:
            cells = [by.get((s, r)) for r in rates]
            print(f"{LABELS[s]:>13} " + " ".join(f"{c.normalized_latency:>7.3f}" if c else f"{'-':>7}" for c in cells))
        sustained = {}
        print(f"highest rate under {thresholds[w]} s/token (req/s, interpolated), SIMULATED")
        for s in systems:
            rate, kind = sustained_rate([pt for pt in pts if pt.system == s], thresholds[w])
            sustained[s] = {"rate": rate, "bound": kind}
            print(f"{LABELS[s]:>13} {'' if kind == '=' else kind}{rate:.2f}")
        ratios = {}
        if "paged" in sustained:
            for s in systems:
                if s != "paged" and sustained[s]["rate"] > 0:
                    ratios[s] = sustained["paged"]["rate"] / sustained[s]["rate"]
            print("ours / baseline: " + ", ".join(f"{LABELS[s]} {v:.2f}x" for s, v in ratios.items())
                  + (f"  (paper, ShareGPT: {PAPER_RATIO_VS_ORACLE[0]}-{PAPER_RATIO_VS_ORACLE[1]}x Orca-Oracle, "
                     f"2.7-8x Orca-Max, up to 22x FT)" if w == "sharegpt" else ""))
        fr = FIG13_RATE[w]
        batch = {s: by[(s, fr)].mean_batch for s in systems if (s, fr) in by}
        saturated = {s: max(pt.mean_batch for pt in pts if pt.system == s) for s in systems}
        print("mean batch size (sequences per step while requests arrive), SIMULATED, beside the paper's Fig. 13")
        print(f"{'system':>13} {f'at {fr:g} req/s':>12} {'saturated':>10} {'paper':>7}")
        for s in systems:
            paper = PAPER_BATCH[w].get(s)
            at = f"{batch[s]:.2f}" if s in batch else "-"
            print(f"{LABELS[s]:>13} {at:>12} {saturated[s]:>10.2f} {paper if paper is not None else '-':>7}")
        print(f"  (saturated: the largest mean batch over the rates run; paper: at {fr:g} req/s)")
        summary[w] = {"duration_s": duration, "threshold_s_per_token": thresholds[w], "sustained": sustained,
                      "ratio_vs": ratios, "batch": {"rate": fr, "ours_at_rate": batch, "ours_saturated": saturated,
                                                    "paper_at_rate": PAPER_BATCH[w]}}
    # matplotlib is optional: without it the run still ends with its results, and says so.
    can_plot = bool(args.plot) and _have_matplotlib()
    if args.plot and not can_plot:
        print("bench serving-sim: matplotlib is not installed; no plot (pip install matplotlib)", file=sys.stderr)
    verdict = None
    if "sharegpt" in summary and "orca_oracle" in summary["sharegpt"]["ratio_vs"]:
        ratio = summary["sharegpt"]["ratio_vs"]["orca_oracle"]
        verdict = {"ratio_vs_orca_oracle": ratio, "target": 1.7, "met": ratio >= 1.7}
        print(f"acceptance: ShareGPT-like, ours sustains {ratio:.2f}x Orca-Oracle's rate "
              f"(target >= 1.7x): {'MET' if ratio >= 1.7 else 'NOT MET'} (SIMULATED)")
    print(json.dumps({"bench": "serving-sim", "simulated": True, "machine": machine, "cost_model": asdict(cost),
                      "paged_attention_factor": args.paged_attention_factor,
                      "duration_s": durations, "block_size": BLOCK_SIZE, "max_num_seqs": MAX_NUM_SEQS,
                      "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "seed": args.seed,
                      "plot": args.plot if can_plot else None, "acceptance": verdict, "summary": summary,
                      "points": {w: [asdict(pt) for pt in pts] for w, pts in results.items()}}), flush=True)
    if can_plot:  # after the results are out, so a plotting failure loses nothing
        plot(results, thresholds, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
