"""The fused per-layer ops of the CPU serving path (``cpu_ops.cpp``) and
its linear layers over packed panels (``cpu_linear.cpp``).

Each function returns None (or False) where the compiled library cannot run
it (not built, another device or dtype, a layout it does not take), and the
caller runs its plain torch ops instead, so the library is an optimisation
and never a requirement. tests/test_cpu_ops.py holds each to those torch ops.
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels import cpu_build, cpu_memory
from pagedserve.kernels.cpu_attention import DTYPE_CODES, kv_code, scale_ptr


def _code(*tensors: torch.Tensor) -> int | None:
    """The library's dtype code when every tensor is a contiguous CPU tensor of one supported dtype."""
    dtype = tensors[0].dtype
    if dtype not in DTYPE_CODES or any(t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous()
                                       for t in tensors):
        return None  # checked first: a CUDA worker never builds the CPU library
    return DTYPE_CODES[dtype] if cpu_build.load() is not None else None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight * rmsnorm(x + residual), x + residual), the sum written into
    ``residual``; without a residual, (weight * rmsnorm(x), x)."""
    code = _code(x, weight) if residual is None else _code(x, weight, residual)
    return None if code is None else _norm("add_rms_norm", code, x, residual, weight, eps)


def _norm(name: str, code: int, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    if x.dim() != 2:
        return None
    out = torch.empty_like(x)
    rc = getattr(cpu_build.load(), f"pagedserve_{name}")(
        code, x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
        x.shape[0], x.shape[1], eps)
    if rc != 0:
        raise ValueError(f"{name}: bad shapes (code {rc})")
    return out, (x if residual is None else residual)


def rope_and_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> bool:
    """Rotates q and k in place in ``qkv`` by neox RoPE at ``positions`` and
    writes k and v into their slots of the pool (an fp8 pool: quantized with
    the layer's scales, ``fp8.py``). ``qkv``: [tokens, (heads + 2 kv_heads) *
    head_dim] rows, possibly strided. False: not done, nothing changed."""
    if qkv.device.type != "cpu" or qkv.dtype not in DTYPE_CODES:
        return False
    kv = kv_code(qkv.dtype, k_cache.dtype)
    if (kv is None or v_cache.dtype != k_cache.dtype or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or qkv.stride(1) != 1
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous())
            or cpu_build.load() is None):
        return False
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    rc = cpu_build.load().pagedserve_rope_and_cache(
        DTYPE_CODES[qkv.dtype], kv, qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim,
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        scale_ptr(k_scale), scale_ptr(v_scale))
    if rc != 0:
        raise ValueError(f"rope_and_cache: bad shapes (code {rc})")
    return True


def _gated(name: str, x: torch.Tensor) -> torch.Tensor | None:
    code = _code(x)
    if code is None or x.dim() != 2 or x.shape[1] % 2 != 0:
        return None
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    rc = getattr(cpu_build.load(), f"pagedserve_{name}")(code, x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2)
    if rc != 0:
        raise ValueError(f"{name}: bad shapes (code {rc})")
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[:, :w]) * x[:, w:] for x [rows, 2w]."""
    return _gated("silu_and_mul", x)


def gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``add_rms_norm`` with Gemma's float32 (1 + w) ``weight``, multiplied before the one rounding."""
    code = _code(x) if residual is None else _code(x, residual)
    if code is None or weight.dtype != torch.float32 or not weight.is_contiguous():
        return None
    return _norm("add_rms_norm_f32w", code, x, residual, weight, eps)


def head_norms(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_weight: torch.Tensor,
               k_weight: torch.Tensor, eps: float) -> bool:
    """Each q and k head of ``qkv`` (rows as ``rope_and_cache`` reads them) RMS-normed in place: float32
    weights as Gemma's norm, weights in qkv's dtype as Llama's. False: not done, nothing changed."""
    if (qkv.device.type != "cpu" or qkv.dtype not in DTYPE_CODES or qkv.stride(1) != 1
            or q_weight.dtype not in (qkv.dtype, torch.float32) or _code(q_weight, k_weight) is None):
        return False
    rc = cpu_build.load().pagedserve_head_norms(DTYPE_CODES[qkv.dtype], qkv.data_ptr(), qkv.stride(0), qkv.shape[0],
                                                num_heads, num_kv_heads, head_dim, q_weight.data_ptr(),
                                                k_weight.data_ptr(), int(q_weight.dtype == torch.float32), eps)
    if rc != 0:
        raise ValueError(f"head_norms: bad shapes (code {rc})")
    return True


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """gelu(x[:, :w], approximate="tanh") * x[:, w:] for x [rows, 2w]."""
    return _gated("gelu_tanh_and_mul", x)


PANEL = 16  # output features per panel (cpu_linear.cpp's LANES)


def linear_group() -> int:
    """Panels per interleaved group in ``pack_linear``'s layout (3 with AVX-512, else 1)."""
    return int(cpu_build.load().pagedserve_linear_group())


def pack_linear(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [N, K] in ``cpu_linear.cpp``'s panels: [ceil(N / 16) * 16, K]
    elements of its dtype (features past N zero), for ``packed_linear``. Each
    whole group of ``linear_group()`` panels is interleaved per k, [K][group][16]
    (bf16 [K/2][group][16][2]); the panels after the last group are [K][16]."""
    code = _code(weight)
    if code is None or weight.dim() != 2 or (weight.dtype == torch.bfloat16 and weight.shape[1] % 2 != 0):
        return None
    n, k = weight.shape
    packed = cpu_memory.empty((-(-n // PANEL) * PANEL, k), weight.dtype)  # streamed each step: 2 MiB pages
    rc = cpu_build.load().pagedserve_linear_pack(code, weight.data_ptr(), packed.data_ptr(), n, k)
    if rc != 0:
        raise ValueError(f"pack_linear: bad shapes (code {rc})")
    return packed


def coded_rows() -> int:
    """Rows up to which ``packed_linear`` runs a coded weight's units (0: this CPU has no coded kernel)."""
    lib = cpu_build.load()
    return 0 if lib is None else int(lib.pagedserve_coded_rows())


def pack_coded(panels: torch.Tensor, out_features: int, budget: int | None = None) -> torch.Tensor | None:
    """bf16 ``panels`` (``pack_linear``'s) with coded exponents (``cpu_coded.cpp``): the same weights
    in 12 bits each, for ``packed_linear``'s steps of up to ``coded_rows()`` rows. None where the
    kernel does not run here, the shape does not take it (K % 4, fewer than one whole group) or
    it would take more than ``budget`` bytes."""
    if panels.dtype != torch.bfloat16 or _code(panels) is None or panels.dim() != 2 or coded_rows() == 0:
        return None
    lib, size = cpu_build.load(), ctypes.c_int64(0)
    n, k = out_features, panels.shape[1]
    if (lib.pagedserve_coded_pack(panels.data_ptr(), n, k, None, 0, ctypes.byref(size)) != 0
            or (budget is not None and size.value > budget)):
        return None
    coded = cpu_memory.empty((size.value,), torch.uint8)
    if lib.pagedserve_coded_pack(panels.data_ptr(), n, k, coded.data_ptr(), size.value, ctypes.byref(size)) != 0:
        raise ValueError("pack_coded: the coded size changed between its two passes")
    return coded


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None, coded: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ weight.T + bias for x [..., K], ``packed`` = ``pack_linear(weight)``
    and weight's ``out_features`` rows; ``coded``: ``pack_coded(packed, out_features)`` or None.
    The result is the same bit for bit with or without ``coded``."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    code = _code(x2, packed) if bias is None else _code(x2, packed, bias)
    if (code is None or packed.dim() != 2 or x2.shape[1] != packed.shape[1] or x2.shape[0] == 0
            or not 0 < out_features <= packed.shape[0] < out_features + PANEL
            or (bias is not None and bias.shape != (out_features,))):
        return None
    out = torch.empty((x2.shape[0], out_features), dtype=x.dtype)
    args = (None if bias is None else bias.data_ptr(), out.data_ptr(), x2.shape[0], out_features, packed.shape[1])
    if coded is not None and x.dtype == torch.bfloat16:
        rc = cpu_build.load().pagedserve_coded_linear(x2.data_ptr(), coded.data_ptr(), packed.data_ptr(), *args)
    else:
        rc = cpu_build.load().pagedserve_linear(code, x2.data_ptr(), packed.data_ptr(), *args)
    if rc != 0:
        raise ValueError(f"packed_linear: bad shapes (code {rc})")
    return out.view(*x.shape[:-1], out_features)
