"""GPT-2 over a flat token batch: learned positions, pre-LayerNorm blocks,
GELU (tanh) MLP; its Conv1D checkpoint weights are stored [in, out], so they
are transposed into ordinary linear layers at load time."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.distributed import SINGLE, TPGroup, head_range, split_range
from pagedserve.gpuworker.layers import AttentionMetadata, LayerNorm, PagedAttention
from pagedserve.gpuworker.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, WeightLoader, qkv_linear

KVCache = tuple[torch.Tensor, torch.Tensor]
_ACTS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, tp: TPGroup) -> None:
        super().__init__()
        h = cfg.hidden_size
        heads, self.head_dim = cfg.num_attention_heads, h // cfg.num_attention_heads
        q0, self.num_heads, _, _ = head_range(heads, heads, tp)
        scale = self.head_dim**-0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= layer_idx + 1
        inner = cfg.n_inner or 4 * h
        self.ln_1 = LayerNorm(h, eps=cfg.layer_norm_epsilon)
        self.c_attn = qkv_linear(h, self.head_dim, heads, heads, True, tp)
        self.attn_c_proj = RowParallelLinear(h, h, (q0 * self.head_dim, self.num_heads * self.head_dim), True, tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, scale)
        self.ln_2 = LayerNorm(h, eps=cfg.layer_norm_epsilon)
        self.c_fc = ColumnParallelLinear.split(h, [inner], True, tp)
        self.mlp_c_proj = RowParallelLinear(inner, h, split_range(inner, tp), True, tp)
        self.act = _ACTS[cfg.activation_function]

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.c_attn(self.ln_1(x)[0]).chunk(3, dim=-1))
        x = x + self.attn_c_proj(self.attn(q, k, v, kv_cache, meta))
        return x + self.mlp_c_proj(self.act(self.c_fc(self.ln_2(x)[0])))


class GPT2LMHeadModel(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if cfg.activation_function not in _ACTS:
            raise ValueError(f"unsupported GPT-2 activation {cfg.activation_function!r}")
        if getattr(cfg, "reorder_and_upcast_attn", False):
            raise ValueError("GPT-2 with reorder_and_upcast_attn is not supported")
        self.cfg = cfg
        self.num_layers, self.total_kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads = head_range(cfg.num_attention_heads, cfg.num_attention_heads, tp)[3]  # this rank's
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_epsilon)

    def init_buffers(self, max_position: int, device: torch.device) -> None:
        pass

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.wte.logits(hidden)  # GPT-2 always ties the LM head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # tied head; old checkpoints' causal-mask buffers
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            name = name.replace(".attn.c_attn.", ".c_attn.").replace(".attn.c_proj.", ".attn_c_proj.")
            name = name.replace(".mlp.c_fc.", ".c_fc.").replace(".mlp.c_proj.", ".mlp_c_proj.")
            if ".c_attn." in name:  # Q, K and V stacked in one checkpoint tensor
                for shard, part in enumerate(tensor.chunk(3, dim=0)):
                    loader.load(name, part, shard)
            else:
                loader.load(name, tensor)
        loader.finish()
