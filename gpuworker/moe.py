"""Mixture-of-experts families over a flat token batch: Qwen3-MoE and Mixtral.

Both are Llama-shaped decoders (pre-norm, fused QKV, neox RoPE, GQA) whose
MLP is a ``FusedMoE`` (moe_layer.py): Qwen3-MoE has Qwen3's attention (an
RMSNorm per head on q and k before RoPE, qwen3.py) and keeps a dense MLP on the layers that
``mlp_only_layers`` / ``decoder_sparse_step`` name; Mixtral slides every
layer's attention over ``sliding_window`` tokens. The experts load from
either checkpoint layout: transformers 5's fused 3-D ``experts.gate_up_proj``
/ ``experts.down_proj``, or one tensor per expert (what ``save_pretrained``
writes, and older checkpoints: gate_proj/up_proj/down_proj or w1/w3/w2).
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.gpuworker.distributed import SINGLE, TPGroup, head_range
from pagedserve.gpuworker.layers import AttentionMetadata, RMSNorm, RotaryEmbedding, layer_sliding_window
from pagedserve.gpuworker.linear import VocabParallelEmbedding, WeightLoader
from pagedserve.gpuworker.llama import KVCache, LlamaAttention, LlamaDecoderLayer, LlamaMLP, _rope_params, load_checkpoint
from pagedserve.gpuworker.moe_layer import FusedMoE, expert_entries, softmax_topk
from pagedserve.gpuworker.qwen3 import Qwen3Attention

__all__ = ["FusedMoE", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "softmax_topk"]

class _MoeForCausalLM(nn.Module):
    """The shared decoder; subclasses say which layers are sparse and how they route."""

    attention: type[LlamaAttention] = LlamaAttention
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint substring -> ours
    expert_layout: dict[str, bool] = {}  # expert_entries' transposed / interleaved, for the fused 3-D tensors

    def __init__(self, cfg: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {type(self).__name__} (only silu)")
        self.cfg = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.total_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.num_kv_heads = head_range(cfg.num_attention_heads, self.total_kv_heads, tp)[3]  # this rank's
        self.num_layers = cfg.num_hidden_layers
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.head_dim, attn_bias, attn_bias, False, tp, layer_sliding_window(cfg, i),
                              self.attention, self.make_mlp(cfg, i, tp))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if self.tie else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary: RotaryEmbedding | None = None  # built after weights are materialized

    def make_mlp(self, cfg: Any, layer: int, tp: TPGroup) -> nn.Module:
        raise NotImplementedError

    def init_buffers(self, max_position: int, device: torch.device) -> None:
        params = _rope_params(self.cfg)
        params.pop("partial_rotary_factor", None)  # as llama.py: these families turn whole heads
        self.rotary = RotaryEmbedding(self.head_dim, max_position, params,
                                      max_position_embeddings=getattr(self.cfg, "max_position_embeddings", None)).to(device)

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
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights, self.load_experts, self.renames)

    def load_experts(self, name: str, tensor: torch.Tensor, loader: WeightLoader) -> bool:
        """An MoE block's expert tensors, in either checkpoint layout (moe_layer.expert_entries)."""
        m = re.fullmatch(r"(layers\.\d+\.mlp)\.(.+)", name)
        entries = expert_entries(m.group(2), tensor, **self.expert_layout) if m else None
        if m is None or entries is None:
            return False
        for param, part, shard in entries:
            loader.load(f"{m.group(1)}.{param}", part, shard)
        return True


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    """Qwen3's attention (q/k norm); sparse layers per mlp_only_layers and
    decoder_sparse_step, top-k weights renormalized when norm_topk_prob."""

    attention = Qwen3Attention

    def make_mlp(self, cfg: Any, layer: int, tp: TPGroup) -> nn.Module:
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        sparse = (layer not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
                  and (layer + 1) % step == 0)
        if not sparse:
            return LlamaMLP(cfg.hidden_size, cfg.intermediate_size, False, tp)
        k = cfg.num_experts_per_tok
        return FusedMoE(cfg.num_experts, k, cfg.hidden_size, cfg.moe_intermediate_size, tp,
                        routing=softmax_topk(k, renormalize=bool(cfg.norm_topk_prob)))


class MixtralForCausalLM(_MoeForCausalLM):
    """Every layer sparse, top-k weights renormalized (kept in float32, as
    transformers does); the checkpoint's ``block_sparse_moe`` is our ``mlp``."""

    renames = ((".block_sparse_moe.", ".mlp."),)

    def make_mlp(self, cfg: Any, layer: int, tp: TPGroup) -> nn.Module:
        k = cfg.num_experts_per_tok
        return FusedMoE(cfg.num_local_experts, k, cfg.hidden_size, cfg.intermediate_size, tp,
                        routing=softmax_topk(k, renormalize=True, float32_weights=True))
