"""Tensor-parallel linear layers and the checkpoint loader that fills them.

Megatron-style: a column-parallel layer keeps a slice of the output features
(its heads of Q/K/V, its columns of gate/up), so its output stays sharded; the
row-parallel layer after it keeps the matching input slice and all-reduces
its partial sums. The vocabulary is split in equal (padded) slices for the
embedding (masked lookup + all-reduce) and the LM head (all-gather of the
logit slices). With a group of one, every layer is a plain linear/embedding.

Every rank reads the full checkpoint tensors and copies only its slice;
``WeightLoader`` checks that each slice of each parameter was filled.

A GGUF weight may arrive quantized (``kernels.quant.QuantWeight``): a layer
then keeps the blocks (``qweights``; its dense ``weight`` shrinks to an empty
placeholder of the model's dtype) and multiplies by them with ``quant_linear``.
Column-parallel slices are rows of blocks; a row-parallel slice must fall on
block boundaries, or that layer is dequantized (``gguf_weights.column_slice``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.cpu_gemm import PackedWeight, linear
from pagedserve.gpuworker.distributed import SINGLE, TPGroup, head_range, split_range
from pagedserve.gpuworker.gguf_weights import Weight, column_slice, dense, embedding_rows, merge_rows
from pagedserve.kernels.quant import QuantWeight, dequantize, packed_parts, quant_linear, quant_linear_parts


def _check(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"shape mismatch for {name}: checkpoint {got} vs model {want}")


def _quantize_layer(module: nn.Module, qweights: list[QuantWeight]) -> None:
    """Keep ``qweights`` and drop the dense weight (an empty one keeps the dtype and device others read)."""
    device = module.weight.device
    module.qweights = [w if w.data.device == device else QuantWeight(w.data.to(device), w.qtype, w.shape)
                       for w in qweights]
    module.qparts = None  # the kernels' view of the blocks, once packed (_quant_forward)
    module.weight = nn.Parameter(torch.empty(0, dtype=module.weight.dtype, device=module.weight.device),
                                 requires_grad=False)


def _quant_forward(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """By the layer's blocks: its parts (q/k/v of different types in Q4_K_M) in one compiled call,
    as the fused stack (cpu_fused.py) makes it, so the two agree bit for bit."""
    parts = module.qparts
    if parts is None or any(p is not w.packed for p, w in zip(parts.packed, module.qweights)):
        parts = module.qparts = packed_parts(module.qweights)  # built once, after pack_model repacks
    return quant_linear_parts(x, module.qweights, bias, parts)


class ColumnParallelLinear(nn.Module):
    """Output features split over ranks. ``full_sizes[i]`` is the row count of
    the i-th checkpoint tensor fused into this layer (q/k/v, or gate/up) and
    ``parts[i] = (start, size)`` the rows of it this rank keeps."""

    def __init__(self, in_features: int, full_sizes: list[int], parts: list[tuple[int, int]], bias: bool) -> None:
        super().__init__()
        self.in_features, self.full_sizes, self.parts = in_features, full_sizes, parts
        self.offsets = [sum(size for _, size in parts[:i]) for i in range(len(parts))]
        out = sum(size for _, size in parts)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.packed: PackedWeight | None = None  # on CPU, set by cpu_gemm.pack_model
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.qweights: list[QuantWeight] = []  # the blocks, when every part came quantized
        self.pending: dict[int, QuantWeight] = {}  # quantized parts until finish_load

    quantized_ok = True  # WeightLoader hands it QuantWeights

    @classmethod
    def split(cls, in_features: int, full_sizes: list[int], bias: bool, tp: TPGroup) -> ColumnParallelLinear:
        return cls(in_features, full_sizes, [split_range(n, tp) for n in full_sizes], bias)

    @property
    def num_shards(self) -> int:
        return len(self.parts)

    def load_shard(self, attr: str, tensor: Weight, shard: int) -> None:
        start, size = self.parts[shard]
        rest = (self.in_features,) if attr == "weight" else ()
        _check(f"{attr} part {shard}", tuple(tensor.shape), (self.full_sizes[shard], *rest))
        if isinstance(tensor, QuantWeight):
            self.pending[shard] = tensor if (start, size) == (0, tensor.shape[0]) else tensor.split_rows(start, start + size)
            return
        getattr(self, attr).data.narrow(0, self.offsets[shard], size).copy_(tensor.narrow(0, start, size))

    def finish_load(self) -> None:
        """Every part quantized: keep the blocks (runs of one type merged); some dense: dequantize the rest."""
        if len(self.pending) == self.num_shards:
            _quantize_layer(self, merge_rows([self.pending[i] for i in range(self.num_shards)]))
        else:
            for shard, w in self.pending.items():
                self.weight.data.narrow(0, self.offsets[shard], w.shape[0]).copy_(dequantize(w))
        self.pending = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweights:
            return _quant_forward(self, x, self.bias)
        return linear(x, self.weight, self.bias, self.packed)


def qkv_linear(hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: TPGroup) -> ColumnParallelLinear:
    """Q, K and V fused, holding this rank's query heads and the KV heads they read."""
    q0, nq, kv0, nkv = head_range(num_heads, num_kv_heads, tp)
    full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    parts = [(q0 * head_dim, nq * head_dim), (kv0 * head_dim, nkv * head_dim), (kv0 * head_dim, nkv * head_dim)]
    return ColumnParallelLinear(hidden, full, parts, bias)


class RowParallelLinear(nn.Module):
    """Input features split over ranks (``part`` of ``in_features``); the
    partial products are all-reduced, then the (unsplit) bias is added once."""

    def __init__(self, in_features: int, out_features: int, part: tuple[int, int], bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.in_features, self.out_features, self.part, self.tp = in_features, out_features, part, tp
        self.weight = nn.Parameter(torch.empty(out_features, part[1]))
        self.packed: PackedWeight | None = None  # on CPU, set by cpu_gemm.pack_model
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.qweights: list[QuantWeight] = []

    num_shards = 1
    quantized_ok = True

    def load_shard(self, attr: str, tensor: Weight, shard: int) -> None:
        if attr == "bias":
            _check("bias", tuple(tensor.shape), (self.out_features,))
            self.bias.data.copy_(dense(tensor))  # type: ignore[union-attr]
            return
        _check("weight", tuple(tensor.shape), (self.out_features, self.in_features))
        if isinstance(tensor, QuantWeight):
            kept = column_slice(tensor, *self.part)  # None: the split is not on block boundaries
            if kept is not None:
                _quantize_layer(self, [kept])
                return
        self.weight.data.copy_(dense(tensor).narrow(1, *self.part))

    def _local(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.qweights:
            return _quant_forward(self, x, bias)
        return linear(x, self.weight, bias, self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._local(x, self.bias)
        y = self.tp.all_reduce(self._local(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * per_rank, (rank + 1) * per_rank) of the vocabulary, padded
    with zero rows so every rank's slice (and logit slice) has one size. Also
    serves as the LM head (``logits``), tied or not."""

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.vocab_size, self.dim, self.tp = vocab_size, dim, tp
        self.per_rank = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.per_rank
        self.num_real = max(0, min(vocab_size, self.start + self.per_rank) - self.start)
        self.weight = nn.Parameter(torch.empty(self.per_rank, dim))
        self.packed: PackedWeight | None = None  # on CPU, set by cpu_gemm.pack_model
        # Quantized: this rank's real rows as blocks. The lookup dequantizes the rows it reads;
        # the LM head multiplies by the blocks, and pads the logit slice to per_rank.
        self.qweights: list[QuantWeight] = []

    num_shards = 1
    quantized_ok = True

    def load_shard(self, attr: str, tensor: Weight, shard: int) -> None:
        _check("weight", tuple(tensor.shape), (self.vocab_size, self.dim))
        if isinstance(tensor, QuantWeight) and self.num_real > 0:
            rows = self.start, self.start + self.num_real
            _quantize_layer(self, [tensor if rows == (0, self.vocab_size) else tensor.split_rows(*rows)])
            return
        self.weight.data.zero_()
        self.weight.data[: self.num_real].copy_(dense(tensor)[self.start : self.start + self.num_real])

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.qweights:
            return F.embedding(ids, self.weight)
        rows = embedding_rows(self.qweights[0], ids.reshape(-1))
        return rows.to(self.weight.dtype).reshape(*ids.shape, self.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_real)
        out = self._lookup(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, vocab_size] on every rank."""
        if self.qweights:
            local = quant_linear(hidden, self.qweights[0])
            if self.num_real < self.per_rank:  # this rank's padding rows: zero logits, as the dense slice has
                local = F.pad(local, (0, self.per_rank - self.num_real))
        else:
            local = linear(hidden, self.weight, None, self.packed)
        if self.tp.size == 1:
            return local
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]


class WeightLoader:
    """Routes checkpoint tensors to parameters (through a module's
    ``load_shard`` when it is split or fused), then checks completeness."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.loaded: set[tuple[str, int]] = set()

    def load(self, name: str, tensor: Weight, shard: int = 0) -> None:
        if name not in self.params:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        path, _, attr = name.rpartition(".")
        module = self.model.get_submodule(path)
        if isinstance(tensor, QuantWeight) and not getattr(module, "quantized_ok", False):
            tensor = dense(tensor)  # a layer with no quantized path (norms, experts, ...)
        if hasattr(module, "load_shard"):
            module.load_shard(attr, tensor, shard)
        else:  # replicated (norms, learned positions, ...)
            dst = self.params[name].data
            _check(name, tuple(tensor.shape), tuple(dst.shape))
            dst.copy_(tensor)
        self.loaded.add((name, shard))

    def finish(self) -> None:
        for m in self.model.modules():
            if hasattr(m, "finish_load"):
                m.finish_load()
        expected: set[tuple[str, int]] = set()
        for name in self.params:
            module = self.model.get_submodule(name.rpartition(".")[0])
            expected |= {(name, s) for s in range(getattr(module, "num_shards", 1))}
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {[f'{n}#{s}' for n, s in missing[:8]]}")
