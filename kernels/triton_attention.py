"""Triton PagedAttention: one kernel for prefill, decode, prefix-cached tails
and chunked prefill, reading K/V straight from the block pool.

Same contract as ``reference.paged_attention_ref`` (see there). Layout of the
work: a program owns one query tile of one sequence and one KV head, and holds
all query heads of that KV head's group, so its rows are
``BLOCK_Q tokens x GROUP_P heads`` (>= 16, the minimum ``tl.dot`` M). It walks
the sequence's keys ``BLOCK_N`` at a time through the block table with an
online softmax in fp32 (base 2). Query tiles are found on the device: program
``pid`` binary-searches ``query_start_loc // BLOCK_Q + seq_idx`` (the trick of
vLLM's unified attention), so the grid size ``num_tokens // BLOCK_Q +
num_seqs`` comes from shapes alone and the host never syncs.

Flash-decoding: with few programs and long contexts, a third grid axis splits
each sequence's keys into partitions; every partition writes a normalised
partial output and its log-sum-exp, and ``_reduce_kernel`` merges them.

Extras, each a constexpr switch that compiles away when off: a sliding window
(masked per row; a tile starts its key loop at its window, so keys far behind
it are never read, and split partitions count from there), a tanh softcap on
the scaled scores, and attention sinks (a per-head logit that seeds the online
softmax's running max and sum; with split partitions the reduction adds it).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8 import is_fp8, unit_scale

_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)  # the same, for use inside kernels


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with query_start_loc[i] // BLOCK_Q + i <= target."""
    left: tl.int32 = 0
    right: tl.int32 = num_seqs  # a tensor even if num_seqs was specialised to a constant
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= target:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _tanh(x):
    """tanh from exp2 (no libdevice: the interpreter has none); e <= 1, so nothing overflows."""
    e = tl.math.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|); a literal: -2.0 * _LOG2E_C broke in the interpreter
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    qk_scale, num_seqs, partition_size, window, softcap,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    stride_pt, stride_ph, stride_ps,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr,
):
    """Scores are in base 2: ``qk_scale`` is scale * log2(e), or scale / cap
    with SOFTCAP (``softcap`` is then cap * log2(e)); ``window`` is the sliding
    window (WINDOW only); ``sinks_ptr`` float32 [num_heads] (SINKS only)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq_idx(query_start_loc_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return  # padding program (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP_P  # query index inside the sequence
    g = rows % GROUP_P
    row_ok = (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    q_pos = context_len + tok  # absolute position, for the causal mask
    dims = tl.arange(0, HEAD_DIM_P)
    dim_ok = dims < HEAD_DIM

    # Keys this program reads: its partition, cut at the tile's last query.
    kv_hi = tl.minimum(seq_len, context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len))
    kv_lo = 0
    win_lo = 0
    if WINDOW:
        # The tile's first query sees keys from q_pos - window + 1: start there, on the BLOCK_N grid.
        win_lo = context_len + q_tile * BLOCK_Q - window + 1
        kv_lo = tl.maximum(win_lo, 0) // BLOCK_N * BLOCK_N
    if SPLIT:
        kv_lo = kv_lo + split * partition_size
        kv_hi = tl.minimum(kv_hi, kv_lo + partition_size)
        if kv_lo >= kv_hi:
            # Empty partition: tell the reduction to ignore it.
            lse_ptrs = part_lse_ptr + (q_start + tok) * stride_pt + head * stride_ph + split * stride_ps
            tl.store(lse_ptrs, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return

    q_ptrs = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    if KV_FP8:  # the layer's k scale folds into the score scale, its v scale into the output
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # -1e30, not -inf: rows with no key yet in this tile must not make inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS and not SPLIT:  # the sink is one more logit: the running max and sum start from it
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=-1.0e30).to(tl.float32) * _LOG2E_C
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + offs_n
        k_ok = k_pos < kv_hi
        if WINDOW:  # nor read keys behind every row's window (their blocks may be gone)
            k_ok = k_ok & (k_pos >= win_lo)
        phys = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot_off = k_pos % BLOCK_SIZE
        k = tl.load(
            k_ptr + phys[None, :] * stride_kb + slot_off[None, :] * stride_ks
            + kv_head * stride_kh + dims[:, None] * stride_kd,
            mask=k_ok[None, :] & dim_ok[:, None], other=0.0)  # [D, N]
        v = tl.load(
            v_ptr + phys[:, None] * stride_vb + slot_off[:, None] * stride_vs
            + kv_head * stride_vh + dims[None, :] * stride_vd,
            mask=k_ok[:, None] & dim_ok[None, :], other=0.0)  # [N, D]
        if KV_FP8:
            # fp8 -> fp32 is exact (and right in the interpreter, whose fp8 -> fp16 is not), then q's dtype:
            # every fp8 value is exact in fp16/bf16 too.
            k = k.to(tl.float32).to(q.dtype)
            v = v.to(tl.float32).to(q.dtype)
        elif DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if SOFTCAP:  # before the mask: tanh would turn -inf into a finite score
            s = softcap * _tanh(s)
        causal = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOW:
            causal = causal & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if SPLIT:
        # part_out is [num_tokens, num_heads, num_splits, HEAD_DIM] contiguous:
        # a row's offset is its part_lse offset times HEAD_DIM.
        base = (q_start + tok) * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + base, lse, mask=row_ok)
    else:
        o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, num_splits,
    stride_ot, stride_oh, stride_od,
    stride_pt, stride_ph, stride_ps,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS_P: tl.constexpr, SINKS: tl.constexpr,
):
    """Merge the partitions of one (token, head): a log-sum-exp weighted sum.
    With SINKS the head's sink joins the denominator here, once, not per partition."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    base = t * stride_pt + h * stride_ph + sp * stride_ps
    lse = tl.load(part_lse_ptr + base, mask=sp < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E_C
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # 0 for empty partitions
    live = lse > float("-inf")
    parts = tl.load(part_out_ptr + base[:, None] * HEAD_DIM + dims[None, :],
                    mask=live[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    denom = tl.sum(w, axis=0)
    if SINKS:
        denom += tl.math.exp2(sink - m)
    o = tl.sum(parts * w[:, None], axis=0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def _one(device: torch.device) -> torch.Tensor:
    return unit_scale(device)  # read only: the scale of an fp8 pool called without its layer's


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: any small number keeps the heuristics exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
    partition_size: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged attention (contract in ``reference.py``).

    Optional host-side hints, never required: ``max_seq_len`` and
    ``max_query_len`` (the worker knows them; without them the bounds come from
    shapes: ``block_tables.shape[1] * block_size`` and "decode iff
    num_tokens == num_seqs"). ``partition_size`` (a multiple of 16) forces the
    split-KV path with that partition; by default it is chosen when a
    decode-shaped batch would leave the GPU's SMs idle. ``k_scale`` /
    ``v_scale``: an fp8 pool's per-layer scales, one float32 each on the
    pool's device (``fp8.py``; None: 1.0); ignored for other pools.
    ``sliding_window``, ``softcap``, ``sinks`` (float [num_heads] on q's
    device): as in ``reference.py``; None: off, at no cost.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap}")
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
        sinks = sinks.to(device=q.device, dtype=torch.float32).contiguous()
    kv_fp8 = is_fp8(k_cache.dtype)
    if v_cache.dtype != k_cache.dtype or not (kv_fp8 or k_cache.dtype == q.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if kv_fp8:
        k_scale = _one(q.device) if k_scale is None else k_scale
        v_scale = _one(q.device) if v_scale is None else v_scale
    else:
        k_scale = v_scale = seq_lens  # unused
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    decode = max_query_len == 1 if max_query_len is not None else num_tokens == num_seqs
    block_m = max(16 if decode else 64, group_p)
    block_q = block_m // group_p
    block_n = 64 if head_dim_p <= 128 else 32
    dot_fp32 = _interpreting() and q.dtype == torch.bfloat16  # interpreter's bf16 dot is wrong
    precision = "ieee" if q.dtype == torch.float32 or dot_fp32 else "tf32"

    kv_bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
    programs = (num_seqs if decode else num_tokens // block_q + num_seqs) * num_kv_heads
    num_splits = 1
    if partition_size is not None:
        if partition_size % 16:
            raise ValueError(f"partition_size must be a multiple of 16, got {partition_size}")
        block_n = next(n for n in (block_n, 32, 16) if partition_size % n == 0)
    if sliding_window is not None:
        # Keys one tile reads: its window behind its first query (from a BLOCK_N-aligned start) to its last.
        kv_bound = min(kv_bound, sliding_window + block_q + block_n - 1)
    if partition_size is not None:
        num_splits = triton.cdiv(kv_bound, partition_size)
    elif decode and programs < 2 * _num_sms(q.device) and kv_bound >= 512:
        # Flash-decoding: enough partitions to fill the SMs twice, each >= 256 keys.
        num_splits = min(triton.cdiv(kv_bound, 256), triton.cdiv(2 * _num_sms(q.device), programs))
        partition_size = triton.cdiv(triton.cdiv(kv_bound, num_splits), block_n) * block_n
        num_splits = triton.cdiv(kv_bound, partition_size)
    split = num_splits > 1

    if split:
        part_out = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        pstrides = part_lse.stride()
    else:
        part_out = part_lse = out  # unused
        pstrides = (0, 0, 0)
    # With a softcap the kernel takes scores in units of the cap, and the cap in base 2.
    qk_scale = scale / softcap if softcap is not None else scale * _LOG2E
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        part_out, part_lse, k_scale, v_scale, seq_lens if sinks is None else sinks,
        qk_scale, num_seqs, partition_size or 0, sliding_window or 0, (softcap or 0.0) * _LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        block_tables.stride(0),
        *pstrides,
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_N=block_n,
        SPLIT=split, DOT_FP32=dot_fp32, PRECISION=precision, KV_FP8=kv_fp8,
        WINDOW=sliding_window is not None, SOFTCAP=softcap is not None, SINKS=sinks is not None,
        num_warps=4 if head_dim_p <= 128 else 8,
        # fp32 tiles at head_dim 256 would not fit shared memory twice over.
        num_stages=1 if q.dtype == torch.float32 and head_dim_p > 128 else 2,
    )
    if split:
        _reduce_kernel[(num_tokens, num_heads)](
            out, part_out, part_lse, seq_lens if sinks is None else sinks, num_splits,
            *out.stride(), *pstrides,
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS_P=triton.next_power_of_2(num_splits),
            SINKS=sinks is not None,
        )
    return out
