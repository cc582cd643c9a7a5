"""Which model class serves a checkpoint, and building it without a random
init. Every class has the same surface: ``num_layers``, ``num_kv_heads``
(this rank's), ``total_kv_heads``, ``head_dim``, ``init_buffers``,
``forward(input_ids, positions, kv_caches, meta) -> hidden``,
``compute_logits`` (full vocabulary on every rank) and ``load_weights``;
constructors take ``(hf_config, tp)``. A class whose loader takes GGUF blocks
as they are (``kernels.quant.QuantWeight``) sets ``quantized_weights``."""
from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.common.architectures import ARCHITECTURES, architecture_of, unsupported
from pagedserve.gpuworker.distributed import SINGLE, TPGroup
from pagedserve.gpuworker.gguf_weights import dense

def model_class(hf_config: Any) -> type[nn.Module]:
    arch = architecture_of(hf_config)
    if arch is None:
        archs = list(getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")])
        raise ValueError(unsupported("this model", archs))
    module, cls = ARCHITECTURES[arch].split(":")
    return getattr(importlib.import_module(f"pagedserve.gpuworker.{module}"), cls)  # type: ignore[no-any-return]


def build_model(
    hf_config: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    tp: TPGroup = SINGLE,
) -> nn.Module:
    """Construct on the meta device (no random init), materialize empty on
    ``device`` in ``dtype``, then fill this rank's slices from the checkpoint."""
    cls = model_class(hf_config)
    if not getattr(cls, "quantized_weights", False):  # its loader reshapes tensors: GGUF blocks dequantized
        weights = ((name, dense(t)) for name, t in weights)
    with torch.device("meta"):
        model = cls(hf_config, tp)  # type: ignore[call-arg]
    model = model.to(dtype).to_empty(device=device)  # cast on meta: no full-precision copy on the device
    model.load_weights(weights)  # type: ignore[operator]
    model.init_buffers(max_position, device)  # type: ignore[operator]
    return model.eval().requires_grad_(False)
