"""Two more tries at fp8 KV greedy tokens close to an fp32 KV pool's (issue 23,
acceptance 4), torch path, the same 64 requests x 16 greedy tokens as
``pagedserve bench kv_fp8``:

rotation   FlashAttention-3's incoherent processing: q, k and v times an
           orthogonal R = diag(random signs) H / sqrt(d) (H: Sylvester
           Hadamard, per head) before the cache write, the output times R^T.
           Exact in real arithmetic (q R . k R = q . k); it spreads channels
           whose large values would meet e4m3's relative error together.
exact      the first ``--exact-blocks`` blocks of each sequence kept unrounded
           (an fp32 pool, every later K/V rounded to e4m3 and back): how much
           of the error comes from the first tokens, which attention leans on.

    .venv/bin/python scripts/experiments/fp8_kv_rotation.py --seeds 0,1,2,3 --exact-blocks 0,1,2
"""
from __future__ import annotations

import argparse
from typing import Any

import torch

from pagedserve.bench import kv_fp8
from pagedserve.gpuworker import layers
from pagedserve.kernels import cpu_ops

plain_forward = layers.PagedAttention.forward
state: dict[str, Any] = {"rotation": None, "exact_blocks": None, "blocks_per_seq": 0}


def hadamard_rotation(d: int, seed: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1
    return (signs[:, None] * h / d**0.5).float()


def forward(self: layers.PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
            meta: Any) -> torch.Tensor:
    if state["exact_blocks"] is not None:  # block tables are contiguous per sequence (kv_fp8.batch_runner)
        exact = ((meta.slot_mapping.long() // 16) % state["blocks_per_seq"] < state["exact_blocks"])[:, None, None]
        k = torch.where(exact, k, k.to(torch.float8_e4m3fn).to(k.dtype))
        v = torch.where(exact, v, v.to(torch.float8_e4m3fn).to(v.dtype))
    r = state["rotation"]
    if r is None:
        return plain_forward(self, q, k, v, kv_cache, meta)
    out = plain_forward(self, q @ r, k @ r, v @ r, kv_cache, meta)
    return (out.view(out.shape[0], self.num_heads, self.head_dim) @ r.T).reshape(out.shape[0], -1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,3", help="sign vectors of the rotation")
    p.add_argument("--exact-blocks", default="0,1,2")
    args = p.parse_args()
    cpu_ops.rope_and_cache = lambda *a, **k: False  # type: ignore[assignment]  # the torch write, after our forward
    layers.PagedAttention.forward = forward  # type: ignore[method-assign]
    batch = kv_fp8.prompts(64)
    state["blocks_per_seq"] = -(-(max(len(x) for x in batch) + 16) // 16)
    with torch.inference_mode():
        base = kv_fp8.greedy("auto", batch, 16)
        runs = [("fp8 e4m3, no rotation", "fp8", None)]
        runs += [(f"fp8 e4m3, rotation seed {s}", "fp8", int(s)) for s in args.seeds.split(",")]
        runs += [("fp32 pool, rotation seed 0 (control)", "auto", 0)]
        for label, kind, seed in runs:
            state["rotation"] = None if seed is None else hadamard_rotation(64, seed)
            r = kv_fp8.compare(base, kv_fp8.greedy(kind, batch, 16))
            print(f"{label}: {r['identical_count']}/64 identical, mean |dlogprob| {r['mean_abs_dlogprob']:.3f}, "
                  f"max {r['max_abs_dlogprob']:.2f}", flush=True)
        state["rotation"] = None
        for n in (int(x) for x in args.exact_blocks.split(",")):
            state["exact_blocks"] = n
            r = kv_fp8.compare(base, kv_fp8.greedy("auto", batch, 16))
            print(f"e4m3 rounding, first {n} blocks exact: {r['identical_count']}/64 identical, mean |dlogprob| "
                  f"{r['mean_abs_dlogprob']:.3f}", flush=True)


if __name__ == "__main__":
    main()
