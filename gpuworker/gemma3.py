"""Gemma 3 text forward (Gemma3ForCausalLM, ``gemma3_text``) over a flat token batch.

What differs from Llama, following transformers' modeling_gemma3.py op for op:
the embedding is scaled by sqrt(hidden) in the model dtype; every norm is a
(1 + weight) RMSNorm computed in float32 (also per head on q and k, before
RoPE); each layer norms its attention and MLP outputs before the residual add
(four norms a layer); attention scales by query_pre_attn_scalar ** -0.5;
layers interleave sliding and full attention (``cfg.layer_types``), each kind
with its own RoPE; the MLP is GELU-tanh gated; the final logits may be
softcapped. Tensor parallelism splits heads and MLP columns as llama.py does.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.cpu_fused import FusedStack
from pagedserve.gpuworker.distributed import SINGLE, TPGroup, head_range, split_range
from pagedserve.gpuworker.layers import AttentionMetadata, PagedAttention, RotaryEmbedding, layer_sliding_window
from pagedserve.gpuworker.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, qkv_linear
from pagedserve.gpuworker.llama import load_checkpoint

KVCache = tuple[torch.Tensor, torch.Tensor]

# hidden_activation -> F.gelu's approximate argument (transformers' ACT2FN names)
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
SLIDING, FULL = "sliding_attention", "full_attention"


def rope_params(cfg: Any) -> dict[str, dict[str, Any]]:
    """RoPE parameters per layer type. transformers 5 keeps a dict per type in
    ``rope_parameters``; older configs have ``rope_theta`` + ``rope_scaling``
    for the full layers and ``rope_local_base_freq`` for the sliding ones."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:  # one flat dict (or none): it describes the full layers
        full, local = dict(params or getattr(cfg, "rope_scaling", None) or {}), {}
    full.setdefault("rope_theta", getattr(cfg, "rope_theta", None) or 1_000_000.0)
    local.setdefault("rope_theta", getattr(cfg, "rope_local_base_freq", None) or 10_000.0)
    local.setdefault("rope_type", "default")
    return {FULL: full, SLIDING: local}


def layer_types(cfg: Any) -> list[str]:
    """``cfg.layer_types``, or Gemma 3's default pattern (5 sliding, 1 full)."""
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return list(types)
    pattern = int(getattr(cfg, "sliding_window_pattern", None) or 6)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers)]


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back at the end (transformers'
    Gemma3RMSNorm: not Llama's cast-then-scale). Normalizes the last dim, so it
    serves per head on [T, H, D] as well."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self._scale: tuple[int, int, torch.Tensor] | None = None  # (weight's version, address, 1 + weight)

    def scale(self) -> torch.Tensor:
        """1 + weight in float32, made once per loaded weight: six norms a layer made it
        per call, two of the ~10 small ops each of a decode step's ~100 norms."""
        w = self.weight
        key = (w._version, w.data_ptr())
        if self._scale is None or self._scale[:2] != key:
            self._scale = (*key, 1.0 + w.detach().float())
        return self._scale[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm: x * rsqrt(mean(x^2) + eps) * scale in one op, as the three above it computed
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).to(x.dtype)


class Gemma3Attention(nn.Module):
    """Fused column-parallel QKV (this rank's heads), q/k norms per head, this
    layer kind's RoPE, paged attention, row-parallel output projection."""

    def __init__(self, cfg: Any, head_dim: int, tp: TPGroup, sliding_window: int | None) -> None:
        super().__init__()
        total_heads, total_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        q0, self.num_heads, _, self.num_kv_heads = head_range(total_heads, total_kv, tp)
        self.head_dim = head_dim
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = qkv_linear(cfg.hidden_size, head_dim, total_heads, total_kv, bias, tp)
        self.o_proj = RowParallelLinear(total_heads * head_dim, cfg.hidden_size, (q0 * head_dim, self.num_heads * head_dim), bias, tp)
        self.q_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, cfg.rms_norm_eps)
        # No softcap here although the config has attn_logit_softcapping: transformers'
        # Gemma 3 stores it but never hands it to its attention (eager or sdpa), and no
        # released Gemma 3 sets it; test_family_gemma3 checks transformers still ignores it.
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, float(cfg.query_pre_attn_scalar) ** -0.5,
                                   sliding_window=sliding_window)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, d))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, d))
        q, k = rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(n, self.num_kv_heads, d), kv_cache, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, approximate: str, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(hidden, [intermediate, intermediate], False, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, split_range(intermediate, tp), False, tp)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate=self.approximate) * up)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: each sublayer's input and output are normed; the
    residual stream stays in the model dtype, as in transformers."""

    def __init__(self, cfg: Any, head_dim: int, approximate: str, tp: TPGroup, sliding_window: int | None) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, head_dim, tp, sliding_window)
        self.mlp = Gemma3MLP(hidden, cfg.intermediate_size, approximate, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self.self_attn(positions, self.input_layernorm(x), rotary, kv_cache, meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text models (270M, 1B; the text stack of the larger ones)."""

    quantized_weights = True  # load_checkpoint takes GGUF blocks as they are
    fused_kind = "gemma3"  # the compiled CPU stack's layer (cpu_fused.py)

    def __init__(self, cfg: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"
        if act not in _GELU:
            raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3 (supported: {', '.join(_GELU)})")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not a causal LM; not supported")
        self.cfg = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.total_kv_heads = cfg.num_key_value_heads
        self.num_kv_heads = head_range(cfg.num_attention_heads, self.total_kv_heads, tp)[3]  # this rank's
        self.num_layers = cfg.num_hidden_layers
        self.tie = bool(getattr(cfg, "tie_word_embeddings", True))
        self.final_softcap: float | None = getattr(cfg, "final_logit_softcapping", None)
        self.layer_types = layer_types(cfg)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, self.head_dim, _GELU[act], tp, layer_sliding_window(cfg, i))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if self.tie else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary: dict[str, RotaryEmbedding] = {}  # per layer type, built after weights are materialized
        self.fused: FusedStack | None = None  # the CPU stack in one call, for the pools it was built over

    def init_buffers(self, max_position: int, device: torch.device) -> None:
        self.rotary = {kind: RotaryEmbedding(self.head_dim, max_position, p).to(device) for kind, p in rope_params(self.cfg).items()}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to float32, then to the model dtype (bf16: 6.9375 for 48), as
        # transformers' scaled embedding does; a Python float keeps it a kernel argument
        return x * torch.tensor(self.cfg.hidden_size**0.5).to(x.dtype).item()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.fused is None or not self.fused.current(kv_caches):
            self.fused = FusedStack.build(self, kv_caches)
        if self.fused is not None:
            return self.fused.run(x, positions, meta)
        for layer, kind, kv_cache in zip(self.layers, self.layer_types, kv_caches):
            x = layer(positions, x, self.rotary[kind], kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        if self.final_softcap is not None:  # in the logits' dtype, step by step as transformers does
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights)
