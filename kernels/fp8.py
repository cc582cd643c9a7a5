"""The fp8 KV cache (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``), as vLLM has it.

The pool is stored as ``torch.float8_e4m3fn`` (``fp8`` is e4m3, as in vLLM)
or ``torch.float8_e5m2``, one byte an element, so the same memory holds twice
the blocks of a 16-bit pool and four times those of an fp32 one.

Scales are per layer, a K and a V scale (vLLM's ``_k_scale`` / ``_v_scale``),
float32 tensors of one element on the pool's device, 1.0 by default. A value
is stored as ``x * (1 / scale)`` (the reciprocal rounded once in fp32), rounded
to nearest even and saturated at the format's largest finite value (448 for
e4m3, 57344 for e5m2), and read back as ``stored * scale``. Every writer (this
module's torch path, the compiled CPU op, the Triton kernel) follows that one
rule bit for bit, and every reader folds the scales into the attention
(k_scale into the query, v_scale into the output). Copies and swaps move bytes.
"""
from __future__ import annotations

import torch

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's dtype for ``--kv-cache-dtype name`` (auto: the model's)."""
    if name == "auto":
        return model_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(FP8_DTYPES)}, got {name!r}")
    return FP8_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def unit_scale(device: torch.device | str) -> torch.Tensor:
    """A layer's default scale (1.0, as vLLM without checkpoint scales)."""
    return torch.ones((), dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in a pool of ``dtype``: cast for unquantized pools; for
    fp8, ``x * (1 / scale)`` saturated and rounded to nearest even."""
    if not is_fp8(dtype):
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y * torch.reciprocal(scale.to(device=x.device, dtype=torch.float32))
    limit = torch.finfo(dtype).max
    return y.clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The values a pool slice stands for, in ``dtype`` (exact from fp8 for
    float32/float64; unquantized pools are only cast)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.to(dtype)
    return y if scale is None else y * scale.to(device=x.device, dtype=dtype)
