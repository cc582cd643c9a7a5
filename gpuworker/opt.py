"""OPT (the paper's model) over a flat token batch: learned positions (offset
by 2), LayerNorm before (or, for opt-350m, after) each block, ReLU MLP, biases
everywhere, optional project_in/out when word_embed_proj_dim != hidden_size."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.layers import AttentionMetadata, LayerNorm, PagedAttention, check_loaded, copy_weight

KVCache = tuple[torch.Tensor, torch.Tensor]
_ACTS = {"relu": F.relu, "gelu": F.gelu}
POSITION_OFFSET = 2  # OPT's learned position table starts at row 2


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, cfg.enable_bias
        self.num_heads, self.head_dim = cfg.num_attention_heads, h // cfg.num_attention_heads
        self.qkv_proj = nn.Linear(h, 3 * h, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)
        affine = cfg.layer_norm_elementwise_affine
        self.self_attn_layer_norm = LayerNorm(h, elementwise_affine=affine)
        self.final_layer_norm = LayerNorm(h, elementwise_affine=affine)
        self.fc1 = nn.Linear(h, cfg.ffn_dim, bias=bias)
        self.fc2 = nn.Linear(cfg.ffn_dim, h, bias=bias)
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
    stacked = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2))

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if cfg.activation_function not in _ACTS:
            raise ValueError(f"unsupported OPT activation {cfg.activation_function!r}")
        self.cfg = cfg
        self.num_layers, self.num_kv_heads = cfg.num_hidden_layers, cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        proj = cfg.word_embed_proj_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, proj)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        self.project_in = nn.Linear(proj, cfg.hidden_size, bias=False) if proj != cfg.hidden_size else None
        self.project_out = nn.Linear(cfg.hidden_size, proj, bias=False) if proj != cfg.hidden_size else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        final = cfg.do_layer_norm_before and not getattr(cfg, "_remove_final_layer_norm", False)
        self.final_layer_norm = LayerNorm(cfg.hidden_size, elementwise_affine=cfg.layer_norm_elementwise_affine) if final else None
        self.tie = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = None if self.tie else nn.Linear(proj, cfg.vocab_size, bias=False)

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
        return F.linear(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        size = self.cfg.hidden_size
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if self.tie and name == "lm_head.weight":
                continue
            name = name.replace(".self_attn.out_proj.", ".out_proj.")
            for fused, src, shard in self.stacked:
                if f".self_attn.{src}." in name:
                    target = name.replace(f".self_attn.{src}.", f".{fused}.")
                    copy_weight(params, target, tensor, shard * size, size)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                copy_weight(params, name, tensor)
                loaded.add(name)
        check_loaded(params, loaded, {"qkv_proj": 3})
