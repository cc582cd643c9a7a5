"""The CPU decoder stack of a Llama-family model in one compiled call
(``kernels/cpu_model.cpp``), where the per-op path would make about nine
Python and ctypes round trips per layer.

``FusedStack.build`` takes it only where every op would have run its compiled
kernel anyway (CPU, float32 or bfloat16, one rank, the torch attention backend,
every linear packed in panels or holding GGUF blocks the int8 kernels packed,
a KV pool the library reads); anywhere else it
returns None and the model runs layer by layer, with the same result bit for
bit (tests/test_cpu_fused.py; GGUF blocks: tests/test_quant_fused.py).
``PAGEDSERVE_CPU_FUSED_LAYERS=0`` turns it off.

A stack holds the addresses of the weights, pools and fp8 scales it was built
over, and keeps the objects alive; ``current`` tells whether the model still
points at the same ones (the runner sets backends and scales after building).
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from pagedserve.common.env import env_flag
from pagedserve.gpuworker.cpu_gemm import Layout, PackedWeight
from pagedserve.gpuworker.layers import AttentionMetadata
from pagedserve.kernels import cpu_build
from pagedserve.kernels.cpu_attention import DTYPE_CODES, kv_code
from pagedserve.kernels.cpu_layers import MAX_PARTS, LayerPtrs, Linear, StackArgs, addr, llama_stack, table_addr
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
    if p is None or p.layout is not Layout.PANELS or not _usable(p.data, dtype):
        return None
    return Linear(data=(addr(p.data),), bias=addr(linear.bias), parts=0)


class FusedStack:
    """One model's layers over one set of KV pools, ready to run a step."""

    def __init__(self, model: Any, kv_caches: Sequence[KVCache], layers: Any) -> None:
        self.model, self.kv_caches, self.layers = model, kv_caches, layers
        # The submodules looked up once: nn.Module's __getattr__ costs about 1 us a lookup.
        self.attns = [layer.self_attn.attn for layer in model.layers]
        self.linears = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        self.watched = self._watch()
        # What every step shares; run() fills in the batch.
        dtype, k_cache, attn = model.embed_tokens.weight.dtype, kv_caches[0][0], self.attns[0]
        self.args = StackArgs(
            dtype=DTYPE_CODES[dtype], kv_dtype=kv_code(dtype, k_cache.dtype), num_layers=model.num_layers,
            hidden=model.cfg.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=model.layers[0].mlp.down_proj.in_features, block_size=k_cache.shape[1],
            eps=model.norm.eps, scale=attn.scale, layers=table_addr(layers), final_norm=addr(model.norm.weight),
            cos=addr(model.rotary.cos), sin=addr(model.rotary.sin),
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
        dtype = model.embed_tokens.weight.dtype
        if (not env_flag(ENV, True) or model.embed_tokens.weight.device.type != "cpu" or dtype not in DTYPE_CODES
                or model.embed_tokens.tp.size != 1 or len(kv_caches) != model.num_layers
                or not (_usable(model.rotary.cos, torch.float32) and _usable(model.rotary.sin, torch.float32))
                or cpu_build.load() is None):
            return None
        eps, pool = model.norm.eps, kv_caches[0][0]
        ptrs = (LayerPtrs * model.num_layers)()
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            packs = [_linear(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if (attn.attn.backend.name != "torch" or attn.attn.extras or attn.attn.sinks is not None or None in packs or kv_code(dtype, pool.dtype) is None
                    or any(c.dtype != pool.dtype or c.shape[1:] != (pool.shape[1], attn.num_kv_heads, attn.head_dim)
                           or not _usable(c, pool.dtype) for c in (k_cache, v_cache))
                    or any(n.eps != eps or not _usable(n.weight, dtype) for n in norms)
                    or not (_usable(attn.attn.k_scale, torch.float32) and _usable(attn.attn.v_scale, torch.float32))):
                return None
            ptrs[i] = LayerPtrs(addr(norms[0].weight), addr(norms[1].weight), *packs, addr(k_cache), addr(v_cache),
                                addr(attn.attn.k_scale), addr(attn.attn.v_scale))
        return cls(model, kv_caches, ptrs)

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
        llama_stack(a)
        return out
