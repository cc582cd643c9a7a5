"""The mixture-of-experts feed-forward shared by the MoE families (Qwen3-MoE,
Mixtral, gpt-oss): a router, top-k routing, and every expert's gated MLP over
a flat token batch.

Interface (stable; gpt_oss.py builds on it)::

    moe = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, tp,
                   bias=False, router_bias=False, routing=None, activation=None)
    out = moe(x)                             # x [T, H] -> [T, H], all-reduced over the TP group
    logits = moe.gate(x)                     # router logits [T, E], x's dtype
    weights, ids = moe.routing(logits)       # [T, k] each (ids int64)
    out = moe.experts(x, weights, ids)       # the experts alone (all-reduced)

Parameters (this rank's; what the checkpoint loader fills):
    gate.weight [E, H] (+ gate.bias [E])      the router, replicated
    w13.weight [E, 2 * I_r, H]               rows [0, I_r): this rank's gate columns, [I_r, 2 I_r): its up columns
    w13.bias [E, 2 * I_r]                    with bias=True
    w2.weight [E, H, I_r]                    this rank's columns of each expert's down projection
    w2.bias [E, H]                           with bias=True (added once, by rank 0, before the all-reduce)

``routing``: router logits [T, E] -> (weights [T, k], ids [T, k]); default
``softmax_topk(top_k)``. ``activation``: the gate/up halves [S, 2 I_r] (gate
first) -> [S, I_r]; default silu(gate) * up. A checkpoint in another layout
(gpt-oss: [E, H, 2I] with gate/up interleaved) goes through
``expert_entries(..., transposed=True, interleaved=True)``.

Tensor parallelism splits each expert's intermediate dimension (gate/up
columns, down rows) over the ranks, like a dense MLP.

The computation groups the (token, expert) pairs by expert: one stable sort,
then one GEMM per active expert on its contiguous slice of rows (never a loop
over tokens), then the weighted rows go back to their (token, slot) places
and the k slots of each token are summed.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpuworker.cpu_gemm import PackedWeight, linear, pack
from pagedserve.gpuworker.distributed import SINGLE, TPGroup, split_range
from pagedserve.gpuworker.layers import silu_and_mul
from pagedserve.gpuworker.linear import ColumnParallelLinear

Routing = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Activation = Callable[[torch.Tensor], torch.Tensor]


def softmax_topk(top_k: int, renormalize: bool = True, float32_weights: bool = False) -> Routing:
    """Softmax over the router logits (in float32, as transformers), then the
    top k. ``renormalize``: the k weights sum to one (Mixtral always; Qwen3-MoE
    when norm_topk_prob), which is the softmax over the top-k logits.
    ``float32_weights``: keep the weights in float32 (Mixtral) instead of
    casting them to the logits' dtype (Qwen3-MoE): it decides where a bf16
    model rounds."""

    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if float32_weights else weights.to(logits.dtype)), ids

    return route


class ExpertWeights(nn.Module):
    """One projection of every expert, [E, out, in] (+ bias [E, out]).

    ``column`` (gate/up): the output rows are ``len(full_sizes)`` checkpoint
    parts (gate, up), each split over the ranks; ``row`` (down): the input
    columns are split and the bias is whole. Loaded one expert part at a
    time: shard = expert * num_parts + part."""

    def __init__(self, num_experts: int, in_features: int, full_sizes: list[int], tp: TPGroup, bias: bool,
                 column: bool) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.full_sizes, self.column = num_experts, in_features, full_sizes, column
        if column:
            self.parts = [split_range(n, tp) for n in full_sizes]
            self.offsets = [sum(size for _, size in self.parts[:i]) for i in range(len(self.parts))]
            out, cols = sum(size for _, size in self.parts), in_features
        else:
            self.part = split_range(in_features, tp)
            out, cols = full_sizes[0], self.part[1]
        self.weight = nn.Parameter(torch.empty(num_experts, out, cols))
        self.bias = nn.Parameter(torch.empty(num_experts, out)) if bias else None

    @property
    def num_parts(self) -> int:
        return len(self.full_sizes) if self.column else 1

    @property
    def num_shards(self) -> int:
        return self.num_experts * self.num_parts

    def load_shard(self, attr: str, tensor: torch.Tensor, shard: int) -> None:
        """``tensor``: one expert's part as the checkpoint has it ([out, in] or [out])."""
        expert, part = divmod(shard, self.num_parts)
        dst = getattr(self, attr).data[expert]
        full = self.full_sizes[part] if self.column else self.full_sizes[0]
        want = (full, self.in_features) if attr == "weight" else (full,)
        if tuple(tensor.shape) != want:
            raise ValueError(f"shape mismatch for expert {expert} {attr} part {part}: checkpoint {tuple(tensor.shape)} vs {want}")
        if self.column:
            start, size = self.parts[part]
            dst.narrow(0, self.offsets[part], size).copy_(tensor.narrow(0, start, size))
        elif attr == "weight":
            dst.copy_(tensor.narrow(1, *self.part))
        else:
            dst.copy_(tensor)


def _expert_mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, packed: PackedWeight | None = None) -> None:
    """out = a @ w.T for one expert's rows (its own function, so a test can
    count the GEMMs); over the weight packed at load where there is one: MKL's
    sgemm re-packs the weight on every call and runs slowly on this CPU (cpu_gemm.py)."""
    if packed is None:
        torch.mm(a, w.t(), out=out)
    else:
        out.copy_(linear(a, w, None, packed))


def _grouped_ok(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch's grouped GEMM (no host sync: CUDA graphs can capture it) where it
    runs: CUDA sm80+, 16-bit, rows 16-byte aligned."""
    return (x.device.type == "cuda" and hasattr(F, "grouped_mm") and x.dtype in (torch.bfloat16, torch.float16)
            and all(d % 8 == 0 for d in (w13.shape[1], w13.shape[2], w2.shape[2]))
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


class FusedMoE(nn.Module):
    """Router + top-k routing + the experts' gated MLPs; see the module docstring."""

    # "loop" (CPU, eager CUDA), "grouped" (CUDA grouped_mm) or "dense" (every
    # expert on every row, masked: CUDA graph capture without grouped_mm); None: chosen per call
    path: str | None = None

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE,
                 *, bias: bool = False, router_bias: bool = False, routing: Routing | None = None,
                 activation: Activation | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.hidden_size, self.tp = num_experts, top_k, hidden_size, tp
        self.gate = ColumnParallelLinear(hidden_size, [num_experts], [(0, num_experts)], router_bias)  # replicated
        self.w13 = ExpertWeights(num_experts, hidden_size, [intermediate_size, intermediate_size], tp, bias, column=True)
        self.w2 = ExpertWeights(num_experts, intermediate_size, [hidden_size], tp, bias, column=False)
        self.routing: Routing = routing or softmax_topk(top_k)
        self.activation: Activation = activation or silu_and_mul
        self.packed: tuple[list[PackedWeight | None], list[PackedWeight | None]] | None = None  # pack_experts

    def pack_experts(self, batch_hint: int) -> int:
        """Each expert's gate/up and down packed for the CPU GEMM (cpu_gemm.pack_model); how many were."""
        self.packed = ([pack(w, batch_hint) for w in self.w13.weight], [pack(w, batch_hint) for w in self.w2.weight])
        return sum(p is not None for ps in self.packed for p in ps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing(self.gate(x))
        return self.experts(x, weights, ids)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t, all-reduced."""
        n, k = ids.shape
        w13, w2 = self.w13.weight, self.w2.weight
        flat = ids.reshape(-1)
        sorted_ids, order = torch.sort(flat, stable=True)  # pairs grouped by expert, in token order within one
        rows = x.index_select(0, order // k)  # [S, H], S = n * k
        path = self.path or ("grouped" if _grouped_ok(x, w13, w2) else
                             "dense" if x.is_cuda and torch.cuda.is_current_stream_capturing() else "loop")
        if path == "dense":
            out = self._dense(rows, sorted_ids)
        else:
            # ends[e]: one past expert e's last row (no host sync for the grouped path)
            experts = torch.arange(self.num_experts, device=x.device, dtype=sorted_ids.dtype)
            ends = torch.searchsorted(sorted_ids, experts, right=True)
            if path == "grouped":
                offs = ends.to(torch.int32)
                gate_up = F.grouped_mm(rows, w13.transpose(1, 2), offs=offs)
                h = self.activation(self._add_bias(gate_up, self.w13.bias, sorted_ids))
                out = F.grouped_mm(h.contiguous(), w2.transpose(1, 2), offs=offs)
            else:
                out = self._loop(rows, sorted_ids, ends.tolist())  # one host sync
        if self.w2.bias is not None and self.tp.rank == 0:  # once over the group, not once per rank
            out = out + self.w2.bias[sorted_ids]
        scaled = (out * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        back = torch.empty_like(scaled)
        back[order] = scaled  # (token, slot) order again
        return self.tp.all_reduce(back.view(n, k, self.hidden_size).sum(dim=1))

    def _loop(self, rows: torch.Tensor, sorted_ids: torch.Tensor, ends: list[int]) -> torch.Tensor:
        """One GEMM per active expert on its slice, for gate/up and for down."""
        w13, w2 = self.w13.weight, self.w2.weight
        spans = [(e, start, end) for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)) if end > start]
        p13, p2 = self.packed or ([None] * self.num_experts, [None] * self.num_experts)
        gate_up = rows.new_empty(rows.shape[0], w13.shape[1])
        for e, start, end in spans:
            _expert_mm(rows[start:end], w13[e], gate_up[start:end], p13[e])
        h = self.activation(self._add_bias(gate_up, self.w13.bias, sorted_ids)).contiguous()
        out = rows.new_empty(rows.shape[0], w2.shape[1])
        for e, start, end in spans:
            _expert_mm(h[start:end], w2[e], out[start:end], p2[e])
        return out

    def _dense(self, rows: torch.Tensor, sorted_ids: torch.Tensor) -> torch.Tensor:
        """Static shapes (CUDA graph capture): every expert over every row, each
        row keeping its own expert's result. E times the work; decode only."""
        w13, w2 = self.w13.weight, self.w2.weight
        out = rows.new_zeros(rows.shape[0], w2.shape[1])
        for e in range(self.num_experts):
            gate_up = F.linear(rows, w13[e], None if self.w13.bias is None else self.w13.bias[e])
            y = F.linear(self.activation(gate_up), w2[e])
            out = torch.where((sorted_ids == e).unsqueeze(-1), y, out)
        return out

    @staticmethod
    def _add_bias(x: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        return x if bias is None else x + bias[ids]


# Checkpoint names of an MoE block's tensors, relative to the block ("mlp."):
#   transformers 5 fused:  experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I] (+ _bias [E, 2I] / [E, H])
#   per expert:            experts.{e}.gate_proj/up_proj/down_proj.weight (Qwen), experts.{e}.w1/w3/w2.weight (Mixtral)
_PER_EXPERT = re.compile(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|bias)")
_PART = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
         "down_proj": ("w2", 0), "w2": ("w2", 0)}


def expert_entries(name: str, tensor: torch.Tensor, *, transposed: bool = False,
                   interleaved: bool = False) -> Iterator[tuple[str, torch.Tensor, int]] | None:
    """(FusedMoE parameter, tensor, shard) for one checkpoint tensor of an MoE
    block (``name`` relative to the block), or None for a name that is not
    an expert's. ``transposed``: the fused tensors are [E, in, out] (gpt-oss);
    ``interleaved``: gate/up rows alternate (gate even, up odd) instead of
    gate then up. The router (``gate.*``) is an ordinary parameter."""
    m = _PER_EXPERT.fullmatch(name)
    if m is not None:
        param, part = _PART[m.group(2)]
        expert = int(m.group(1))
        return iter([(f"{param}.{m.group(3)}", tensor, expert * (2 if param == "w13" else 1) + part)])
    fused = {"experts.gate_up_proj": ("w13", "weight"), "experts.down_proj": ("w2", "weight"),
             "experts.gate_up_proj_bias": ("w13", "bias"), "experts.down_proj_bias": ("w2", "bias")}.get(name)
    if fused is None:
        return None
    param, attr = fused
    if transposed and attr == "weight":
        tensor = tensor.transpose(1, 2)
    return _fused_entries(param, attr, tensor, interleaved)


def _fused_entries(param: str, attr: str, tensor: torch.Tensor, interleaved: bool) -> Iterator[tuple[str, torch.Tensor, int]]:
    for e in range(tensor.shape[0]):
        if param == "w2":
            yield f"w2.{attr}", tensor[e], e
            continue
        if interleaved:
            gate, up = tensor[e][0::2], tensor[e][1::2]
        else:
            gate, up = tensor[e].chunk(2, dim=0)
        yield f"w13.{attr}", gate, 2 * e
        yield f"w13.{attr}", up, 2 * e + 1
