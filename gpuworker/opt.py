"""OPT (the paper's model) over a flat token batch: learned positions (offset
by 2), LayerNorm before (or, for opt-350m, after) each block, ReLU MLP, biases
everywhere, optional project_in/out when word_embed_proj_dim != hidden_size."""
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
_ACTS = {"relu": F.relu, "gelu": F.gelu}
POSITION_OFFSET = 2  # OPT's learned position table starts at row 2


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, cfg.enable_bias
        heads, self.head_dim = cfg.num_attention_heads, h // cfg.num_attention_heads
        q0, self.num_heads, _, _ = head_range(heads, heads, tp)
        self.qkv_proj = qkv_linear(h, self.head_dim, heads, heads, bias, tp)
        self.out_proj = RowParallelLinear(h, h, (q0 * self.head_dim, self.num_heads * self.head_dim), bias, tp)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)
        affine = cfg.layer_norm_elementwise_affine
        self.self_attn_layer_norm = LayerNorm(h, elementwise_affine=affine)
        self.final_layer_norm = LayerNorm(h, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear.split(h, [cfg.ffn_dim], bias, tp)
        self.fc2 = RowParallelLinear(cfg.ffn_dim, h, split_range(cfg.ffn_dim, tp), bias, tp)
        self.act = _ACTS[cfg.activation_function]
        self.pre_norm = cfg.do_layer_norm_before

    def forward(self, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        h = self.self_attn_layer_norm(x)[0] if self.pre_norm else x
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.qkv_proj(h).chunk(3, dim=-1))
        x = x + self.out_proj(self.attn(q, k, v, kv_cache, meta))
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)[0]
        h = self.final_layer_norm(x)[0] if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_norm else self.final_layer_norm(x)[0]


class OPTForCausalLM(nn.Module):
    stacked = {"q_proj": 0, "k_proj": 1, "v_proj": 2}  # shards of qkv_proj

    def __init__(self, cfg: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if cfg.activation_function not in _ACTS:
            raise ValueError(f"unsupported OPT activation {cfg.activation_function!r}")
        self.cfg = cfg
        self.num_layers, self.total_kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.num_kv_heads = head_range(cfg.num_attention_heads, cfg.num_attention_heads, tp)[3]  # this rank's
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        proj = cfg.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, proj, tp)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        self.project_in = nn.Linear(proj, cfg.hidden_size, bias=False) if proj != cfg.hidden_size else None
        self.project_out = nn.Linear(cfg.hidden_size, proj, bias=False) if proj != cfg.hidden_size else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        final = cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, elementwise_affine=cfg.layer_norm_elementwise_affine) if final else None
        self.tie = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = None if self.tie else VocabParallelEmbedding(cfg.vocab_size, proj, tp)

    def init_buffers(self, max_position: int, device: torch.device) -> None:
        pass

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)[0]
        return self.project_out(x) if self.project_out is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if self.tie and name == "lm_head.weight":
                continue
            name = name.replace(".self_attn.out_proj.", ".out_proj.")
            parts = name.split(".")
            if len(parts) >= 3 and parts[-3] == "self_attn" and parts[-2] in self.stacked:
                loader.load(".".join(parts[:-3] + ["qkv_proj", parts[-1]]), tensor, self.stacked[parts[-2]])
            else:
                loader.load(name, tensor)
        loader.finish()
