"""Triton dequantizing matmul for GGUF Q8_0 and Q4_K blocks (``quant.py``'s
``QuantWeight``), for a CUDA worker: y = x @ W.T with W decoded from the
file's bytes tile by tile in registers (never stored dequantized), one
32-weight block (a Q4_K sub-block) per step of the K loop, fp32 accumulation.

The activations stay float (no int8 quantization as on CPU), so on a device
this is the dequantized weight's product up to fp32 summation order.
tests/test_quant_kernels.py runs it in the Triton interpreter (fp32 dot: the
interpreter's bf16 dot is wrong) against the CPU kernel and float64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.quant import QuantWeight

TRITON_TYPES = ("Q8_0", "Q4_K")


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at byte pointers ``ptr`` as float32 (0 where masked off)."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
    QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per [BLOCK_M, BLOCK_N] tile of y; QTYPE 8 Q8_0, 12 Q4_K (ggml's numbers)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    l = tl.arange(0, 32)
    m_ok = rm < M
    n_ok = rn < N
    rows = w_ptr + rn.to(tl.int64)[:, None] * row_bytes  # [BLOCK_N, 1] byte pointers of the weight rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for blk in range(0, K // 32):
        x = tl.load(x_ptr + rm[:, None] * stride_xm + blk * 32 + l[None, :], mask=m_ok[:, None], other=0.0)
        if QTYPE == 8:  # Q8_0: d f16, 32 int8
            base = rows + blk * 34
            d = _f16(base, n_ok[:, None])  # [BLOCK_N, 1]
            q = tl.load(base + 2 + l[None, :], mask=n_ok[:, None], other=0).to(tl.int8, bitcast=True)
            w = q.to(tl.float32) * d
        else:  # Q4_K: superblock of 256 = d, dmin f16, 12 bytes of 6-bit scales and mins, 128 of nibbles
            j = blk % 8
            base = rows + (blk // 8) * 144
            d = _f16(base, n_ok[:, None])
            dmin = _f16(base + 2, n_ok[:, None])
            s_j = tl.load(base + 4 + (j % 4), mask=n_ok[:, None], other=0).to(tl.int32)  # ggml's get_scale_min_k4
            s_j4 = tl.load(base + 8 + (j % 4), mask=n_ok[:, None], other=0).to(tl.int32)
            s_hi = tl.load(base + 12 + (j % 4), mask=n_ok[:, None], other=0).to(tl.int32)
            if j < 4:
                sc = s_j & 63
                mn = s_j4 & 63
            else:
                sc = (s_hi & 0x0F) | ((s_j >> 6) << 4)
                mn = (s_hi >> 4) | ((s_j4 >> 6) << 4)
            qs = tl.load(base + 16 + (j // 2) * 32 + l[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            q = (qs >> ((j % 2) * 4)) & 0x0F
            w = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def quant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                 block_m: int = 16, block_n: int = 32) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) for a Q8_0 or Q4_K weight on x's device: [M, N] in x's dtype."""
    if w.qtype not in TRITON_TYPES:
        raise ValueError(f"the Triton quantized matmul takes {', '.join(TRITON_TYPES)}, not {w.qtype}")
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quant_matmul: x {tuple(x.shape)} for a weight of {k} inputs")
    xf = x.float().contiguous()
    data = w.data.to(x.device).contiguous()
    y = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(x.shape[0], block_m), triton.cdiv(n, block_n))
    _quant_matmul_kernel[grid](xf, data, y, x.shape[0], n, k, data.shape[1], xf.stride(0), y.stride(0),
                               QTYPE=w.quant.code, BLOCK_M=block_m, BLOCK_N=block_n)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
