"""Refusing, before anything loads, a model we cannot serve: an architecture
missing from the model registry, a quantized safetensors checkpoint, a GGUF
file transformers cannot read, or one holding a tensor type the quantized
kernels do not implement. Reads only config.json, or a GGUF file's metadata
and tensor table (never its tensors), so ``pagedserve serve`` says so in one
line instead of starting four processes that fail."""
from __future__ import annotations

import json
import os
import struct
from types import SimpleNamespace
from typing import Any

from pagedserve.common.architectures import architecture_of, unsupported
from pagedserve.common.hub_cache import is_hub_id, resolve_hub_id


class UnservableModel(ValueError):
    """A model we do not serve; the message names what is missing and what is supported."""


# GGUF tensor types the worker serves: floats, and the blocks kernels/quant.py multiplies by
# (its GGML_QUANT_TYPES; tests/test_quant_serve.py holds the two lists equal; common/ cannot import kernels/).
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")
GGUF_QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")
SUPPORTED_WEIGHTS = ("unquantized checkpoints (float32, float16, bfloat16) and GGUF files "
                     f"(tensors {', '.join(GGUF_FLOAT_TYPES + GGUF_QUANT_TYPES)}, served quantized)")

# transformers' legacy GGUF reader (modeling_gguf_pytorch_utils.load_gguf_checkpoint) renames these
# GGUF architectures (matched as substrings, in this order) before looking them up ...
_GGUF_RENAMES = (("qwen2moe", "qwen2_moe"), ("gpt_oss", "gpt_oss"), ("gpt-oss", "gpt_oss"),
                 ("qwen3moe", "qwen3_moe"), ("minimax-m2", "minimax_m2"))
# ... and then serves these model types as their text-only backbone.
_TEXT_BACKBONE = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
_NOT_ARCHS = ("general", "tokenizer")  # keys of its config mapping that are no architectures


def engine_refusal(cfg: Any, revision: str = "main") -> str | None:
    """For an EngineConfig: the one-line reason ``cfg.model`` cannot be served,
    else None (also when it is not there: ``resolve_model`` reports that)."""
    if cfg.worker == "sim":  # the simulated worker loads no model
        return None
    try:
        check_servable(cfg.model, revision, cfg.hf_overrides)
    except UnservableModel as e:
        return str(e)
    return None


def check_servable(model: str | None, revision: str = "main", overrides: str | dict[str, Any] | None = None) -> None:
    """Raises ``UnservableModel`` for ``model`` (a folder, a cached hub id or a
    .gguf file; None is the embedded default, always served). A model that
    cannot be found is left to ``resolve_model`` to report."""
    if model is None:
        return
    if model.lower().endswith(".gguf") and os.path.isfile(model):
        check_gguf(model)
        return
    folder = model if os.path.isdir(model) else None
    if folder is None and is_hub_id(model):
        try:
            folder = resolve_hub_id(model, revision)
        except FileNotFoundError:
            return
    path = os.path.join(folder, "config.json") if folder else ""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        config = json.load(f)
    if isinstance(overrides, str):
        overrides = json.loads(overrides)
    config.update(overrides or {})
    check_config(config, model)


def check_config(config: dict[str, Any], model: str) -> None:
    """config.json's architectures and quantization, as a dict."""
    quant = config.get("quantization_config") or config.get("compression_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise UnservableModel(f"{model}: quantization_config quant_method {method!r} is not supported (the "
                              f"quantized kernels serve GGUF blocks only); supported: {SUPPORTED_WEIGHTS}")
    archs = config.get("architectures") or []
    if architecture_of(SimpleNamespace(architectures=archs)) is None:
        raise UnservableModel(unsupported(str(model), archs or [f"(model_type {config.get('model_type', '?')!r})"]))


def _gguf_model_type(arch: str, name: str | None) -> str | None:
    """The model type transformers gives a GGUF architecture, or None if it cannot read it."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    readable = [a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in _NOT_ARCHS]
    updated = "mistral" if "llama" in arch and name == "mistral" else arch  # its exact test
    for needle, renamed in _GGUF_RENAMES:
        if needle in arch:
            updated = renamed
            break
    if arch not in readable and updated not in readable:
        return None
    return _TEXT_BACKBONE.get(updated, updated)


def served_gguf_architectures() -> list[str]:
    """GGUF architectures (as files spell them) that transformers reads and the registry serves."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    spelled = {renamed: needle for needle, renamed in _GGUF_RENAMES}
    out = []
    for arch in GGUF_SUPPORTED_ARCHITECTURES:
        model_type = _gguf_model_type(spelled.get(arch, arch), None)
        hf_arch = causal.get(model_type or "")
        if hf_arch and architecture_of(SimpleNamespace(architectures=[hf_arch])):
            out.append(spelled.get(arch, arch))
    return sorted(out)


def check_gguf(path: str) -> None:
    """From the file's metadata only: transformers reads its architecture and
    tokenizer, and the model type it becomes is one we serve."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS, get_gguf_config, read_gguf_metadata
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_TYPES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

    name = os.path.basename(path)
    try:
        metadata, tensor_names = read_gguf_metadata(path)
    except (ValueError, KeyError, IndexError, OSError) as e:
        raise UnservableModel(f"{name}: not a readable GGUF file ({e})") from None
    arch = str(metadata["general.architecture"])
    if arch in GGUF_CONFIG_ARCHS:
        model_type = get_gguf_config(metadata, tensor_names).get("model_type")
    else:
        model_type = _gguf_model_type(arch, metadata.get("general.name"))
    served = ", ".join(served_gguf_architectures())
    if model_type is None:
        raise UnservableModel(f"{name}: transformers cannot read GGUF architecture {arch!r}; GGUF architectures "
                              f"supported: {served}")
    hf_arch = causal.get(model_type)
    if hf_arch is None or architecture_of(SimpleNamespace(architectures=[hf_arch])) is None:
        raise UnservableModel(f"{name}: GGUF architecture {arch!r} ({hf_arch or model_type}) is not supported; "
                              f"GGUF architectures supported: {served}")
    tokenizer = metadata.get("tokenizer.ggml.model")
    if tokenizer not in GGUF_TOKENIZER_TYPES:
        raise UnservableModel(f"{name}: transformers cannot read its GGUF tokenizer {tokenizer!r}; GGUF tokenizers "
                              f"supported: {', '.join(sorted(GGUF_TOKENIZER_TYPES))}")
    check_gguf_types(path)


def check_gguf_types(path: str) -> None:
    """Every tensor's type is one the worker serves (from the tensor table: no data read)."""
    import gguf
    from transformers.integrations.gguf.reader import _mapped, _read_metadata, _read_tensor_table

    name = os.path.basename(path)
    try:
        blob = _mapped(path)
        _, count, pos = _read_metadata(blob, path)
        entries, _ = _read_tensor_table(blob, count, pos)
    except (ValueError, KeyError, IndexError, OSError, struct.error) as e:
        raise UnservableModel(f"{name}: not a readable GGUF file ({e})") from None
    found: dict[str, str] = {}  # type -> the first tensor of it
    for tensor, _, code, _ in entries:
        try:
            qtype = gguf.GGMLQuantizationType(code).name
        except ValueError:
            qtype = f"ggml type {code}"
        found.setdefault(qtype, tensor)
    bad = [t for t in found if t not in GGUF_FLOAT_TYPES + GGUF_QUANT_TYPES]
    if bad:
        raise UnservableModel(f"{name}: GGUF tensor type {', '.join(bad)} (e.g. {found[bad[0]]}) is not supported; "
                              f"supported: {', '.join(GGUF_FLOAT_TYPES + GGUF_QUANT_TYPES)}")
