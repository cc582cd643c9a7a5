"""The Llama (and Gemma 3) decoder stack in one compiled call (``cpu_model.cpp``): the same
kernels as the per-op path (``cpu_ops.py``, ``cpu_attention.py``), in the
same order, so a Llama's output is bit for bit theirs (Gemma 3's per-op path is torch's ops:
equal to rounding), without a Python and ctypes round trip per op.

``Linear``, ``LayerPtrs``, ``GroupPtrs`` and ``StackArgs`` mirror the C structs field for field. The
caller (``gpuworker/cpu_fused.py``) checks every tensor's dtype, device and
layout before it hands their addresses over; this module only marshals.
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import cpu_build

_p, _i, _f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class Linear(ctypes.Structure):
    """One linear: ``parts`` 0, the panels of ``cpu_ops.pack_linear`` in ``data[0]`` and bf16's coded
    copy (``cpu_ops.pack_coded``) or None in ``data[1]``; 1 to 3, GGUF
    weights side by side (``quant_cpu.repack``'s form), part p of ggml type ``qtypes[p]`` with
    ``rows[p]`` output rows. ``bias``: None, no bias."""

    _fields_ = [("data", _p * 3), ("bias", _p), ("rows", ctypes.c_int64 * 3), ("qtypes", _i * 3), ("parts", _i)]


MAX_PARTS = 3  # Linear's quantized parts (q/k/v of three types at most)


class LayerPtrs(ctypes.Structure):
    """One decoder layer: norm weights, its four linears, the layer's K/V pool and its fp8 scales;
    Gemma 3's extra norms (None: none), this layer's RoPE tables, its sliding
    window (0: none) and the KV group it reads."""

    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("k_cache", _p), ("v_cache", _p), ("k_scale", _p), ("v_scale", _p),
                ("q_norm", _p), ("k_norm", _p), ("attn_out_norm", _p), ("mlp_out_norm", _p), ("cos", _p), ("sin", _p),
                ("window", _i), ("group", _i)]


class GroupPtrs(ctypes.Structure):
    """One KV cache group's slot mapping and block tables for this step."""

    _fields_ = [("slots", _p), ("block_tables", _p), ("table_stride", ctypes.c_int64)]


class StackArgs(ctypes.Structure):
    _fields_ = [
        *[(name, _i) for name in ("dtype", "kv_dtype", "num_layers", "tokens", "hidden", "heads", "kv_heads",
                                  "head_dim", "intermediate", "num_seqs", "block_size", "table_stride", "gemma",
                                  "num_groups")],
        ("eps", _f), ("scale", _f),
        *[(name, _p) for name in ("layers", "final_norm", "positions", "slots", "block_tables",
                                  "seq_lens", "query_start_loc", "x", "out", "groups")],
    ]


def addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def table_addr(layers: ctypes.Array[LayerPtrs]) -> int:
    """The address ``StackArgs.layers`` takes for an array of ``LayerPtrs``."""
    return ctypes.addressof(layers)


def llama_stack(args: StackArgs) -> None:
    """Runs the stack; ``args.x`` ends as the residual stream, ``args.out`` as the final norm's output."""
    rc = cpu_build.load().pagedserve_llama_stack(ctypes.byref(args))
    if rc != 0:
        raise ValueError(f"llama_stack: bad shapes (code {rc})")
