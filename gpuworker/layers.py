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
    # A hybrid KV cache: every group's metadata (this one is group 0's); a
    # layer with ``PagedAttention.kv_group`` set reads its group's.
    groups: list["AttentionMetadata"] | None = None


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
    """The inverse frequencies alone (``rope_frequencies`` without its attention factor)."""
    return rope_frequencies(dim, params, max_position)[0]


def rope_frequencies(head_dim: int, params: dict[str, Any], max_position: int,
                     max_position_embeddings: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention factor), as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them from ``rope_parameters``.

    ``max_position`` is the longest context served (vLLM's max_model_len):
    LongRoPE picks its long factors once, when it exceeds the original
    context, as vLLM does; transformers instead picks per forward call from
    that call's largest position, which agrees whenever a whole sequence
    stays on one side. ``max_position_embeddings`` is the config's (default
    ``max_position``): LongRoPE and YaRN derive a missing ``factor`` from it."""
    config_max = max_position_embeddings or max_position
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))  # the rotated leading part of each head
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        return _yarn(dim, base, params, config_max)
    if kind == "longrope":
        return _longrope(dim, base, params, max_position, config_max)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params.get("original_max_position_embeddings", config_max))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3, yarn, longrope)")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, params: dict[str, Any], config_max: int) -> tuple[torch.Tensor, float]:
    """transformers' ``_compute_yarn_parameters``, step for step (``truncate``
    defaults to True; gpt-oss ships False)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3 style: the context ratio
        factor = config_max / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # the share of each dimension's unscaled frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(dim: int, base: float, params: dict[str, Any], max_position: int,
              config_max: int) -> tuple[torch.Tensor, float]:
    """transformers' ``_compute_longrope_parameters`` (Phi-3), with the long
    or short factors chosen once from ``max_position`` (see rope_frequencies)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3: the ratio of the extended to the original context
        factor = config_max / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(params["long_factor"] if max_position > original else params["short_factor"], dtype=torch.float32)
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a precomputed cos/sin cache indexed by
    each token's absolute position, so chunks and decodes need no offsets.

    cos and sin carry the scaling's attention factor (YaRN, LongRoPE), as
    transformers multiplies them. ``rotary_dim`` < head_dim (a
    ``partial_rotary_factor``): only each head's leading ``rotary_dim``
    features turn; the fused CPU op rotates whole heads, so such a model must
    rotate through ``forward``. Arguments: see ``rope_frequencies``."""

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any], *,
                 max_position_embeddings: int | None = None) -> None:
        super().__init__()
        inv_freq, scale = rope_frequencies(head_dim, params, max_position, max_position_embeddings)
        self.rotary_dim = 2 * inv_freq.numel()
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)  # [max_position, rotary_dim / 2]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary: the trailing features pass through
        return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
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
        self.kv_group: int | None = None  # a hybrid KV cache's group (set by the runner)
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
        if self.kv_group is not None and meta.groups is not None:
            meta = meta.groups[self.kv_group]
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
        if self.kv_group is not None and meta.groups is not None:
            meta = meta.groups[self.kv_group]
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
