"""Batched PagedAttention for CPU serving: no Python loop over sequences.

``paged_attention_cpu`` runs the compiled kernel (``cpu_attention.cpp``: one
call per layer, K/V read in place from the pool; sliding windows and softcaps
included) and falls back to ``paged_attention_sdpa`` where it cannot (no
compiler, another dtype, attention sinks): a
vectorised gather of each sequence's blocks plus one ``scaled_dot_product_
attention`` call per group of sequences. Decodes form one group; prefill
chunks are grouped so that padding at most doubles the work.

Same contract as ``reference.paged_attention_ref``; tests hold both to the
float64 reference.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_build
from pagedserve.kernels.fp8 import dequantize, is_fp8, unit_scale

# The compiled library's dtype argument (every entry point, cpu_ops.py's too, takes it first).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Its kv_dtype argument (cpu_common.h): the pool in q's dtype, or an fp8 format.
KV_SAME = 0
FP8_CODES = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
_ONE = unit_scale("cpu")  # what the library reads as a scale when the caller gives none


def kv_code(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> int | None:
    """The library's kv_dtype code for a pool of ``kv_dtype`` read with ``q_dtype`` (None: not supported)."""
    if kv_dtype == q_dtype:
        return KV_SAME
    return FP8_CODES.get(kv_dtype)


def scale_ptr(scale: torch.Tensor | None) -> int:
    """The address of a layer's scale as the library reads it (one float32 on the CPU)."""
    if scale is None:
        return _ONE.data_ptr()
    if scale.dtype != torch.float32 or scale.device.type != "cpu" or scale.numel() != 1:
        raise ValueError(f"a KV scale must be one float32 on the CPU, got {scale.dtype} {tuple(scale.shape)} on {scale.device}")
    return scale.data_ptr()


def _int32(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Block tables, lengths and offsets as the library reads them: contiguous int32."""
    return tuple(t.to(torch.int32).contiguous() for t in tensors)


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    lib = cpu_build.load()
    code = DTYPE_CODES.get(q.dtype)
    kv = kv_code(q.dtype, k_cache.dtype)
    if (lib is None or code is None or kv is None or q.device.type != "cpu" or v_cache.dtype != k_cache.dtype
            or sinks is not None):  # the compiled kernel has no sinks
        return paged_attention_sdpa(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                    k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
                                    softcap=softcap, sinks=sinks)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        q = q.contiguous()  # a token's heads must be one row; tokens may be strided (views into fused QKV)
    tables, lens, qsl = _int32(block_tables, seq_lens, query_start_loc)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV pool must be contiguous")
    if out is None or not out.is_contiguous():
        result = torch.empty(q.shape, dtype=q.dtype)
    else:
        result = out
    rc = lib.pagedserve_paged_attention_ex(
        code, kv, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        qsl.data_ptr(), result.data_ptr(), lens.numel(), q.shape[1], k_cache.shape[2], q.shape[2],
        k_cache.shape[1], tables.shape[1], q.stride(0), ctypes.c_float(scale), scale_ptr(k_scale), scale_ptr(v_scale),
        sliding_window or 0, ctypes.c_float(softcap or 0.0),
    )
    if rc != 0:
        raise ValueError(f"paged attention: bad shapes (code {rc})")
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def cascade_groups(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   block_size: int) -> list[tuple[int, int, int]]:
    """The compiled kernel's shared-prefix groups for a batch: (first sequence,
    end, shared leading blocks) each, read once for the whole group."""
    lib = cpu_build.load()
    if lib is None:
        raise RuntimeError("the compiled CPU kernel is not available")
    tables, lens, qsl = _int32(block_tables, seq_lens, query_start_loc)
    out = torch.empty(3 * max(1, lens.numel()), dtype=torch.int32)
    n = lib.pagedserve_cascade_groups(tables.data_ptr(), tables.shape[1], lens.data_ptr(), qsl.data_ptr(),
                                      lens.numel(), block_size, out.data_ptr(), lens.numel())
    return [tuple(out[3 * i:3 * i + 3].tolist()) for i in range(n)]


def paged_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sliding_window``, ``softcap`` and ``sinks`` as in ``reference.paged_attention_ref``."""
    if out is None:
        out = torch.empty_like(q)
    qsl = query_start_loc.long()
    q_lens = (qsl[1:] - qsl[:-1]).tolist()
    lens = seq_lens.tolist()
    scales = (k_scale, v_scale) if is_fp8(k_cache.dtype) else (None, None)
    for group in _groups(q_lens, lens):
        _attend(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, out, group, q_lens, lens, scales,
                Extras(sliding_window, softcap, sinks))
    return out


@dataclass(frozen=True)
class Extras:
    """What some families add to plain causal attention (see ``reference.py``)."""

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


def _groups(q_lens: list[int], lens: list[int]) -> list[list[int]]:
    """All decodes together; prefill chunks by length, a group growing while its
    padded size (count x longest query x longest context) stays within twice
    the real one."""
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    groups = [decodes] if decodes else []
    current: list[int] = []
    real = widest = longest = 0
    for i in sorted((i for i, n in enumerate(q_lens) if n > 1), key=lambda i: (lens[i], q_lens[i]), reverse=True):
        cost = q_lens[i] * lens[i]
        w, n = max(widest, q_lens[i]), max(longest, lens[i])
        if current and (len(current) + 1) * w * n > 2 * (real + cost):
            groups.append(current)
            current, real, w, n = [], 0, q_lens[i], lens[i]
        current.append(i)
        real, widest, longest = real + cost, w, n
    if current:
        groups.append(current)
    return groups


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, qsl: torch.Tensor, scale: float, out: torch.Tensor, group: list[int],
            q_lens: list[int], lens: list[int], scales: tuple[torch.Tensor | None, torch.Tensor | None],
            extras: Extras = Extras()) -> None:
    block_size = k_cache.shape[1]
    idx = torch.tensor(group, dtype=torch.long)
    max_len, max_q = max(lens[i] for i in group), max(q_lens[i] for i in group)
    width = (max_len + block_size - 1) // block_size
    blocks = block_tables[idx, :width].long()
    k = dequantize(k_cache[blocks].flatten(1, 2), scales[0], q.dtype)  # [n, width * block_size, kv_heads, head_dim]
    v = dequantize(v_cache[blocks].flatten(1, 2), scales[1], q.dtype)
    seq_len = seq_lens[idx].long()[:, None]  # [n, 1]
    q_len = torch.tensor([q_lens[i] for i in group], dtype=torch.long)[:, None]
    j = torch.arange(max_q)[None, :]
    valid = j < q_len
    rows = torch.where(valid, qsl[idx][:, None] + j, 0)  # padded query rows read row 0, then are dropped
    q_pos = seq_len - q_len + j  # absolute position of each query
    k_pos = torch.arange(k.shape[1])
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # causal; hides the padding too
    if extras.sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - extras.sliding_window
    # Masking alone is not enough: 0 * NaN from a stale or padding slot would still reach the output.
    filled = (k_pos[None, :] < seq_len)[:, :, None, None]
    k, v = k.where(filled, 0), v.where(filled, 0)
    if extras.softcap is None and extras.sinks is None:
        o = F.scaled_dot_product_attention(
            q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
            scale=scale, enable_gqa=True,
        )  # [n, heads, max_q, head_dim]
    else:
        o = _attend_extras(q[rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None], scale, extras)
    out[rows[valid]] = o.transpose(1, 2)[valid].to(out.dtype)


def _attend_extras(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   extras: Extras) -> torch.Tensor:
    """SDPA spelled out, for what it cannot do: softcapped scores, sink logits.
    q [n, H, Q, D], k/v [n, KV, L, D], mask [n, 1, Q, L] -> [n, H, Q, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if extras.softcap is not None:
        scores = extras.softcap * torch.tanh(scores / extras.softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if extras.sinks is not None:
        sink = extras.sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)
