"""Reading a local Hugging Face folder: config (with --hf-overrides), generation
config, and the weights tensor by tensor: safetensors or PyTorch .bin files (one
or sharded with an index), or random values of the checkpoint's shapes
(--load-format dummy)."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open


def load_hf_config(folder: str, overrides: str | None = None, trust_remote_code: bool = False) -> Any:
    """``overrides``: --hf-overrides' JSON object, applied over config.json (vLLM's hf_overrides)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{folder} has no config.json (not a Hugging Face checkpoint folder)")
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if overrides is not None:
        _override(config, json.loads(overrides))
    _refuse_quantized(config, folder)
    return config


def _refuse_quantized(config: Any, folder: str) -> None:
    """Quantized weights would load as garbage: no kernel reads them. serve and
    gpuworker refuse these before starting (common/model_check.py); this is
    the backstop for a ModelRunner built directly."""
    from pagedserve.common.model_check import SUPPORTED_WEIGHTS, UnservableModel

    quant = getattr(config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        raise UnservableModel(f"{folder}: quantization_config quant_method {str(method or 'unknown')!r} is not "
                              f"supported (the quantized kernels serve GGUF blocks only); supported: {SUPPORTED_WEIGHTS}")


def _override(config: Any, values: dict[str, Any]) -> None:
    from transformers import PretrainedConfig

    for key, value in values.items():
        sub = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(sub, PretrainedConfig):  # e.g. text_config
            _override(sub, value)
        else:
            setattr(config, key, value)


# A config that names no position limit (none of the supported families;
# vLLM's fallback too): the context it is served with.
DEFAULT_MAX_POSITIONS = 2048


def context_limit(hf_config: Any) -> int:
    """The position limit from the config itself."""
    return int(getattr(hf_config, "max_position_embeddings", 0) or 0) or DEFAULT_MAX_POSITIONS


def eos_token_ids(folder: str, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several, e.g. Llama 3
    instruct) and config.json, in that order, without duplicates."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    path = os.path.join(folder, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            add(json.load(f).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    return tuple(ids)


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def _bin_files(folder: str) -> list[str]:
    index = os.path.join(folder, "pytorch_model.bin.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return [os.path.join(folder, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    files = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".bin")
                   and n.startswith("pytorch_model"))
    if not files:
        raise FileNotFoundError(f"{folder} has no pytorch_model*.bin weights")
    return files


def _has_safetensors(folder: str) -> bool:
    return any(n.endswith(".safetensors") for n in os.listdir(folder))


DUMMY_RANGE = 1e-3  # vLLM's initialize_dummy_weights: uniform in [-1e-3, 1e-3]


def dummy_weights(folder: str, hf_config: Any, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Random tensors with the checkpoint's names and shapes (read from the
    safetensors headers, no data), or, with no weight files, those of
    transformers' model for the config, built on the meta device."""
    if _has_safetensors(folder):
        shapes = []
        for path in safetensors_files(folder):
            with safe_open(path, framework="pt", device="cpu") as f:
                shapes += [(n, tuple(f.get_slice(n).get_shape())) for n in f.keys()]
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        shapes = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes:
        yield name, torch.empty(shape).uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)


def iter_weights(folder: str, progress: bool = True, load_format: str = "auto",
                 hf_config: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, with a progress
    bar over the shards on stderr. ``load_format``: vLLM's auto (safetensors,
    else .bin), safetensors, pt or dummy (needs ``hf_config`` without weight files)."""
    if load_format == "dummy":
        yield from dummy_weights(folder, hf_config)
        return
    pt = load_format == "pt" or (load_format == "auto" and not _has_safetensors(folder)
                                 and os.path.isfile(os.path.join(folder, "config.json")) and _any_bin(folder))
    files = _bin_files(folder) if pt else safetensors_files(folder)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), desc="Loading safetensors shards", unit="shard", file=sys.stderr, leave=False)
    try:
        for path in files:
            if pt:
                yield from torch.load(path, map_location="cpu", weights_only=True, mmap=True).items()
            else:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _any_bin(folder: str) -> bool:
    return any(n.startswith("pytorch_model") and n.endswith(".bin") for n in os.listdir(folder))
