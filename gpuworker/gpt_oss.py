"""gpt-oss (``GptOssForCausalLM``) over a flat token batch, exact against
transformers' ``modeling_gpt_oss``.

The MoE decoder of moe.py with gpt-oss's parts: Q/K/V/O biases; a learned
sink logit per head in the attention softmax; sliding (``sliding_window``)
and full layers alternating (``layer_types``); YaRN RoPE, its attention
factor scaling cos and sin (layers.RotaryEmbedding); a biased router whose
softmax covers the top-k logits only; biased experts with a clamped SwiGLU,
their gate and up columns interleaved in the checkpoint (moe_layer.FusedMoE
de-interleaves them at load).

Tensor parallelism: each rank keeps its query heads and their sinks, the KV
heads they read, and its slice of every expert's intermediate columns (the
expert down biases are added once, by rank 0, before the all-reduce).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.distributed import TPGroup, head_range
from pagedserve.gpuworker.layers import AttentionMetadata, PagedAttention, RotaryEmbedding
from pagedserve.gpuworker.linear import RowParallelLinear, WeightLoader, qkv_linear
from pagedserve.gpuworker.moe import _MoeForCausalLM
from pagedserve.gpuworker.moe_layer import Activation, FusedMoE, Routing

KVCache = tuple[torch.Tensor, torch.Tensor]


class GptOssAttention(nn.Module):
    """Column-parallel biased QKV, paged attention with this rank's heads'
    sinks (and this layer's window), row-parallel biased output projection.
    The signature is LlamaAttention's, which LlamaDecoderLayer builds."""

    def __init__(self, cfg: Any, head_dim: int, qkv_bias: bool, o_bias: bool, tp: TPGroup,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        total_heads, total_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q0, self.num_heads, _, self.num_kv_heads = head_range(total_heads, total_kv, tp)
        self.qkv_proj = qkv_linear(cfg.hidden_size, head_dim, total_heads, total_kv, qkv_bias, tp)
        self.o_proj = RowParallelLinear(total_heads * head_dim, cfg.hidden_size,
                                        (self.q0 * head_dim, self.num_heads * head_dim), o_bias, tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5,
                                   sliding_window=sliding_window, sinks=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn.forward_rotary(self.qkv_proj(x), positions, rotary, kv_cache, meta))


def topk_softmax(top_k: int) -> Routing:
    """gpt-oss routing: the top k router logits, then a softmax over those k
    (in the logits' dtype, as transformers)."""

    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), ids

    return route


def clamped_swiglu(alpha: float, limit: float) -> Activation:
    """[S, 2 I] (gate half, then up half) -> [S, I]: gate clamped above, up
    clamped both ways, (up + 1) * gate * sigmoid(alpha * gate)."""

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


class GptOssForCausalLM(_MoeForCausalLM):
    attention = GptOssAttention
    renames = ((".mlp.router.", ".mlp.gate."),)
    expert_layout = {"transposed": True, "interleaved": True}

    def make_mlp(self, cfg: Any, layer: int, tp: TPGroup) -> nn.Module:
        k = cfg.num_experts_per_tok
        return FusedMoE(cfg.num_local_experts, k, cfg.hidden_size, cfg.intermediate_size, tp, bias=True,
                        router_bias=True, routing=topk_softmax(k),
                        activation=clamped_swiglu(float(cfg.swiglu_alpha), float(cfg.swiglu_limit)))

    def load_experts(self, name: str, tensor: torch.Tensor, loader: WeightLoader) -> bool:
        """The experts (interleaved gate/up columns), and each rank's heads' sinks."""
        if super().load_experts(name, tensor, loader):
            return True
        parts = name.split(".")
        if parts[-1] != "sinks":
            return False
        attn = self.get_submodule(".".join(parts[:-1]))  # [all heads] -> this rank's, on the attention layer
        if tuple(tensor.shape) != (self.cfg.num_attention_heads,):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}")
        loader.load(f"{'.'.join(parts[:-1])}.attn.sinks", tensor.narrow(0, attn.q0, attn.num_heads))
        return True
