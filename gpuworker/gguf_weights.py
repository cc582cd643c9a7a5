"""A GGUF file's tensors for the worker, with the quantized ones kept as the
file's blocks (``kernels.quant.QuantWeight``) instead of dequantized.

Names follow transformers' GGUF loader (``get_gguf_hf_weights_map`` over the
config's model built on the meta device), so they match the converted folder
the other processes read. What transformers' tensor processor does to a tensor
is done here too: llama's converter permutes the rows of q and k per head
(``LlamaTensorProcessor``); for blocks, which run along the input dimension,
that is the same permutation of whole rows, so it is applied to the bytes.
A tensor that another processor would change (or that is not a 2-D weight,
or whose type is a float) is dequantized and processed exactly as transformers
does, so a family the quantized path does not cover still loads correctly.

The file is memory-mapped (transformers' GGUF header reader, gguf-py's for
block types that one lacks; gguf-py dequantizes what is not kept); each kept tensor is copied out of the map once,
so the worker's resident weights are the file's tensor bytes (plus the
kernels' packing, ``prepare``), and the map is dropped after loading.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from pagedserve.kernels import quant_cpu
from pagedserve.kernels.quant import QuantWeight, dequantize

Weight = torch.Tensor | QuantWeight
# PAGEDSERVE_GGUF_DEQUANTIZE=1: serve a GGUF file's dequantized weights (the converted folder's safetensors).
GGUF_DEQUANTIZE_ENV = "GGUF_DEQUANTIZE"
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _processor(arch: str, config: dict[str, Any]) -> Any:
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)


def _row_preserving(processor: Any) -> bool:
    """Processors that leave a 2-D non-norm weight as it is, or permute its rows (llama)."""
    from transformers.modeling_gguf_pytorch_utils import (
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        NemotronTensorProcessor,
        TensorProcessor,
    )

    return type(processor) in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor, NemotronTensorProcessor)


# transformers' model types that gguf-py spells otherwise (get_gguf_hf_weights_map)
_GGUF_MODEL_TYPES = {"cohere": "command-r", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3",
                     "gemma4_text": "gemma4", "umt5": "t5", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss"}


def _name_map(hf_config: Any, processor: Any, tensor_names: set[str]) -> dict[str, str]:
    """GGUF tensor name -> checkpoint name, as transformers maps them. Its
    ``get_gguf_hf_weights_map`` walks every submodule (20-40 s for SmolLM2 on a
    busy 2-core machine); one pass over the state dict maps the usual families
    and the walk runs only when that leaves a tensor of the file unmapped."""
    import gguf
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    model_type = _GGUF_MODEL_TYPES.get(hf_config.model_type, hf_config.model_type)
    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == model_type), None)
    out: dict[str, str] = {}
    if arch is not None:
        name_map = gguf.get_tensor_name_map(arch, hf_config.num_hidden_layers)
        for hf_name in model.state_dict():
            hf_name = processor.preprocess_name(hf_name)
            base, dot, suffix = hf_name.rpartition(".")
            if suffix not in ("weight", "bias"):
                base, dot, suffix = hf_name, "", ""
            gguf_name = name_map.get_name(base)
            if gguf_name is not None:
                out.setdefault(gguf_name + dot + suffix, hf_name)
    if tensor_names <= out.keys():
        return out
    return get_gguf_hf_weights_map(model, processor)  # type: ignore[no-any-return]


def _llama_rows(data: np.ndarray, name: str, config: dict[str, Any], processor: Any) -> np.ndarray:
    """Undoes llama.cpp's q/k permutation on whole rows (``LlamaTensorProcessor.process``)."""
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads is None or kv_heads is None:
        return data
    if ".attn_q." in name:
        return processor._reverse_permute_weights(data, heads, heads)  # type: ignore[no-any-return]
    if ".attn_k." in name:
        return processor._reverse_permute_weights(data, heads, kv_heads)  # type: ignore[no-any-return]
    return data


class _Tensor(NamedTuple):  # transformers' TensorInfo, as far as the loader reads it
    name: str
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    nbytes: int


class _Lazy:  # transformers' LazyGgufTensor: .data the bytes (a map), [()] a float tensor's values
    _FLOATS = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}

    def __init__(self, data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> None:
        self.data, self.ggml_type, self.shape = data, ggml_type, shape

    def __getitem__(self, _: Any) -> torch.Tensor:
        return torch.from_numpy(np.copy(self.data)).view(self._FLOATS[self.ggml_type]).reshape(self.shape)


def _read(path: str) -> tuple[str, list[Any], dict[str, Any]]:
    """(architecture, tensor table, lazy tensors by GGUF name): transformers' header reader (a
    fraction of a second), or gguf-py's where that one refuses a block type it has no size for
    (transformers 5.25 lacks Q5_0 and Q5_1, which Gemma 3's Q4_K_M file holds; gguf-py parses
    every metadata field, seconds for a 262k vocabulary)."""
    from transformers.integrations.gguf import GgufHeader, load_gguf_state_dict

    try:
        header = GgufHeader.from_file(path)
        return header.architecture, list(header.tensors), load_gguf_state_dict(header)
    except ValueError as e:
        if "not supported yet" not in str(e):
            raise
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    tensors, lazy = [], {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        info = _Tensor(t.name, shape, int(t.tensor_type), int(t.n_bytes))
        tensors.append(info)
        lazy[t.name] = _Lazy(t.data.reshape(-1).view(np.uint8), info.ggml_type, shape)
    _TENSOR_BYTES[_file_key(path)] = sum(t.nbytes for t in tensors)
    return str(arch), tensors, lazy


# The tensor bytes of files read with gguf-py, so gguf_tensor_bytes after loading does not parse
# the header again (seconds for Gemma 3's); keyed by path, size and time.
_TENSOR_BYTES: dict[tuple[str, int, int], int] = {}


def _file_key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def iter_gguf_weights(path: str | os.PathLike[str], hf_config: Any,
                      keep_quantized: bool = True) -> Iterator[tuple[str, Weight]]:
    """(checkpoint name, tensor or QuantWeight) for every tensor of the file that
    transformers would load; with ``keep_quantized`` False, every one dense."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    arch, tensors, lazy = _read(str(path))
    config = hf_config.to_dict()
    processor = _processor(arch, config)  # by the file's own spelling, as transformers picks it
    names = _name_map(hf_config, processor, {t.name for t in tensors})
    keep = keep_quantized and _row_preserving(processor)
    parsed: dict[str, Any] = {"config": config, "tensors": {}}
    for info in tensors:
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        raw = lazy.pop(info.name)
        if (keep and qtype.name not in FLOAT_TYPES and len(info.shape) == 2 and "norm" not in info.name
                and info.name in names):
            data = raw.data.reshape(info.shape[0], -1)  # rows of blocks, still the map
            if isinstance(processor, LlamaTensorProcessor):
                data = _llama_rows(data, info.name, config, processor)
            yield names[info.name], QuantWeight(torch.from_numpy(np.array(data, copy=True)), qtype.name, info.shape)
            continue
        if qtype.name in FLOAT_TYPES:
            weights = raw[()].float().numpy()
        else:
            weights = gguf.quants.dequantize(raw.data.reshape(info.shape[0], -1) if info.shape else raw.data, qtype)
        result = processor.process(weights=weights, name=info.name, tensor_key_mapping=names, parsed_parameters=parsed)
        if result.name in names:
            yield names[result.name], torch.from_numpy(np.array(result.weights, dtype=np.float32, copy=True))
    yield from parsed["tensors"].items()  # what a processor set aside itself (MoE experts)


def embedding_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (1-D) of ``w`` dequantized, float32 [len(ids), in_features]. A prepared
    weight holds only the kernels' packing, groups of ``quant_cpu.GROUP`` rows one after the
    other: the groups holding ``ids`` are unpacked, not the whole table (49152 rows for SmolLM2)."""
    n, k = w.shape
    if w.data is not None:
        return dequantize(QuantWeight(w.data.index_select(0, ids), w.qtype, (ids.numel(), k)))
    if ids.device.type == "cpu" and w.packed.device.type == "cpu":  # type: ignore[union-attr]
        out = quant_cpu.rows(w.packed, w.quant.code, n, k, ids)  # type: ignore[arg-type]
        if out is not None:  # the rows alone, in one call (a decode step's lookup: ~10 torch ops otherwise)
            return out
    groups, slot = torch.unique(ids // quant_cpu.GROUP, return_inverse=True)
    per_group = w.packed.numel() // -(-n // quant_cpu.GROUP)  # type: ignore[union-attr]
    packed = w.packed.view(-1, per_group).index_select(0, groups).reshape(-1)  # type: ignore[union-attr]
    part = QuantWeight(None, w.qtype, (groups.numel() * quant_cpu.GROUP, k), packed=packed)
    return dequantize(part).index_select(0, slot * quant_cpu.GROUP + ids % quant_cpu.GROUP)


def dense(w: Weight) -> torch.Tensor:
    """A weight as float32, dequantized if it is quantized."""
    return dequantize(w) if isinstance(w, QuantWeight) else w


def gguf_tensor_bytes(path: str | os.PathLike[str]) -> int:
    """The bytes of every tensor in the file (its size less header and metadata)."""
    known = _TENSOR_BYTES.get(_file_key(str(path)))
    return known if known is not None else sum(t.nbytes for t in _read(str(path))[1])


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """What the model holds resident: dense parameters and buffers, and the quantized
    weights (their blocks and packed copies), each counted once."""
    seen: set[int] = set()
    out = {"dense": 0, "buffers": 0, "quantized": 0}

    def count(key: str, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr not in seen:
            seen.add(ptr)
            out[key] += t.untyped_storage().nbytes()

    for p in model.parameters():
        count("dense", p)
    for b in model.buffers():
        count("buffers", b)
    for m in model.modules():
        for w in quant_weights(m):
            for t in (w.data, w.packed):
                if t is not None:
                    count("quantized", t)
    return out


def release_freed_heap() -> None:
    """Hands the heap that loading freed (blocks merged, repacked, dense placeholders) back to
    the system: glibc keeps it otherwise, and the worker's RSS stays 40 % over its weights
    (measured for SmolLM2 Q4_1: 140 MB before, 103 MB after, for 97 MB of tensors)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def quant_weights(module: nn.Module) -> list[QuantWeight]:
    """The quantized weights a layer holds (its ``qweights`` list, if any)."""
    return list(getattr(module, "qweights", None) or [])


def merge_rows(parts: list[QuantWeight]) -> list[QuantWeight]:
    """Fused parts (q/k/v, gate/up) as few weights as their types allow: runs of one type concatenated."""
    out: list[QuantWeight] = []
    for w in parts:
        if out and out[-1].qtype == w.qtype:
            prev = out.pop()
            w = QuantWeight(torch.cat([prev.data, w.data]), w.qtype, (prev.shape[0] + w.shape[0], w.shape[1]))
        out.append(w)
    return out


def column_slice(w: QuantWeight, start: int, size: int) -> QuantWeight | None:
    """Input features [start, start + size) of ``w`` (a row-parallel shard), or None where
    the slice cuts a block (the layer is then dequantized)."""
    if (start, size) == (0, w.shape[1]):
        return w
    block, nbytes = w.quant.block_size, w.quant.type_size
    if start % block or size % block:
        return None
    lo = start // block * nbytes
    return QuantWeight(w.data[:, lo : lo + size // block * nbytes].contiguous(), w.qtype, (w.shape[0], size))
