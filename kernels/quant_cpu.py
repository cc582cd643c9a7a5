"""The compiled int8 products for ``quant.py`` (``quant_cpu.cpp``, built into the
CPU kernel library by ``cpu_build``).

``repack`` turns a weight's blocks into the kernel's groups of 16 rows (the
same bytes reordered; Q4_K's 6-bit scales unpacked, +2.8 %); ``linear``
quantizes the activations per 32 to int8 and runs the VNNI dot products.
Both return None where the library cannot run them (not built, no
AVX512-VNNI, another device or dtype), and ``quant.py`` dequantizes instead.
"""
from __future__ import annotations

import torch

from pagedserve.kernels import cpu_build

GROUP = 16  # output rows per packed group
UNIT_BYTES = {"Q8_0": 544, "Q4_0": 288, "Q4_1": 320, "Q5_0": 352, "Q5_1": 384, "Q4_K": 2368,
              "Q6_K": 3360}  # per group and unit
UNIT_WEIGHTS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q6_K": 256}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
NO_VNNI = 3  # pagedserve_quant_linear's code: this CPU has no AVX512-VNNI


def packed_bytes(qtype: str, n: int, k: int) -> int:
    return -(-n // GROUP) * (k // UNIT_WEIGHTS[qtype]) * UNIT_BYTES[qtype]


def _vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags and "avx512bw" in flags


def repack(blocks: torch.Tensor, qtype: str, code: int, n: int, k: int) -> torch.Tensor | None:
    """A weight's blocks [n, row bytes] (ggml type ``code``) in the kernel's layout (uint8), or
    None where the kernel cannot run."""
    lib = cpu_build.load()
    if lib is None or blocks.device.type != "cpu" or qtype not in UNIT_BYTES or not _vnni():
        return None
    data = blocks.contiguous()
    packed = torch.empty(packed_bytes(qtype, n, k), dtype=torch.uint8)
    rc = lib.pagedserve_quant_repack(code, data.data_ptr(), packed.data_ptr(), n, k, packed.numel())
    if rc != 0:
        raise ValueError(f"quant repack {qtype} ({n}, {k}): bad arguments (code {rc})")
    return packed


def unpack(packed: torch.Tensor, code: int, n: int, k: int, row_bytes: int) -> torch.Tensor:
    """The file's blocks [n, row_bytes] rebuilt from ``repack``'s form (its exact inverse)."""
    lib = cpu_build.load()
    if lib is None:
        raise ValueError("no CPU kernel library to unpack the weight")
    out = torch.empty((n, row_bytes), dtype=torch.uint8)
    rc = lib.pagedserve_quant_unpack(code, packed.data_ptr(), out.data_ptr(), n, k, packed.numel())
    if rc != 0:
        raise ValueError(f"quant unpack ({n}, {k}): bad arguments (code {rc})")
    return out


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The kernel's int8 activations of x [M, K]: (q int8 [M, K], d float [M, K/32], d * sum(q) per 16
    float [M, K/16]); x ~ q * d per 32. None without the library."""
    lib = cpu_build.load()
    if lib is None or x.dtype not in _DTYPES or x.dim() != 2 or x.shape[1] % 32:
        return None
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    d, s = torch.empty((m, k // 32)), torch.empty((m, k // 16))
    rc = lib.pagedserve_quant_act(_DTYPES[x.dtype], x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    if rc != 0:
        raise ValueError(f"quantize_activations {tuple(x.shape)}: bad arguments (code {rc})")
    return q, d, s


def linear(x: torch.Tensor, packed: torch.Tensor, code: int, n: int, k: int,
           bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., k] @ W.T (+ bias) by the int8 kernel for W [n, k] of ggml type ``code`` packed by
    ``repack``, in x's dtype; None: not run here. Lean on purpose: a decode step makes
    hundreds of these calls at a few microseconds each."""
    dtype = _DTYPES.get(x.dtype)
    if dtype is None or x.device.type != "cpu":
        return None
    lib = cpu_build.load()
    if lib is None:
        return None
    if x.shape[-1] != k:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} features, the weight {k}")
    x2 = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    if x2.shape[0] == 0:
        return None
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"quant_linear: bias of shape {tuple(bias.shape)} for {n} outputs")
        bias = bias.to(x.dtype).contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype)
    rc = lib.pagedserve_quant_linear(code, dtype, x2.data_ptr(), packed.data_ptr(),
                                     None if bias is None else bias.data_ptr(), out.data_ptr(), x2.shape[0], n, k)
    if rc == NO_VNNI:
        return None
    if rc != 0:
        raise ValueError(f"quant_linear type {code} ({n}, {k}) x {tuple(x.shape)}: bad arguments (code {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
