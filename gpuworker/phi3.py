"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama layer with the checkpoint's
Q/K/V and gate/up already fused, LongRoPE, an optional partial rotary dim and
an optional sliding window on every layer.

The fused checkpoint tensors are cut into their parts at load time and each
part goes into this rank's shard of our fused layers, so under tensor
parallelism a rank keeps its own heads' rows of q, k and v and its own
columns of gate and up (a contiguous slice of the fused tensor would not be).

LongRoPE: short or long factors are chosen once, as vLLM does, from the
served context (``init_buffers``' ``max_position``) against
``original_max_position_embeddings``; see ``layers.rope_frequencies``.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.gpuworker.distributed import SINGLE, TPGroup
from pagedserve.gpuworker.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    fused_stack = False
    partial_rotary = True  # Phi-4-mini turns 3/4 of each head

    def __init__(self, cfg: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, tp)
        heads, kv = cfg.num_attention_heads, self.total_kv_heads
        self.qkv_sizes = [heads * self.head_dim, kv * self.head_dim, kv * self.head_dim]

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint with qkv_proj and gate_up_proj cut into the Llama names
        (q/k/v_proj, gate/up_proj) that the Llama loader routes to shards."""
        for name, tensor in weights:
            prefix, _, attr = name.rpartition(".")
            if prefix.endswith(".qkv_proj"):
                base = prefix.removesuffix("qkv_proj")
                if tensor.shape[0] != sum(self.qkv_sizes):
                    raise ValueError(f"shape mismatch for {name}: {tuple(tensor.shape)}, want {sum(self.qkv_sizes)} rows")
                for part, t in zip(("q_proj", "k_proj", "v_proj"), tensor.split(self.qkv_sizes)):
                    yield f"{base}{part}.{attr}", t
            elif prefix.endswith(".gate_up_proj"):
                base = prefix.removesuffix("gate_up_proj")
                if tensor.shape[0] % 2:
                    raise ValueError(f"shape mismatch for {name}: {tuple(tensor.shape)} has an odd row count")
                gate, up = tensor.chunk(2)
                yield f"{base}gate_proj.{attr}", gate
                yield f"{base}up_proj.{attr}", up
            else:
                yield name, tensor

    quantized_weights = False  # _unfused splits fused tensors: GGUF blocks arrive dequantized

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._unfused(weights))
