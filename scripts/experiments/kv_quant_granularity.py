"""Which one-byte KV formats could give greedy tokens identical to an fp32 KV
pool on SmolLM2 for 90 % of requests? (issue 23, acceptance 4)

An emulation, independent of our fp8 kernels: K and V are rounded to a format
and back before the cache write into an fp32 pool (the torch path, layer by layer;
the compiled stack and cache write are switched off so the rounding can sit
before the write), then the same
64 requests x 16 greedy tokens as ``pagedserve bench kv_fp8`` are compared with
an unrounded run. Formats:

  e4m3 / e5m2       scale 1.0 (our --kv-cache-dtype fp8 / fp8_e5m2, vLLM's default)
  .../layer         one scale per layer from the first prefill's absmax over 200
                    for K and 100 for V (vLLM's --calculate-kv-scales constants)
  .../tokhead       a scale per (token, KV head): absmax onto the format's largest
                    value (what vLLM 0.32 calls fp8_per_token_head)
  .../gN            a scale per N channels of a (token, KV head)
  int8/tokhead      symmetric int8, absmax per (token, KV head) (int8_per_token_head)
  uint8/tokhead     asymmetric 8 bits, min and max per (token, KV head) (LMDeploy's int8 KV)
  bf16 / fp16       for scale: a 16-bit pool
  rot+...           rounded after a normalized Hadamard rotation of each head's
                    channels and rotated back (QuaRot's idea: q.k and p.v are
                    unchanged when q and the output are rotated too, so a
                    kernel could keep the rotated K and V)
  smooth+...        a per-(layer, KV head, channel) mean of the first prefill
                    subtracted before rounding and added back after (SageAttention's
                    smoothing; for K a kernel need not add it back, since q.b is the
                    same for every key and softmax ignores it)
  sinkN+...         the first N positions of each sequence kept unrounded (the
                    attention sink; a kernel would need a side buffer for them)

    .venv/bin/python scripts/experiments/kv_quant_granularity.py [K,V ...] [--second-set] [--tokens N]
"""
from __future__ import annotations

from typing import Any

import argparse

import torch

from pagedserve.bench import kv_fp8
from pagedserve.gpuworker import cpu_fused, layers
from pagedserve.kernels import cpu_ops

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
# (K, V) pairs; None leaves that side unrounded.
CASES: list[tuple[str | None, str | None]] = [
    ("bf16", "bf16"), ("e4m3", "e4m3"), ("e4m3/layer", "e4m3/layer"), ("e4m3/tokhead", "e4m3/tokhead"),
    ("e4m3/tokhead", "e4m3"), ("e4m3", "e4m3/tokhead"), ("e4m3/g16", "e4m3/tokhead"),
    ("e5m2/tokhead", "e5m2/tokhead"), ("int8/tokhead", "int8/tokhead"), ("int8/tokhead", None),
    ("fp16", "fp16"), ("rot+e4m3", "rot+e4m3"), ("rot+e4m3/tokhead", "rot+e4m3/tokhead"),
    ("sink1+e4m3", "sink1+e4m3"), ("sink16+e4m3", "sink16+e4m3"), ("smooth+e4m3", "smooth+e4m3"),
    ("smooth+e4m3", None), ("smooth+rot+e4m3", "e4m3"), ("uint8/tokhead", "uint8/tokhead"),
    ("rot+int8/tokhead", "rot+int8/tokhead"), ("rot+int8/tokhead", "int8/tokhead"),
    ("rot+int8/tokhead", "e4m3/tokhead"), ("rot+int8/tokhead", None),
]
plain_forward = layers.PagedAttention.forward
plain_forward_rotary = layers.PagedAttention.forward_rotary
current: dict[str, str | None] = {"k": None, "v": None}
step_positions: dict[str, torch.Tensor] = {}
calls = {"n": 0}  # the patched attention's calls: none means the model ran another path
layer_scales: dict[tuple[int, str], float] = {}
layer_means: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(n: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of order ``n`` (a power of 2)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def round_trip(x: torch.Tensor, num_kv_heads: int, fmt: str, key: tuple[int, str]) -> torch.Tensor:
    """``x`` [tokens, heads * dim] rounded to ``fmt`` and back, with the
    ``rot+`` and ``sinkN+`` prefixes applied around it."""
    head, plus, rest = fmt.partition("+")
    if plus and head == "rot":
        t = x.float().view(x.shape[0], num_kv_heads, -1)
        h = hadamard(t.shape[-1])
        return (round_trip((t @ h).reshape(x.shape), num_kv_heads, rest, key).float().view_as(t) @ h.T).view_as(x).to(x.dtype)
    if plus and head == "smooth":
        t = x.float().view(x.shape[0], num_kv_heads, -1)
        if key not in layer_means:  # the first call of the layer: the first prefill
            layer_means[key] = t.mean(0, keepdim=True)
        b = layer_means[key]
        return (round_trip((t - b).reshape(x.shape), num_kv_heads, rest, key).float().view_as(t) + b).view_as(x).to(x.dtype)
    if plus and head.startswith("sink"):
        keep = (step_positions["p"] < int(head[4:])).view(-1, *([1] * (x.dim() - 1)))
        return torch.where(keep, x, round_trip(x, num_kv_heads, rest, key))
    t = x.float().view(x.shape[0], num_kv_heads, -1)
    if fmt in ("bf16", "fp16"):
        return t.to(torch.bfloat16 if fmt == "bf16" else torch.float16).float().view_as(x).to(x.dtype)
    base, _, how = fmt.partition("/")
    if base == "uint8":  # asymmetric: min and max of each (token, head) onto 0 .. 255
        lo, hi = t.amin(-1, keepdim=True), t.amax(-1, keepdim=True)
        s = (hi - lo).clamp_min(1e-12) / 255.0
        return (torch.round((t - lo) / s).clamp(0, 255) * s + lo).view_as(x).to(x.dtype)
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


def forward_rotary(self: layers.PagedAttention, qkv: torch.Tensor, positions: torch.Tensor, *a: Any) -> torch.Tensor:
    step_positions["p"] = positions
    return plain_forward_rotary(self, qkv, positions, *a)


def forward(self: layers.PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
            meta: Any) -> torch.Tensor:
    calls["n"] += 1
    if current["k"] is not None:
        k = round_trip(k, self.num_kv_heads, current["k"], (id(self), "k"))
    if current["v"] is not None:
        v = round_trip(v, self.num_kv_heads, current["v"], (id(self), "v"))
    return plain_forward(self, q, k, v, kv_cache, meta)


def main() -> None:
    # Layer by layer, and the cache write in torch, so the rounding sits before it.
    cpu_fused.FusedStack.build = classmethod(lambda *a: None)  # type: ignore[assignment]
    cpu_ops.rope_and_cache = lambda *a, **k: False  # type: ignore[assignment]
    layers.PagedAttention.forward = forward  # type: ignore[method-assign]
    layers.PagedAttention.forward_rotary = forward_rotary  # type: ignore[method-assign]
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", metavar="K,V", help="formats of K and V (fp32: unrounded); default: CASES")
    ap.add_argument("--second-set", action="store_true", help="prompts 64-127 of kv_fp8.prompts, not 0-63")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    cases = [tuple(None if f == "fp32" else f for f in a.split(",")) for a in args.cases] or CASES
    batch = kv_fp8.prompts(128)[64:] if args.second_set else kv_fp8.prompts(64)
    with torch.inference_mode():
        base = kv_fp8.greedy("auto", batch, args.tokens)
        for k_fmt, v_fmt in cases:
            current["k"], current["v"] = k_fmt, v_fmt
            layer_scales.clear()
            layer_means.clear()
            calls["n"] = 0
            r = kv_fp8.compare(base, kv_fp8.greedy("auto", batch, args.tokens))
            if calls["n"] == 0:
                raise RuntimeError("the model never called the patched attention: nothing was rounded")
            print(f"K {k_fmt or 'fp32'}, V {v_fmt or 'fp32'}: {r['identical_count']}/{r['requests']} identical, mean |dlogprob| "
                  f"{r['mean_abs_dlogprob']:.4f}, max {r['max_abs_dlogprob']:.3f}", flush=True)


if __name__ == "__main__":
    main()
