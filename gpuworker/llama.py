"""Llama-family forward (Llama, Qwen2, Mistral) over a flat token batch.

Q/K/V and gate/up are fused into one matmul each; the split checkpoint
tensors are copied into their slice of the fused weight at load time. Under
tensor parallelism each rank holds its heads and MLP columns (see linear.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.gpuworker.cpu_fused import FusedStack
from pagedserve.gpuworker.distributed import SINGLE, TPGroup, head_range, split_range
from pagedserve.gpuworker.layers import (
    AttentionMetadata,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    layer_sliding_window,
    silu_and_mul,
)
from pagedserve.gpuworker.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightLoader,
    qkv_linear,
)

KVCache = tuple[torch.Tensor, torch.Tensor]


def _rope_params(cfg: Any) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None)  # transformers 5
    if params is None:  # older configs
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return dict(params)


def rotary_attention(attn: PagedAttention, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                     kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
    """``attn.forward_rotary`` where RoPE turns whole heads; with a partial
    rotary dim (Phi-4-mini) the fused CPU op would turn whole heads, so q and
    k are split out and rotated by ``rotary`` itself."""
    if rotary.rotary_dim == attn.head_dim:
        return attn.forward_rotary(qkv, positions, rotary, kv_cache, meta)
    n, q_size, kv_size = qkv.shape[0], attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = rotary(positions, q.view(n, attn.num_heads, attn.head_dim), k.view(n, attn.num_kv_heads, attn.head_dim))
    return attn(q, k, v.view(n, attn.num_kv_heads, attn.head_dim), kv_cache, meta)


# q/k/v and gate/up checkpoint names -> (fused module, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# A family's own tensors: (our name, tensor, loader) -> True when it loaded them itself.
Special = Callable[[str, torch.Tensor, WeightLoader], bool]


def load_checkpoint(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], special: Special | None = None,
                    renames: tuple[tuple[str, str], ...] = ()) -> None:
    """Every family's checkpoint loop: names without ``model.``, renamed, rotary
    buffers and a tied head skipped, q/k/v and gate/up into their fused
    modules (``model.stacked``), what ``special`` takes, the rest as named."""
    loader = WeightLoader(model)
    stacked: dict[str, tuple[str, int]] = getattr(model, "stacked", STACKED)
    tie = bool(getattr(model, "tie", False))
    for name, tensor in weights:
        name = name.removeprefix("model.")
        for old, new in renames:
            name = name.replace(old, new)
        if "rotary_emb." in name or (tie and name == "lm_head.weight"):
            continue
        if special is not None and special(name, tensor, loader):
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in stacked:
            fused, shard = stacked[parts[-2]]
            loader.load(".".join(parts[:-2] + [fused, parts[-1]]), tensor, shard)
        else:
            loader.load(name, tensor)
    loader.finish()


class LlamaAttention(nn.Module):
    """Column-parallel QKV (this rank's heads), paged attention over this
    rank's KV heads, row-parallel output projection."""

    def __init__(self, cfg: Any, head_dim: int, qkv_bias: bool, o_bias: bool, tp: TPGroup,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        q0, self.num_heads, _, self.num_kv_heads = head_range(total_heads, total_kv, tp)
        self.head_dim = head_dim
        self.qkv_proj = qkv_linear(cfg.hidden_size, head_dim, total_heads, total_kv, qkv_bias, tp)
        self.o_proj = RowParallelLinear(total_heads * head_dim, cfg.hidden_size, (q0 * head_dim, self.num_heads * head_dim), o_bias, tp)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5, sliding_window=sliding_window)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.o_proj(rotary_attention(self.attn, self.qkv_proj(x), positions, rotary, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear.split(hidden, [intermediate, intermediate], bias, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, split_range(intermediate, tp), bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; ``mlp`` replaces the gated MLP (an MoE layer)."""

    def __init__(self, cfg: Any, head_dim: int, qkv_bias: bool, o_bias: bool, mlp_bias: bool, tp: TPGroup,
                 sliding_window: int | None = None, attention: type[LlamaAttention] = LlamaAttention,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attention(cfg, head_dim, qkv_bias, o_bias, tp, sliding_window)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg.hidden_size, cfg.intermediate_size, mlp_bias, tp)
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
    """Llama; Qwen2 is this plus Q/K/V bias; Mistral (and Qwen2 with
    use_sliding_window) add sliding-window layers."""

    stacked = STACKED  # checkpoint name -> (fused module, shard index)

    attention: type[LlamaAttention] = LlamaAttention
    # FusedStack compiles exactly this layer structure; a subclass that changes it sets False.
    fused_stack = True
    # load_checkpoint routes GGUF blocks to the layers as they are (models.build_model).
    quantized_weights = True
    # transformers' Llama/Qwen RoPE turns whole heads whatever partial_rotary_factor says; Phi-3's honours it.
    partial_rotary = False

    def __init__(self, cfg: Any, tp: TPGroup = SINGLE, qkv_bias: bool | None = None) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {type(self).__name__} (only silu)")
        self.cfg = cfg
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.total_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.num_kv_heads = head_range(cfg.num_attention_heads, self.total_kv_heads, tp)[3]  # this rank's
        self.num_layers = cfg.num_hidden_layers
        attn_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = attn_bias if qkv_bias is None else qkv_bias
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.head_dim, qkv_bias, attn_bias, bool(getattr(cfg, "mlp_bias", False)), tp,
                              layer_sliding_window(cfg, i), self.attention, self.make_mlp(cfg, i, tp))
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if self.tie else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary: RotaryEmbedding | None = None  # built after weights are materialized
        self.fused: FusedStack | None = None  # the CPU stack in one call, for the pools it was built over

    def make_mlp(self, cfg: Any, layer: int, tp: TPGroup) -> nn.Module | None:
        """Layer ``layer``'s MLP where it is not the gated one (None): the MoE families' experts."""
        return None

    def init_buffers(self, max_position: int, device: torch.device) -> None:
        params = _rope_params(self.cfg)
        if not self.partial_rotary:
            params.pop("partial_rotary_factor", None)
        self.rotary = RotaryEmbedding(self.head_dim, max_position, params,
                                      max_position_embeddings=getattr(self.cfg, "max_position_embeddings", None)).to(device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        assert self.rotary is not None
        x = self.embed_tokens(input_ids)
        if not self.fused_stack or self.rotary.rotary_dim != self.head_dim:
            self.fused = None  # the compiled stack turns whole heads with the Llama layer
        elif self.fused is None or not self.fused.current(kv_caches):
            self.fused = FusedStack.build(self, kv_caches)
        if self.fused is not None:
            return self.fused.run(x, positions, meta)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, self.rotary, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(self, weights)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, tp, qkv_bias=True)
