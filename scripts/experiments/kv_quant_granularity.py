"""Which one-byte KV formats could give greedy tokens identical to an fp32 KV
pool on SmolLM2 for 90 % of requests? (issue 23, acceptance 4)

An emulation, independent of our fp8 kernels: K and V are rounded to a format
and back before the cache write into an fp32 pool (the torch path; the fused
CPU write is switched off so the rounding can sit before it), then the same
64 requests x 16 greedy tokens as ``pagedserve bench kv_fp8`` are compared with
an unrounded run. Formats:

  e4m3 / e5m2       scale 1.0 (our --kv-cache-dtype fp8 / fp8_e5m2, vLLM's default)
  .../layer         one scale per layer from the first prefill's absmax over 200
                    for K and 100 for V (vLLM's --calculate-kv-scales constants)
  .../tokhead       a scale per (token, KV head): absmax onto the format's largest
                    value (what vLLM 0.32 calls fp8_per_token_head)
  .../gN            a scale per N channels of a (token, KV head)
  int8/tokhead      symmetric int8, absmax per (token, KV head) (int8_per_token_head)
  bf16              for scale: a 16-bit pool

    .venv/bin/python scripts/experiments/kv_quant_granularity.py
"""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.bench import kv_fp8
from pagedserve.gpuworker import layers
from pagedserve.kernels import cpu_ops

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
# (K, V) pairs; None leaves that side unrounded.
CASES: list[tuple[str | None, str | None]] = [
    ("bf16", "bf16"), ("e4m3", "e4m3"), ("e4m3/layer", "e4m3/layer"), ("e4m3/tokhead", "e4m3/tokhead"),
    ("e4m3/tokhead", "e4m3"), ("e4m3", "e4m3/tokhead"), ("e4m3/g16", "e4m3/tokhead"),
    ("e5m2/tokhead", "e5m2/tokhead"), ("int8/tokhead", "int8/tokhead"), ("int8/tokhead", None),
]
plain_forward = layers.PagedAttention.forward
current: dict[str, str | None] = {"k": None, "v": None}
layer_scales: dict[tuple[int, str], float] = {}


def round_trip(x: torch.Tensor, num_kv_heads: int, fmt: str, key: tuple[int, str]) -> torch.Tensor:
    """``x`` [tokens, heads * dim] rounded to ``fmt`` and back."""
    t = x.float().view(x.shape[0], num_kv_heads, -1)
    if fmt == "bf16":
        return t.to(torch.bfloat16).float().view_as(x).to(x.dtype)
    base, _, how = fmt.partition("/")
    if base == "int8":
        s = t.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127.0
        return (torch.round(t / s).clamp(-127, 127) * s).view_as(x).to(x.dtype)
    dtype, top = FORMATS[base]
    scale: Any = 1.0
    if how == "layer":
        if key not in layer_scales:  # the first call of the layer: the first prefill
            layer_scales[key] = float(t.abs().amax()) / (200.0 if key[1] == "k" else 100.0)
        scale = layer_scales[key]
    elif how == "tokhead":
        scale = t.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
    elif how.startswith("g"):
        g = t.view(t.shape[0], num_kv_heads, -1, int(how[1:]))
        s = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / top
        return ((g / s).to(dtype).float() * s).reshape(x.shape).to(x.dtype)
    return ((t / scale).clamp(-top, top).to(dtype).float() * scale).view_as(x).to(x.dtype)


def forward(self: layers.PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
            meta: Any) -> torch.Tensor:
    if current["k"] is not None:
        k = round_trip(k, self.num_kv_heads, current["k"], (id(self), "k"))
    if current["v"] is not None:
        v = round_trip(v, self.num_kv_heads, current["v"], (id(self), "v"))
    return plain_forward(self, q, k, v, kv_cache, meta)


def main() -> None:
    cpu_ops.rope_and_cache = lambda *a, **k: False  # type: ignore[assignment]
    layers.PagedAttention.forward = forward  # type: ignore[method-assign]
    batch = kv_fp8.prompts(64)
    with torch.inference_mode():
        base = kv_fp8.greedy("auto", batch, 16)
        for k_fmt, v_fmt in CASES:
            current["k"], current["v"] = k_fmt, v_fmt
            layer_scales.clear()
            r = kv_fp8.compare(base, kv_fp8.greedy("auto", batch, 16))
            print(f"K {k_fmt or 'fp32'}, V {v_fmt or 'fp32'}: {r['identical_count']}/64 identical, mean |dlogprob| "
                  f"{r['mean_abs_dlogprob']:.4f}, max {r['max_abs_dlogprob']:.3f}", flush=True)


if __name__ == "__main__":
    main()
