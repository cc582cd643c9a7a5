"""Tensor-parallel linear layers and the checkpoint loader that fills them.

Megatron-style: a column-parallel layer keeps a slice of the output features
(its heads of Q/K/V, its columns of gate/up), so its output stays sharded; the
row-parallel layer after it keeps the matching input slice and all-reduces
its partial sums. The vocabulary is split in equal (padded) slices for the
embedding (masked lookup + all-reduce) and the LM head (all-gather of the
logit slices). With a group of one, every layer is a plain linear/embedding.

Every rank reads the full checkpoint tensors and copies only its slice;
``WeightLoader`` checks that each slice of each parameter was filled.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.cpu_gemm import PackedWeight, linear
from pagedserve.gpuworker.distributed import SINGLE, TPGroup, head_range, split_range


def _check(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"shape mismatch for {name}: checkpoint {got} vs model {want}")


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

    @classmethod
    def split(cls, in_features: int, full_sizes: list[int], bias: bool, tp: TPGroup) -> ColumnParallelLinear:
        return cls(in_features, full_sizes, [split_range(n, tp) for n in full_sizes], bias)

    @property
    def num_shards(self) -> int:
        return len(self.parts)

    def load_shard(self, attr: str, tensor: torch.Tensor, shard: int) -> None:
        start, size = self.parts[shard]
        rest = (self.in_features,) if attr == "weight" else ()
        _check(f"{attr} part {shard}", tuple(tensor.shape), (self.full_sizes[shard], *rest))
        getattr(self, attr).data.narrow(0, self.offsets[shard], size).copy_(tensor.narrow(0, start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    num_shards = 1

    def load_shard(self, attr: str, tensor: torch.Tensor, shard: int) -> None:
        if attr == "bias":
            _check("bias", tuple(tensor.shape), (self.out_features,))
            self.bias.data.copy_(tensor)  # type: ignore[union-attr]
            return
        _check("weight", tuple(tensor.shape), (self.out_features, self.in_features))
        self.weight.data.copy_(tensor.narrow(1, *self.part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, self.packed)
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
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

    num_shards = 1

    def load_shard(self, attr: str, tensor: torch.Tensor, shard: int) -> None:
        _check("weight", tuple(tensor.shape), (self.vocab_size, self.dim))
        self.weight.data.zero_()
        self.weight.data[: self.num_real].copy_(tensor[self.start : self.start + self.num_real])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.num_real)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, vocab_size] on every rank."""
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

    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        if name not in self.params:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        path, _, attr = name.rpartition(".")
        module = self.model.get_submodule(path)
        if hasattr(module, "load_shard"):
            module.load_shard(attr, tensor, shard)
        else:  # replicated (norms, learned positions, ...)
            dst = self.params[name].data
            _check(name, tuple(tensor.shape), tuple(dst.shape))
            dst.copy_(tensor)
        self.loaded.add((name, shard))

    def finish(self) -> None:
        expected: set[tuple[str, int]] = set()
        for name in self.params:
            module = self.model.get_submodule(name.rpartition(".")[0])
            expected |= {(name, s) for s in range(getattr(module, "num_shards", 1))}
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {[f'{n}#{s}' for n, s in missing[:8]]}")
