"""The architectures the worker serves: one table, read by the worker's
registry (gpuworker/models.py imports the class) and by the checks that
refuse a model before anything starts (common/model_check.py), which must
not import the worker."""
from __future__ import annotations

from typing import Any

# architecture -> "module:Class" under pagedserve.gpuworker, imported only when served
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:LlamaForCausalLM",  # every layer slides (layers.layer_sliding_window)
    "Qwen2ForCausalLM": "llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "phi3:Phi3ForCausalLM",
    "Gemma3ForCausalLM": "gemma3:Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM": "moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "moe:MixtralForCausalLM",
    "GptOssForCausalLM": "gpt_oss:GptOssForCausalLM",
    "OPTForCausalLM": "opt:OPTForCausalLM",
    "GPT2LMHeadModel": "gpt2:GPT2LMHeadModel",
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def architecture_of(hf_config: Any) -> str | None:
    """The first of the config's architectures that we serve, or None."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return arch
    return None


def unsupported(what: str, archs: list[str]) -> str:
    """The one line that refuses an architecture, wherever it is found."""
    return f"{what}: unsupported architecture {', '.join(archs) or '(none named)'}; supported: {', '.join(supported_architectures())}"
