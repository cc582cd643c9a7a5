"""Plain-torch paged attention: the CPU serving path and the reference that
the Triton kernels are tested against (run it in float64 for a ground truth).

Contract shared with ``paged_attention`` (the Triton kernel):
  q            [num_tokens, num_heads, head_dim], new tokens of all sequences, flattened
  k_cache      [num_blocks, block_size, num_kv_heads, head_dim] (v_cache alike)
  block_tables int32 [num_seqs, max_blocks_per_seq]
  seq_lens     int32 [num_seqs], tokens in the cache per sequence, new ones included
  query_start_loc int32 [num_seqs + 1], cumulative query counts
Sequence i's queries are its last ``query_start_loc[i+1] - query_start_loc[i]``
positions, causally masked.
  k_scale, v_scale  float32 one-element tensors: the layer's scales of an fp8
               pool (``fp8.py``; None: 1.0), ignored for other pools
  sliding_window   a query at position p sees keys at p - window < k <= p
               (transformers' convention); None: every earlier key
  softcap      scores become softcap * tanh(scores / softcap) (Gemma); None: off
  sinks        float32 [num_heads]: a learned logit per head that joins each
               softmax's denominator and attends to nothing (gpt-oss); None: off
"""
from __future__ import annotations

import torch

from pagedserve.kernels.fp8 import dequantize, quantize


def paged_attention_ref(
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
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :n_blocks].long()
        k = dequantize(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], k_scale, acc_dtype)
        v = dequantize(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], v_scale, acc_dtype)
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qi = q[q_lo:q_hi].to(acc_dtype).transpose(0, 1)  # [H, q_len, D]
        scores = torch.matmul(qi, k.transpose(1, 2)) * scale  # [H, q_len, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:  # one more logit per head in the denominator, with no value
            sink = sinks.to(acc_dtype)[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their slots
    (slot = block * block_size + offset); negative slots are skipped. fp8
    pools store them quantized with the layer's scales (``fp8.quantize``)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
    v_flat = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
    k_flat[slots] = quantize(key[keep], k_scale, k_cache.dtype)
    v_flat[slots] = quantize(value[keep], v_scale, v_cache.dtype)


def copy_blocks_ref(kv_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: torch.Tensor) -> None:
    """Copy-on-write: for every layer, block ``dst`` becomes a copy of ``src``.
    ``pairs`` is int64 [num_copies, 2] of (src, dst)."""
    if pairs.numel() == 0:
        return
    src, dst = pairs[:, 0].long(), pairs[:, 1].long()
    for k_cache, v_cache in kv_caches:
        k_cache[dst.to(k_cache.device)] = k_cache[src.to(k_cache.device)]
        v_cache[dst.to(v_cache.device)] = v_cache[src.to(v_cache.device)]


def swap_blocks_ref(src_pool: torch.Tensor, dst_pool: torch.Tensor, mapping: torch.Tensor) -> None:
    """dst_pool[dst] = src_pool[src] for every (src, dst) row of ``mapping``;
    the pools may live on different devices (GPU <-> pinned CPU)."""
    if mapping.numel() == 0:
        return
    src, dst = mapping[:, 0].long(), mapping[:, 1].long()
    dst_pool[dst.to(dst_pool.device)] = src_pool[src.to(src_pool.device)].to(dst_pool.device)
