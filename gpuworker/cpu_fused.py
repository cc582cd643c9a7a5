"""The CPU decoder stack of a Llama-family or Gemma 3 model in one compiled
call (``kernels/cpu_model.cpp``), where the per-op path would make about nine
(Gemma 3: about thirty) Python and torch calls per layer.

``FusedStack.build`` takes it only where every op would have run its compiled
kernel anyway (CPU, float32 or bfloat16, one rank, the torch attention backend,
every linear packed in panels or holding GGUF blocks the int8 kernels packed,
a KV pool the library reads); anywhere else it
returns None and the model runs layer by layer, with the same result bit for
bit (tests/test_cpu_fused.py; GGUF blocks: tests/test_quant_fused.py). Gemma 3's
layer-by-layer path is torch's ops, so there the two agree to rounding
(both are held to transformers in tests/test_family_gemma3.py; the new kernels to float64 in
tests/test_cpu_ops_gemma.py).
``PAGEDSERVE_CPU_FUSED_LAYERS=0`` turns it off.

A stack holds the addresses of the weights, pools and fp8 scales it was built
over, and keeps the objects alive; ``current`` tells whether the model still
points at the same ones (the runner sets backends and scales after building).
"""
from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence
from typing import Any

import torch

from pagedserve.common.env import env_flag
from pagedserve.gpuworker.cpu_gemm import Layout, PackedWeight
from pagedserve.gpuworker.layers import AttentionMetadata
from pagedserve.kernels import cpu_build
from pagedserve.kernels.cpu_attention import DTYPE_CODES, kv_code
from pagedserve.kernels.cpu_layers import (MAX_PARTS, GroupPtrs, LayerPtrs, Linear, StackArgs, addr, llama_stack,
                                            table_addr)
from pagedserve.kernels.quant import packed_parts

ENV = "CPU_FUSED_LAYERS"
KVCache = tuple[torch.Tensor, torch.Tensor]


def _usable(t: torch.Tensor | None, dtype: torch.dtype) -> bool:
    return t is None or (t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous())


def _linear(linear: Any, dtype: torch.dtype) -> Linear | None:
    """The C view of a linear: its bf16/fp32 panels, or its GGUF blocks as the int8 kernels packed
    them (the parts ``linear.py``'s ``_quant_forward`` runs in one call); None: neither."""
    if not _usable(linear.bias, dtype):
        return None
    if getattr(linear, "qweights", None):
        parts = packed_parts(linear.qweights)
        if parts is None or len(parts.packed) > MAX_PARTS:
            return None
        n = len(parts.packed)
        return Linear(data=(*parts.c_packed,), bias=addr(linear.bias), rows=(*parts.rows,), qtypes=(*parts.codes,),
                      parts=n)
    p: PackedWeight | None = linear.packed
    if p is None or p.layout not in (Layout.PANELS, Layout.CODED) or not _usable(p.data, dtype):
        return None
    return Linear(data=(addr(p.data), addr(p.coded)), bias=addr(linear.bias), parts=0)


def _gemma(model: Any) -> bool:
    """Gemma 3's layer: sandwich norms, float32 (1 + w) norm weights, GELU-tanh, RoPE per layer kind."""
    return getattr(model, "fused_kind", "llama") == "gemma3"


def _norm_weight(norm: Any, gemma: bool) -> torch.Tensor:
    return norm.scale() if gemma else norm.weight


def _norms(layer: Any, gemma: bool) -> tuple[Any, ...]:
    """(input, before the MLP, q, k, attention output, MLP output) norms; None where the layer has none."""
    if gemma:
        attn = layer.self_attn
        return (layer.input_layernorm, layer.pre_feedforward_layernorm, attn.q_norm, attn.k_norm,
                layer.post_attention_layernorm, layer.post_feedforward_layernorm)
    return layer.input_layernorm, layer.post_attention_layernorm, None, None, None, None


def _rotaries(model: Any) -> list[Any]:
    """Each layer's RoPE: Gemma 3 keeps one per layer kind."""
    if isinstance(model.rotary, dict):
        return [model.rotary[kind] for kind in model.layer_types]
    return [model.rotary] * model.num_layers


class FusedStack:
    """One model's layers over one set of KV pools, ready to run a step."""

    def __init__(self, model: Any, kv_caches: Sequence[KVCache], layers: Any, keep: list[torch.Tensor],
                 num_groups: int) -> None:
        self.model, self.kv_caches, self.layers, self.keep = model, kv_caches, layers, keep
        # The submodules looked up once: nn.Module's __getattr__ costs about 1 us a lookup.
        self.attns = [layer.self_attn.attn for layer in model.layers]
        self.linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.watched = self._watch()
        self.groups = (GroupPtrs * num_groups)() if num_groups else None
        # What every step shares; run() fills in the batch.
        dtype, k_cache, attn, gemma = model.embed_tokens.weight.dtype, kv_caches[0][0], self.attns[0], _gemma(model)
        self.args = StackArgs(
            dtype=DTYPE_CODES[dtype], kv_dtype=kv_code(dtype, k_cache.dtype), num_layers=model.num_layers,
            hidden=model.cfg.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=model.layers[0].mlp.down_proj.in_features, block_size=k_cache.shape[1],
            gemma=int(gemma), num_groups=num_groups, eps=model.norm.eps, scale=attn.scale, layers=table_addr(layers),
            final_norm=addr(_norm_weight(model.norm, gemma)),
            groups=None if self.groups is None else ctypes.addressof(self.groups),
        )

    def _watch(self) -> list[object]:
        """What a rebuild would read that the runner may swap after building: backends, scales, packings."""
        return ([a.backend for a in self.attns] + [a.k_scale for a in self.attns] + [a.v_scale for a in self.attns]
                + [m.packed for m in self.linears] + [w.packed for m in self.linears for w in m.qweights])

    def current(self, kv_caches: Sequence[KVCache]) -> bool:
        now = self._watch()
        return (kv_caches is self.kv_caches and len(now) == len(self.watched)
                and all(map(operator.is_, now, self.watched)))

    @classmethod
    def build(cls, model: Any, kv_caches: Sequence[KVCache]) -> FusedStack | None:
        dtype, gemma = model.embed_tokens.weight.dtype, _gemma(model)
        rotaries = _rotaries(model)
        if (not env_flag(ENV, True) or model.embed_tokens.weight.device.type != "cpu" or dtype not in DTYPE_CODES
                or model.embed_tokens.tp.size != 1 or len(kv_caches) != model.num_layers
                or not all(_usable(r.cos, torch.float32) and _usable(r.sin, torch.float32)
                           and r.rotary_dim == model.head_dim for r in rotaries)
                or cpu_build.load() is None):
            return None
        eps, pool, norm_dtype = model.norm.eps, kv_caches[0][0], torch.float32 if gemma else dtype
        ptrs = (LayerPtrs * model.num_layers)()
        keep: list[torch.Tensor] = []  # Gemma's (1 + w) tensors, which the norms would otherwise own alone
        groups = [layer.self_attn.attn.kv_group for layer in model.layers]
        num_groups = 0 if all(g is None for g in groups) else max(g or 0 for g in groups) + 1
        for i, (layer, (k_cache, v_cache), rotary) in enumerate(zip(model.layers, kv_caches, rotaries)):
            attn, mlp = layer.self_attn, layer.mlp
            packs = [_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = _norms(layer, gemma)
            weights = [None if n is None else _norm_weight(n, gemma) for n in norms]
            extras = attn.attn.extras
            if gemma and mlp.approximate != "tanh":
                return None  # the stack's GELU is the tanh one (every released Gemma 3)
            if (attn.attn.backend.name != "torch" or set(extras) - {"sliding_window"} or attn.attn.sinks is not None
                    or None in packs or kv_code(dtype, pool.dtype) is None
                    or any(c.dtype != pool.dtype or c.shape[1:] != (pool.shape[1], attn.num_kv_heads, attn.head_dim)
                           or not _usable(c, pool.dtype) for c in (k_cache, v_cache))
                    or any(n is not None and (n.eps != eps or not _usable(w, norm_dtype)) for n, w in zip(norms, weights))
                    or not (_usable(attn.attn.k_scale, torch.float32) and _usable(attn.attn.v_scale, torch.float32))):
                return None
            keep += [w for w in weights if w is not None]
            ptrs[i] = LayerPtrs(*map(addr, weights[:2]), *packs, addr(k_cache), addr(v_cache),
                                addr(attn.attn.k_scale), addr(attn.attn.v_scale), *map(addr, weights[2:]),
                                addr(rotary.cos), addr(rotary.sin), extras.get("sliding_window", 0),
                                attn.attn.kv_group or 0)
        keep.append(_norm_weight(model.norm, gemma))
        return cls(model, kv_caches, ptrs, keep, num_groups)

    def run(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final norm's output for embeddings ``x`` [tokens, hidden] (which end as the residual stream)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        tables, lens, qsl = (t.to(torch.int32).contiguous() for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc))
        pos, slots = (t.to(torch.int64).contiguous() for t in (positions, meta.slot_mapping))
        a = self.args
        a.tokens, a.num_seqs, a.table_stride = x.shape[0], lens.numel(), tables.shape[1]
        a.positions, a.slots, a.block_tables, a.seq_lens, a.query_start_loc = map(addr, (pos, slots, tables, lens, qsl))
        a.x, a.out = addr(x), addr(out)
        held = []  # each group's tables and slots, alive through the call
        # As PagedAttention reads them: a step without per-group metadata (one group, as a model whose
        # every layer slides: Mistral) gives every layer the step's own tables; the C side refuses a
        # layer of another group then.
        a.num_groups = 0 if self.groups is None or meta.groups is None else len(self.groups)
        if a.num_groups:
            if len(meta.groups) != len(self.groups):
                raise ValueError(f"the stack reads {len(self.groups)} KV groups; the step has {len(meta.groups)}")
            for g, gm in zip(self.groups, meta.groups):
                t, sl = gm.block_tables.to(torch.int32).contiguous(), gm.slot_mapping.to(torch.int64).contiguous()
                held += [t, sl]
                g.slots, g.block_tables, g.table_stride = addr(sl), addr(t), t.shape[1]
        llama_stack(a)
        return out
