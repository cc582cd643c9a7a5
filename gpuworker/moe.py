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

from pagedserve.gpuworker.distributed import TPGroup
from pagedserve.gpuworker.linear import WeightLoader
from pagedserve.gpuworker.llama import LlamaForCausalLM, LlamaMLP, load_checkpoint
from pagedserve.gpuworker.moe_layer import FusedMoE, expert_entries, softmax_topk
from pagedserve.gpuworker.qwen3 import Qwen3Attention

__all__ = ["FusedMoE", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "softmax_topk"]

class _MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder with an MoE as the MLP of its sparse layers (``make_mlp``),
    layer by layer (the compiled stack has no experts)."""

    fused_stack = False
    quantized_weights = False  # load_experts stacks expert tensors: GGUF blocks arrive dequantized
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint substring -> ours
    expert_layout: dict[str, bool] = {}  # expert_entries' transposed / interleaved, for the fused 3-D tensors

    def make_mlp(self, cfg: Any, layer: int, tp: TPGroup) -> nn.Module | None:
        raise NotImplementedError

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
