"""Linear layers on CPU through oneDNN with weights packed once at load.

``F.linear`` on CPU goes to MKL's sgemm, which re-packs the weight on every
call and on AMD CPUs runs a slow code path: measured on the 2-core EPYC,
[64, 576] x [576, 49152] (SmolLM2's LM head at 64 decodes) takes 30 ms that
way and 8.3 ms with a weight oneDNN packed in advance (2.5-3.5x on every
SmolLM2 shape). vLLM's CPU build prepacks for the same reason. The packed copy
sits beside the original (the embedding and the tests still read that one).
``PAGEDSERVE_CPU_PACKED_GEMM=0`` turns it off.

At one or two rows (decode at low load) the step is bound by reading every
weight once, and oneDNN's packed GEMM streams them slowly there: the
compiled few-row kernel (``kernels/cpu_gemv.cpp``), over the original
weight, made the whole SmolLM2 decode step 1.27x faster at one sequence and
1.28x at two in fp32 (1.13x / 1.11x in bf16) on the 2-core EPYC, and was
level or slower from three rows (``docs/gpuworker.md``).
``PAGEDSERVE_CPU_SMALL_GEMM_ROWS`` sets the most rows it takes (0: never).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.env import env_flag, env_int
from pagedserve.kernels import cpu_ops

ENV = "CPU_PACKED_GEMM"  # PAGEDSERVE_CPU_PACKED_GEMM=0: plain F.linear
SMALL_ROWS_ENV = "CPU_SMALL_GEMM_ROWS"
SMALL_ROWS_DEFAULT = 2
_DTYPES = (torch.float32, torch.bfloat16)


def packed_gemm_available() -> bool:
    if not env_flag(ENV, True):
        return False
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """oneDNN's layout of ``weight`` [out, in] for inputs of about ``batch_hint`` rows, or None."""
    if weight.device.type != "cpu" or weight.dtype not in _DTYPES or not packed_gemm_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def small_rows() -> int:
    """The most rows of x that go to the few-row kernel instead of oneDNN."""
    rows = env_int(SMALL_ROWS_ENV, SMALL_ROWS_DEFAULT) or 0
    return max(0, min(rows, cpu_ops.SMALL_LINEAR_MAX_ROWS))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
           max_small_rows: int = 0) -> torch.Tensor:
    """``max_small_rows``: x with at most that many rows goes to the few-row kernel."""
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if x.dim() == 2 and x.shape[0] <= max_small_rows:
        out = cpu_ops.small_linear(x.contiguous(), weight, bias)
        if out is not None:
            return out
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_model(model: nn.Module, batch_hint: int) -> int:
    """Packs every layer that has a ``packed`` slot, and sets where it takes
    the few-row kernel instead; returns how many were packed."""
    n, rows = 0, small_rows()
    for m in model.modules():
        if hasattr(m, "packed") and isinstance(getattr(m, "weight", None), torch.Tensor):
            m.packed = pack(m.weight, batch_hint)
            m.small_rows = rows if m.packed is not None else 0
            n += m.packed is not None
    return n
