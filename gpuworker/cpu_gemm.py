"""Linear layers on CPU over a weight packed once at load.

``F.linear`` on CPU goes to MKL's sgemm, which re-packs the weight on every
call and on AMD CPUs runs a slow code path: measured on the 2-core EPYC,
[64, 576] x [576, 49152] (SmolLM2's LM head at 64 decodes) takes 30 ms that
way and 8.3 ms with a weight oneDNN packed in advance. vLLM's CPU build
prepacks for the same reason.

The default packing is the compiled kernel's panels (``kernels/cpu_linear.cpp``):
on the 2-core EPYC the whole SmolLM2 decode step ran 1.03-1.22x faster with
them than with oneDNN's packed GEMM in fp32 and 1.09-1.41x in bf16 (1 to 64
sequences), and prefills of 512 and 2,048 tokens level (0.98-1.00x;
docs/gpuworker.md, "Linear layers"). Where the library is not built, or with
``PAGEDSERVE_CPU_LINEAR=onednn``, oneDNN packs instead. One packed copy sits
beside the original (the embedding and the tests read that one). A bf16 weight
also gets its panels with coded exponents (``kernels/cpu_coded.cpp``: the same
weights in 12 bits, read by steps of 1-4 rows, which only read weights; a
1B's one-row steps 1.3x faster), unless ``PAGEDSERVE_CPU_LINEAR=panels``.
``PAGEDSERVE_CPU_PACKED_GEMM=0`` packs nothing: plain ``F.linear``.

A layer that holds GGUF blocks (``qweights``) is prepared for the quantized
kernels instead (``kernels.quant.prepare``), and gets no dense packing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.env import env, env_flag
from pagedserve.kernels import cpu_ops
from pagedserve.kernels import quant

ENV = "CPU_PACKED_GEMM"  # PAGEDSERVE_CPU_PACKED_GEMM=0: plain F.linear
KERNEL_ENV = "CPU_LINEAR"  # PAGEDSERVE_CPU_LINEAR=onednn: oneDNN's packing instead of the panels
_DTYPES = (torch.float32, torch.bfloat16)


class Layout(enum.Enum):
    CODED = "coded"  # the panels, and for bf16 the same weights in 12 bits (cpu_coded.cpp) for 1-4 row steps
    PANELS = "panels"  # cpu_linear.cpp
    ONEDNN = "onednn"  # torch.ops.mkldnn


@dataclass(frozen=True)
class PackedWeight:
    layout: Layout
    data: torch.Tensor
    out_features: int
    coded: torch.Tensor | None = None  # Layout.CODED: cpu_ops.pack_coded(data)


def coded_budget() -> int | None:
    """Bytes a coded copy may take now: what the machine has available beyond a quarter of its
    memory (the most the default KV pool takes, allocated after the weights), or None: unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024 - int(fields["MemTotal"].split()[0]) * 1024 // 4
    except (OSError, KeyError, ValueError):
        return None


def _onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def chosen_layout() -> Layout:
    """The layout ``PAGEDSERVE_CPU_LINEAR`` asks for (coded panels by default)."""
    return Layout(str(env(KERNEL_ENV, Layout.CODED.value)).strip().lower())


def pack(weight: torch.Tensor, batch_hint: int, layout: Layout | None = None) -> PackedWeight | None:
    """``weight`` [out, in] packed in ``layout`` (None: ``chosen_layout()``; panels
    fall back to oneDNN where the library cannot pack), or None: plain F.linear."""
    if weight.device.type != "cpu" or weight.dtype not in _DTYPES or weight.dim() != 2 or not env_flag(ENV, True):
        return None
    layout = chosen_layout() if layout is None else layout
    if layout in (Layout.PANELS, Layout.CODED):
        panels = cpu_ops.pack_linear(weight.detach().contiguous())
        if panels is not None:
            coded = cpu_ops.pack_coded(panels, weight.shape[0], coded_budget()) if layout is Layout.CODED else None
            return PackedWeight(Layout.PANELS if coded is None else Layout.CODED, panels, weight.shape[0], coded)
    if not _onednn_available():
        return None
    return PackedWeight(Layout.ONEDNN, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint),
                        weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor:
    if packed is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if packed.layout in (Layout.PANELS, Layout.CODED):
        out = cpu_ops.packed_linear(x, packed.data, packed.out_features, bias, packed.coded)
        if out is not None:
            return out
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.data, bias, "none", [], "")


def pack_model(model: nn.Module, batch_hint: int) -> int:
    """Packs every layer that has a ``packed`` slot; returns how many were packed."""
    n = 0
    for m in model.modules():
        qweights = getattr(m, "qweights", None)
        if qweights:
            for w in qweights:
                if w.packed is None and w.data.device.type == "cpu" and env_flag(ENV, True):
                    quant.prepare(w, keep_blocks=False)  # held once: the packed form is the same bytes
            n += 1
        elif hasattr(m, "pack_experts"):  # moe_layer.FusedMoE: a packed weight per expert
            n += m.pack_experts(batch_hint)
        elif hasattr(m, "packed") and isinstance(getattr(m, "weight", None), torch.Tensor):
            m.packed = pack(m.weight, batch_hint)
            n += m.packed is not None
    return n
