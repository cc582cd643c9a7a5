"""``pagedserve bench sharing``: KV blocks saved by sharing (paper Fig. 15).

Parallel sampling with n outputs per request: our ``BlockManager`` allocates
the prompt once and forks it n-1 times; each sample then generates its own
output (sample 0 has the request's output length, the others independent
draws from the same workload), copying the shared last prompt block on its
first write. The saturated serving loop is the one of ``bench memory``
(every request arrives at once, FCFS admission, recompute preemption).

At every step where requests wait we read ``BlockStats``: the blocks in use
and ``num_shared_block_refs`` (references beyond the first, i.e. blocks a
sharing-free allocator would need on top). Saving = shared refs / (used +
shared refs), summed over the steps, as in the paper ("blocks saved /
blocks needed without sharing").

Beam search (``--decoding beam``) is measured on real runs of a model through
the engine core, where every step forks the surviving beams and frees the
pruned ones (``bench/sharing_beam.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from pagedserve.bench.memory import POOL_SLOTS, simulate_paged
from pagedserve.bench.workloads import MAX_MODEL_LEN, RequestLen, machine_info, sample_lengths
from pagedserve.bench.sharing_beam import beam_saving
from pagedserve.blockmgr.manager import BlockManager

PAPER = {  # saving %, OPT-13B
    ("parallel", "alpaca"): {2: 6.09, 4: 8.53, 6: 9.79},
    ("parallel", "sharegpt"): "16.2-30.5",
    ("beam", "alpaca"): {2: 37.56, 4: 53.13, 6: 55.16},
    ("beam", "sharegpt"): "44.3-66.3",
}


def parallel_sampling(workload: str, reqs: list[RequestLen], n: int, seed: int) -> dict[str, float]:
    extra = iter(sample_lengths(workload, len(reqs) * (n - 1), seed + 7919 * n))
    outs = [[r.output_len] + [min(next(extra).output_len, MAX_MODEL_LEN - r.prompt_len) for _ in range(n - 1)]
            for r in reqs]
    used = shared = 0

    def on_sample(mgr: BlockManager) -> None:
        nonlocal used, shared
        st = mgr.stats()
        used += st.num_gpu_blocks - st.num_free_gpu_blocks
        shared += st.num_shared_block_refs

    tally = simulate_paged(reqs, sample_lens=outs, on_sample=on_sample)
    return {
        "saving_pct": 100.0 * shared / max(1, used + shared),
        "mean_groups": tally.running / max(1, tally.steps),
        "preemptions": tally.preemptions,
    }


# decoding -> (workload, requests, width, seed) -> figures; beam search plugs in here
DECODINGS: dict[str, Callable[[str, list[RequestLen], int, int], dict[str, float]]] = {
    "parallel": parallel_sampling,
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench sharing", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="alpaca,sharegpt")
    p.add_argument("--widths", default="2,4,6", help="samples per request")
    p.add_argument("--decoding", default="parallel", choices=sorted([*DECODINGS, "beam"]))
    p.add_argument("--num-requests", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="beam: HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--beam-requests", type=int, default=4, help="beam: requests per workload (real model runs)")
    p.add_argument("--beam-max-output", type=int, default=48, help="beam: cap on output lengths (CPU time)")
    args = p.parse_args(argv)
    widths = [int(x) for x in args.widths.split(",")]
    simulated = args.decoding != "beam"
    results: dict[str, dict[str, dict[str, float]]] = {}
    for w in args.workloads.split(","):
        if args.decoding == "beam":
            results[w] = {str(n): beam_saving(args.model, w, n, args.beam_requests, args.beam_max_output, args.seed)
                          for n in widths}
        else:
            reqs = sample_lengths(w, args.num_requests, args.seed)
            results[w] = {str(n): DECODINGS[args.decoding](w, reqs, n, args.seed) for n in widths}

    machine = machine_info()
    how = (f"simulated; {machine}" if simulated else
           f"real model runs, {args.beam_requests} requests per workload, outputs capped at {args.beam_max_output} "
           f"tokens; {machine}")
    print(f"blocks saved by sharing, {args.decoding} decoding, block size 16 ({how})")
    print(f"{'workload':>9} {'n':>3} {'saving':>8} {'paper':>11} {'groups':>7} {'preempt':>8}")
    for w, by_n in results.items():
        paper = PAPER.get((args.decoding, w))
        for n, r in by_n.items():
            ref = paper.get(int(n)) if isinstance(paper, dict) else paper
            ref_s = f"{ref:.2f}%" if isinstance(ref, float) else f"{ref}%" if ref else "-"
            groups = f"{r['mean_groups']:>7.2f}" if "mean_groups" in r else f"{'-':>7}"
            print(f"{w:>9} {n:>3} {r['saving_pct']:>7.2f}% {ref_s:>11} {groups} {r.get('preemptions', '-'):>8}")
    print("paper: Figure 15 / section 6.3 (OPT-13B); its ShareGPT figure is a range over widths")
    print(json.dumps({"bench": "sharing", "simulated": simulated, "decoding": args.decoding, "machine": machine,
                      "pool_slots": POOL_SLOTS if simulated else None, "seed": args.seed,
                      "num_requests": args.num_requests if simulated else args.beam_requests,
                      "results": results,
                      "paper": {f"{d}/{w}": v for (d, w), v in PAPER.items() if d == args.decoding}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
