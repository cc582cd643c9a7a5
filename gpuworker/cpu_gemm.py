"""Linear layers on CPU through oneDNN with weights packed once at load.

``F.linear`` on CPU goes to MKL's sgemm, which re-packs the weight on every
call and on AMD CPUs runs a slow code path: measured on the 2-core EPYC,
[64, 576] x [576, 49152] (SmolLM2's LM head at 64 decodes) takes 30 ms that
way and 8.3 ms with a weight oneDNN packed in advance (2.5-3.5x on every
SmolLM2 shape). vLLM's CPU build prepacks for the same reason. The packed copy
sits beside the original (the embedding and the tests still read that one).
``PAGEDSERVE_CPU_PACKED_GEMM=0`` turns it off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.config import env_flag

ENV = "CPU_PACKED_GEMM"  # PAGEDSERVE_CPU_PACKED_GEMM=0: plain F.linear
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def pack_model(model: nn.Module, batch_hint: int) -> int:
    """Packs every layer that has a ``packed`` slot; returns how many."""
    n = 0
    for m in model.modules():
        if hasattr(m, "packed") and isinstance(getattr(m, "weight", None), torch.Tensor):
            m.packed = pack(m.weight, batch_hint)
            n += m.packed is not None
    return n
