"""Llama-family forward (Llama, Qwen2, Mistral) over a flat token batch.

Q/K/V and gate/up are fused into one matmul each; the split checkpoint
tensors are copied into their slice of the fused weight at load time.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.layers import (
    AttentionMetadata,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    check_loaded,
    copy_weight,
    silu_and_mul,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


def _rope_params(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None)  # transformers 5
    if params is None:  # older configs
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return dict(params)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        n = x.shape[0]
        q, k = rotary(positions, q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim))
        out = self.attn(q, k, v.view(n, self.num_kv_heads, self.head_dim), kv_cache, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, head_dim, qkv_bias, o_bias)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rotary: RotaryEmbedding,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama; Qwen2 is this plus Q/K/V bias; Mistral adds a sliding window that
    the runner refuses to exceed (max_model_len <= window)."""

    # (fused param, checkpoint name, shard index)
    stacked = (
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, cfg: Any, qkv_bias: bool | None = None) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {type(self).__name__} (only silu)")
        self.cfg = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = attn_bias if qkv_bias is None else qkv_bias
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.head_dim, qkv_bias, attn_bias, bool(getattr(cfg, "mlp_bias", False)))
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if self.tie else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None  # built after weights are materialized

    def init_buffers(self, max_position: int, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.head_dim, max_position, _rope_params(self.cfg)).to(device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        assert self.rotary is not None
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, self.rotary, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def _fused_slice(self, fused: str, shard: int) -> tuple[int, int]:
        a = self.layers[0].self_attn
        if fused == "qkv_proj":
            return [(0, a.q_size), (a.q_size, a.kv_size), (a.q_size + a.kv_size, a.kv_size)][shard]
        inter = self.cfg.intermediate_size
        return (shard * inter, inter)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (self.tie and name == "lm_head.weight"):
                continue
            for fused, src, shard in self.stacked:
                if f".{src}." in name:
                    target = name.replace(f".{src}.", f".{fused}.")
                    start, size = self._fused_slice(fused, shard)
                    copy_weight(params, target, tensor, start, size)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                copy_weight(params, name, tensor, None, None)
                loaded.add(name)
        check_loaded(params, loaded, {f: (3 if f == "qkv_proj" else 2) for f, _, _ in self.stacked})


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: Any) -> None:
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        super().__init__(cfg, qkv_bias=True)
