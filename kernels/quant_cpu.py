"""The compiled int8 products for ``quant.py`` (``quant_cpu.cpp``; the repacking in
``quant_pack.cpp``; both built into the CPU kernel library by ``cpu_build``).

``repack`` turns a weight's blocks into the kernel's groups of 16 rows (the
same bytes reordered; Q4_K's 6-bit scales unpacked, +2.8 %); ``linear_parts``
quantizes the activations per 32 to int8 (fp32 ones in two terms: ~15 bits)
and runs the VNNI dot products for one weight or several side by side (q/k/v
of different types), quantizing x once, as the compiled decoder stack
(``cpu_model.cpp``) does.
Both return None where the library cannot run them (not built, no
AVX512-VNNI, another device or dtype), and ``quant.py`` dequantizes instead.

Two paths, chosen per step by the worker (``prompt_step``), measured with
``python -m pagedserve.kernels.quant_bench --step --prompt`` (2-core EPYC, 1B
shape, bf16 activations, 2026-12-07): a decode step quantizes the activations to
int8 and runs the VNNI products (Q8_0 against the bf16 panels on the dequantized
weight: 1.6x at 1 row, 2026-12-06; 1.25x at 64 and at 256); a step that holds
prompt tokens decodes the blocks to bf16 panels (``quant_bf16.cpp``: 0.89x the
panels at 64 rows, 0.99x at 256), for the perplexity of the bf16 model, +0.03 %
instead of +0.58 %. fp32 activations always run the int8 products, in two terms.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pagedserve.kernels import cpu_build, cpu_memory

GROUP = 16  # output rows per packed group
UNIT_BYTES = {"Q8_0": 544, "Q4_0": 288, "Q4_1": 320, "Q5_0": 352, "Q5_1": 384, "Q4_K": 2368,
              "Q6_K": 3360}  # per group and unit
UNIT_WEIGHTS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q6_K": 256}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
NO_VNNI = 3  # pagedserve_quant_linear_parts' code: this CPU has no AVX512-VNNI


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
    packed = cpu_memory.empty((packed_bytes(qtype, n, k),), torch.uint8)  # streamed each step: 2 MiB pages
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


def activations_as_used(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float64 (x as the products see it, the largest rounding per element) for x [M, K]: one int8
    term for bf16 (q d, d / 2), two for fp32 (q1 d1 + q2 d2 with q2 d2 ~ x - q1 d1, d2 / 2)."""
    first = quantize_activations(x)
    if first is None:
        return None
    q, d, _ = first
    xq, step = q.double() * d.double().repeat_interleave(32, dim=1), d.repeat_interleave(32, dim=1)
    if x.dtype == torch.float32:
        second = quantize_activations(x - q.float() * step)
        assert second is not None
        q2, d2, _ = second
        step = d2.repeat_interleave(32, dim=1)
        xq = xq + q2.double() * step.double()
    return xq, step.double() / 2


def _rows_var() -> ctypes.c_int | None:
    """The library's ``pagedserve_quant_dequant_rows`` (quant_bf16.cpp), or None without it."""
    lib = cpu_build.load()
    return None if lib is None else ctypes.c_int.in_dll(lib, "pagedserve_quant_dequant_rows")


def dequant_rows() -> int | None:
    """From this many rows, bf16 activations meet the weight decoded to bf16 panels (quant_bf16.cpp:
    a prompt); below it, one int8 term of them (a decode batch). None without the library."""
    var = _rows_var()
    return None if var is None else var.value


def set_dequant_rows(rows: int) -> None:
    """Move that threshold. The library's own default (128, quant_bf16.cpp) serves callers that do
    not know what a step holds; the worker sets it per step (``prompt_step``)."""
    var = _rows_var()
    if var is not None:
        var.value = rows


@contextmanager
def dequant_rows_at(rows: int) -> Iterator[None]:
    """The threshold at ``rows`` inside the block, restored after (benchmarks and tests compare the
    two paths at one shape)."""
    before = dequant_rows()
    set_dequant_rows(rows)
    try:
        yield
    finally:
        if before is not None:
            set_dequant_rows(before)


NEVER = 1 << 30


def prompt_step(prompt: bool) -> None:
    """Set by the worker before each step: one that holds prompt tokens runs every product of bf16
    activations on bf16 panels (perplexity as the bf16 model's; the decoding costs a few % at
    prompt sizes), a decode-only step quantizes them to one int8 term (the speed of a weight read
    that is a quarter of bf16's, llama.cpp's trade)."""
    set_dequant_rows(1 if prompt else NEVER)


class Parts:
    """Weights side by side for ``linear_parts`` (and the compiled stack's ``Linear``): their packed
    forms (kept alive here), ggml type codes and output rows, as the C arrays, built once per layer."""

    def __init__(self, packed: list[torch.Tensor], codes: list[int], rows: list[int], k: int) -> None:
        if not 1 <= len(packed) <= 4 or not len(packed) == len(codes) == len(rows):
            raise ValueError(f"linear_parts: 1 to 4 parts, got {len(packed)}")
        self.packed, self.codes, self.rows, self.k, self.n = packed, codes, rows, k, sum(rows)
        count = len(packed)
        self.c_packed = (ctypes.c_void_p * count)(*[p.data_ptr() for p in packed])
        self.c_codes = (ctypes.c_int32 * count)(*codes)
        self.c_rows = (ctypes.c_int64 * count)(*rows)


def linear_parts(x: torch.Tensor, parts: Parts, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [..., k] @ [W_0; W_1; ...].T (+ bias): the parts' outputs side by side, x quantized once;
    None: not run here. Lean on purpose: a decode step makes hundreds of these calls at a few
    microseconds each (the C arrays are built once, in ``Parts``)."""
    dtype = _DTYPES.get(x.dtype)
    if dtype is None or x.device.type != "cpu":
        return None
    lib = cpu_build.load()
    if lib is None:
        return None
    k, n = parts.k, parts.n
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
    rc = lib.pagedserve_quant_linear_parts(dtype, x2.data_ptr(), None if bias is None else bias.data_ptr(),
                                           out.data_ptr(), x2.shape[0], k, len(parts.packed),
                                           ctypes.addressof(parts.c_codes), ctypes.addressof(parts.c_packed),
                                           ctypes.addressof(parts.c_rows))
    if rc == NO_VNNI:
        return None
    if rc != 0:
        raise ValueError(f"quant_linear types {parts.codes} rows {parts.rows} x {tuple(x.shape)}: "
                         f"bad arguments (code {rc})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def rows(packed: torch.Tensor, code: int, n: int, k: int, ids: torch.Tensor) -> torch.Tensor | None:
    """Rows ``ids`` (1-D) of the packed [n, k] weight dequantized, float32 [len(ids), k], exactly
    as ``quant.dequantize``; None without the library."""
    lib = cpu_build.load()
    if lib is None:
        return None
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), k), dtype=torch.float32)
    rc = lib.pagedserve_quant_rows(code, packed.data_ptr(), n, k, ids.data_ptr(), ids.numel(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"quant rows of ({n}, {k}): bad arguments or an id out of range (code {rc})")
    return out
