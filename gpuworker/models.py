"""Which model class serves a checkpoint, and building it without a random
init. Every class has the same surface: ``num_layers``, ``num_kv_heads``
(this rank's), ``total_kv_heads``, ``head_dim``, ``init_buffers``,
``forward(input_ids, positions, kv_caches, meta) -> hidden``,
``compute_logits`` (full vocabulary on every rank) and ``load_weights``;
constructors take ``(hf_config, tp)``."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.gpuworker.distributed import SINGLE, TPGroup
from pagedserve.gpuworker.gpt2 import GPT2LMHeadModel
from pagedserve.gpuworker.llama import LlamaForCausalLM, Qwen2ForCausalLM
from pagedserve.gpuworker.opt import OPTForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # the runner caps max_model_len at the sliding window
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def model_class(hf_config: Any) -> type[nn.Module]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {archs or getattr(hf_config, 'model_type', '?')}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )


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
    with torch.device("meta"):
        model = cls(hf_config, tp)  # type: ignore[call-arg]
    model = model.to(dtype).to_empty(device=device)  # cast on meta: no full-precision copy on the device
    model.load_weights(weights)  # type: ignore[operator]
    model.init_buffers(max_position, device)  # type: ignore[operator]
    return model.eval().requires_grad_(False)
