"""Layers shared by the model families: norms, rotary embedding, the paged
attention layer, and the per-step attention metadata they all read.

Every layer works on a flat batch: ``[num_tokens, ...]`` with the tokens of all
scheduled sequences concatenated (no padding), as in the paper's engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionBackend, cpu_ops, get_attention_backend
from pagedserve.kernels.fp8 import unit_scale


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and which cached K/V each sequence reads.

    slot_mapping    int64 [num_tokens]: block * block_size + offset
    block_tables    int32 [num_seqs, max_blocks]
    seq_lens        int32 [num_seqs]: cached tokens including this step's
    query_start_loc int32 [num_seqs + 1]
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    max_query_len: int


def layer_sliding_window(cfg: Any, layer: int) -> int | None:
    """Layer ``layer``'s sliding window, or None for full attention: transformers
    5's ``layer_types`` where the config has them (Gemma 3, gpt-oss, Qwen2/3 with
    use_sliding_window), else the config's one window for every layer (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return int(window) if types[layer] == "sliding_attention" else None
    return int(window)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, new residual); with ``residual`` given, adds it first
        (the fused add+norm of every pre-norm decoder layer). On the CPU path
        one compiled pass, which writes the sum into ``residual``."""
        fused = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        if residual is not None:
            x = x + residual
        residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype), residual


class LayerNorm(nn.LayerNorm):
    """LayerNorm with the same (x, residual) -> (normed, residual) interface."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        if residual is not None:
            x = x + residual
        return super().forward(x), x


def _rope_inv_freq(dim: int, params: dict[str, Any], max_position: int) -> torch.Tensor:
    base = float(params.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params.get("original_max_position_embeddings", max_position))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a precomputed cos/sin cache indexed by
    each token's absolute position, so chunks and decodes need no offsets."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = _rope_inv_freq(head_dim, params, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, head_dim / 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the pool through the slot mapping, then
    attends from the pool through the block tables (new tokens included).
    ``k_scale`` / ``v_scale``: this layer's fp8 KV scales (kernels/fp8.py; 1.0,
    on the pool's device, set by the runner), unused by unquantized pools.

    ``sliding_window`` (this layer's, None for a full layer), ``softcap`` and
    ``sinks`` (a learned logit per head of this rank, loaded as ``sinks``)
    are what some families add; ``kernels/reference.py`` defines them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
                 sliding_window: int | None = None, softcap: float | None = None, sinks: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.backend: AttentionBackend = get_attention_backend("torch", "cpu")  # the runner sets the real one
        self.k_scale, self.v_scale = unit_scale("cpu"), unit_scale("cpu")
        self.sliding_window, self.softcap = sliding_window, softcap
        self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32)) if sinks else None
        self.extras: dict[str, Any] = {}  # only the features this layer uses reach the backend
        if sliding_window is not None:
            self.extras["sliding_window"] = sliding_window
        if softcap is not None:
            self.extras["softcap"] = softcap

    def forward_rotary(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q, k and v packed in the rows of ``qkv`` (a fused projection's
        output): rotary embedding, cache write, attention. The CPU path does
        the first two in one compiled pass and reads q in place."""
        n, q_size, kv_size = qkv.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        k_cache, v_cache = kv_cache
        if self.backend.name == "torch" and cpu_ops.rope_and_cache(
            qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, rotary.cos, rotary.sin,
            k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale,
        ):
            return self._attend(qkv[:, :q_size].view(n, self.num_heads, self.head_dim), kv_cache, meta)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = rotary(positions, q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim))
        return self(q, k, v.view(n, self.num_kv_heads, self.head_dim), kv_cache, meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        self.backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return self._attend(q, kv_cache, meta)

    def _attend(self, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        out = self.backend.paged_attention(
            q, kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale,
            max_seq_len=meta.max_seq_len, max_query_len=meta.max_query_len, k_scale=self.k_scale, v_scale=self.v_scale,
            **self.extras, **({} if self.sinks is None else {"sinks": self.sinks}),
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    fused = cpu_ops.silu_and_mul(x)
    if fused is not None:
        return fused
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
