"""Qwen3 (dense): the Llama layer plus an RMSNorm over each query and key head
(``q_norm``/``k_norm``, head_dim weights) before RoPE. ``attention_bias``
(False in every released checkpoint) biases Q/K/V and O as in transformers;
``use_sliding_window`` slides the layers ``layer_types`` marks (from
``max_window_layers`` up), through ``layers.layer_sliding_window``.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.gpuworker.distributed import SINGLE, TPGroup
from pagedserve.gpuworker.layers import AttentionMetadata, RMSNorm, RotaryEmbedding
from pagedserve.gpuworker.llama import KVCache, LlamaAttention, LlamaForCausalLM, rotary_attention


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: Any, head_dim: int, qkv_bias: bool, o_bias: bool, tp: TPGroup,
                 sliding_window: int | None = None) -> None:
        super().__init__(cfg, head_dim, qkv_bias, o_bias, tp, sliding_window)
        # One weight per feature of a head, shared by all heads: replicated on every rank.
        self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        n, d = qkv.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        # Each head normed as a row of its own; the results go back into the fused
        # rows so that RoPE and the cache write stay one pass (forward_rotary).
        q = self.q_norm(qkv[:, :q_size].reshape(n * self.num_heads, d))[0]
        k = self.k_norm(qkv[:, q_size : q_size + kv_size].reshape(n * self.num_kv_heads, d))[0]
        qkv[:, :q_size] = q.view(n, q_size)
        qkv[:, q_size : q_size + kv_size] = k.view(n, kv_size)
        return self.o_proj(rotary_attention(self.attn, qkv, positions, rotary, kv_cache, meta))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention = Qwen3Attention
    fused_stack = False  # the compiled stack has no per-head norms

    def __init__(self, cfg: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, tp)
