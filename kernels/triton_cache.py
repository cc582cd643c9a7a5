"""KV-cache maintenance: Triton ``reshape_and_cache`` and ``copy_blocks``
(``swap_blocks``, plain copies, is in ``swap.py``).

Semantics are those of the ``*_ref`` functions in ``reference.py``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8 import is_fp8

# (mantissa bits, exponent bias, largest finite value) of the fp8 pool formats.
_FP8_FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}


@triton.jit
def _encode_fp8(x, inv, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr):
    """x * inv as fp8 bits (uint8): round to nearest even, saturating; the rule
    of fp8.py, done on the bits because the interpreter's fp8 casts are wrong
    (and the same code then runs on the device)."""
    y = x.to(tl.float32) * inv
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.minimum(tl.abs(y), MAX)
    MIN_NORMAL: tl.constexpr = 2.0 ** (1 - BIAS)
    SUB_MUL: tl.constexpr = 2.0 ** (BIAS - 1 + MANT)
    # Subnormals are multiples of 1 / SUB_MUL: adding 2^23 rounds to an integer, to nearest even.
    sub = ((a * SUB_MUL + 8388608.0) - 8388608.0).to(tl.int32)
    DROP: tl.constexpr = 23 - MANT
    u = a.to(tl.int32, bitcast=True)
    u = u + ((1 << (DROP - 1)) - 1) + ((u >> DROP) & 1)
    normal = (((u >> 23) - 127 + BIAS) << MANT) | ((u >> DROP) & ((1 << MANT) - 1))
    return (tl.where(a < MIN_NORMAL, sub, normal) | (sign << 7)).to(tl.uint8)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_db, stride_ds, stride_dh, stride_dd,
    k_scale_ptr, v_scale_ptr,
    HEAD_DIM: tl.constexpr, NUM_ELEMS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MAX: tl.constexpr,
):
    """One program per token: its [num_kv_heads, head_dim] key and value rows
    (FP8: the pools are uint8 views, written as ``_encode_fp8`` bits)."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return  # padding token: nothing to cache
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    i = tl.arange(0, BLOCK)
    ok = i < NUM_ELEMS
    h = i // HEAD_DIM
    d = i % HEAD_DIM
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=ok)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=ok)
    if FP8:
        # x * (1 / scale), the reciprocal rounded once (div_rn: the device's default division is approximate).
        k = _encode_fp8(k, tl.math.div_rn(1.0, tl.load(k_scale_ptr)), MANT, BIAS, MAX)
        v = _encode_fp8(v, tl.math.div_rn(1.0, tl.load(v_scale_ptr)), MANT, BIAS, MAX)
    tl.store(k_cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d * stride_cd,
             k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + blk * stride_db + off * stride_ds + h * stride_dh + d * stride_dd,
             v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into the pool at
    ``slot = block * block_size + offset``; negative slots are skipped.
    ``key``/``value`` may be strided views (e.g. slices of a fused QKV). An fp8
    pool stores them quantized with the layer's scales (one float32 each on the
    pool's device; None: 1.0), as ``fp8.quantize`` does."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    n = num_kv_heads * head_dim
    fp8 = is_fp8(k_cache.dtype)
    mant, bias, limit = _FP8_FORMATS.get(k_cache.dtype, (0, 0, 0.0))
    if fp8:
        if v_cache.dtype != k_cache.dtype:
            raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype}, {v_cache.dtype}")
        one = torch.ones((), dtype=torch.float32, device=k_cache.device)
        k_scale = one if k_scale is None else k_scale
        v_scale = one if v_scale is None else v_scale
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        k_scale = v_scale = slot_mapping  # unused
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        k_scale, v_scale,
        HEAD_DIM=head_dim, NUM_ELEMS=n, BLOCK=triton.next_power_of_2(n), BLOCK_SIZE=k_cache.shape[1],
        FP8=fp8, MANT=mant, BIAS=bias, MAX=limit,
        num_warps=4 if n >= 1024 else 1,
    )


@triton.jit
def _copy_blocks_kernel(
    cache_ptrs_ptr, pairs_ptr, block_numel,
    DTYPE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (pair, cache, chunk) copies one chunk of block src to block dst
    in one cache tensor; every cache's blocks are contiguous runs of
    ``block_numel`` elements, and the caches are addressed by raw pointers so
    all layers go in one launch."""
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(DTYPE))
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < block_numel
    x = tl.load(base + src * block_numel + offs, mask=ok)
    tl.store(base + dst * block_numel + offs, x, mask=ok)


# fp8 pools are copied as bytes.
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
              torch.float8_e4m3fn: tl.uint8, torch.float8_e5m2: tl.uint8}


def _blocks_contiguous(t: torch.Tensor) -> bool:
    return t[0].is_contiguous() and t.stride(0) == t[0].numel()


_pointer_tables: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _pointer_table(caches: list[torch.Tensor]) -> torch.Tensor:
    """The caches' base addresses as a device tensor, built once per pool
    (the pool is allocated once, so this is one small upload per process)."""
    key = (caches[0].device, tuple(t.data_ptr() for t in caches))
    if key not in _pointer_tables:
        if len(_pointer_tables) >= 8:
            _pointer_tables.clear()
        _pointer_tables[key] = torch.tensor(key[1], dtype=torch.int64, device=key[0])
    return _pointer_tables[key]


def copy_blocks(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
    """Copy-on-write across all layers: block ``dst`` becomes a copy of ``src``
    for every (src, dst) row of int64 ``pairs`` [num_copies, 2].

    The copies run in parallel, so no dst may also be a src in the same call
    (the block manager's CoW targets are fresh blocks, so they never are)."""
    if pairs.numel() == 0 or not kv_caches:
        return
    caches = [t for kv in kv_caches for t in kv]
    first = caches[0]
    uniform = all(t.shape == first.shape and t.dtype == first.dtype and t.device == first.device
                  and _blocks_contiguous(t) for t in caches)
    if not uniform or first.dtype not in _TL_DTYPES:
        from pagedserve.kernels.reference import copy_blocks_ref  # odd layouts: plain torch
        copy_blocks_ref(list(kv_caches), pairs)
        return
    block_numel = first[0].numel()
    ptrs = _pointer_table(caches)
    pairs = pairs.to(device=first.device, dtype=torch.int64).contiguous()
    block = min(4096, triton.next_power_of_2(block_numel))
    grid = (pairs.shape[0], len(caches), triton.cdiv(block_numel, block))
    _copy_blocks_kernel[grid](ptrs, pairs, block_numel, DTYPE=_TL_DTYPES[first.dtype], BLOCK=block, num_warps=4)
