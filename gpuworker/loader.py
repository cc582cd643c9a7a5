"""Reading a local Hugging Face folder: config, generation config, and the
safetensors weights (one file or sharded with an index), tensor by tensor."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open


def load_hf_config(folder: str) -> Any:
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"{folder} has no config.json (not a Hugging Face checkpoint folder)")
    return AutoConfig.from_pretrained(folder)


# A config that names no position limit (none of the supported families;
# vLLM's fallback too): the context it is served with.
DEFAULT_MAX_POSITIONS = 2048


def context_limits(hf_config: Any) -> tuple[int, int | None]:
    """(position limit, sliding window or None) from the config itself: a
    window counts unless the config says it is off (Qwen2's use_sliding_window)."""
    model_max = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or DEFAULT_MAX_POSITIONS
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", True) else None
    return model_max, window


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


def iter_weights(folder: str, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, with a progress
    bar over the shards on stderr."""
    files = safetensors_files(folder)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(files), desc="Loading safetensors shards", unit="shard", file=sys.stderr, leave=False)
    try:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
