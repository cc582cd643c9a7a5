"""Attention extras (sliding window, tanh softcap, sinks) in every backend
against the float64 reference, and the reference against a plain dense
computation written independently of it (so a mistake both share cannot pass).

Batches as in test_kernels.py: shuffled blocks, NaN-poisoned padding and tails,
GQA, decodes, fresh prefills, prefix tails and prefill chunks, contexts across
several blocks. For the Triton kernel the keys behind every query's window are
poisoned too (NaN slots, block-table entries pointing at the NaN block): it
must not read them. On CPU the Triton kernel runs in the interpreter: keep the
shapes small.
"""
from __future__ import annotations

import pytest
import torch
from test_kernels import Batch, make_batch, rel_err, run_poisoned, seed  # noqa: F401 - fixture

from pagedserve.kernels import paged_attention, paged_attention_ref
from pagedserve.kernels.cpu_attention import paged_attention_cpu, paged_attention_sdpa

# (seq_len, q_len): long decodes whose window starts blocks in, a chunk and a
# fresh prefill longer than the small windows, short ones, a one-token prompt,
# a sequence with no queries this step.
SEQS = [(200, 1), (150, 40), (37, 1), (90, 90), (53, 13), (1, 1), (16, 16), (17, 0)]

CONFIGS = [  # (num_heads, num_kv_heads, head_dim, block_size)
    pytest.param(6, 2, 32, 8, id="gqa3-d32-bs8"),
    pytest.param(4, 1, 48, 16, id="mqa4-d48-bs16"),
]

# name -> (sliding_window, softcap, with sinks)
EXTRAS = {
    "window13": (13, None, False),  # smaller than most contexts, not a multiple of the block size
    "window500": (500, None, False),  # larger than every context: plain causal attention
    "softcap": (None, 1.5, False),
    "sinks": (None, None, True),
    "all": (24, 2.0, True),
}


def extras_for(name: str, num_heads: int, device: str = "cpu") -> dict:
    window, cap, with_sinks = EXTRAS[name]
    # Sinks around the scores' size, some far above them: heads that mostly attend to the sink.
    sinks = (torch.randn(num_heads) * 2 + torch.linspace(0, 3, num_heads)).to(device) if with_sinks else None
    return dict(sliding_window=window, softcap=cap, sinks=sinks)


def batch(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
          device: str = "cpu", seqs: list[tuple[int, int]] = SEQS) -> Batch:
    b = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device=device)
    # Scores of a few units, so that a softcap of 1.5-2 bends them and a window changes the answer.
    b.q.mul_(2.0)
    return b


def ref64(b: Batch, **extras) -> torch.Tensor:
    return paged_attention_ref(b.q.double(), b.k_cache.double(), b.v_cache.double(), *b.args()[3:], **extras)


def hide_behind_window(b: Batch, window: int) -> Batch:
    """A copy whose keys behind every query's window are unreadable: NaN slots,
    and whole blocks there swapped for the NaN block (``make_batch``'s last)."""
    k, v, tables = b.k_cache.clone(), b.v_cache.clone(), b.block_tables.clone()
    poison = k.shape[0] - 1
    block_size = k.shape[1]
    qsl = b.query_start_loc.tolist()
    for i, seq_len in enumerate(b.seq_lens.tolist()):
        first_query = seq_len - (qsl[i + 1] - qsl[i])
        hidden = max(0, first_query - window + 1)  # keys [0, hidden) are behind every window
        for pos in range(hidden):
            k[tables[i, pos // block_size], pos % block_size] = float("nan")
            v[tables[i, pos // block_size], pos % block_size] = float("nan")
        tables[i, :hidden // block_size] = poison
    return Batch(b.q, k, v, tables, b.seq_lens, b.query_start_loc, b.scale)


# ------------------------------------------------------------------ the reference itself


def dense_extras(b: Batch, window: int | None, softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """float64, one (sequence, query, head) at a time over a contiguous K/V
    gathered slot by slot: keys cut by slicing (not masking), the softmax
    written out with the sink as one more exponent in the denominator."""
    num_heads, head_dim = b.q.shape[1:]
    block_size, num_kv_heads = b.k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    k_flat = b.k_cache.double().reshape(-1, num_kv_heads, head_dim)
    v_flat = b.v_cache.double().reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros(b.q.shape, dtype=torch.float64)
    qsl, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        slots = torch.tensor([int(b.block_tables[i, p // block_size]) * block_size + p % block_size
                              for p in range(seq_len)], dtype=torch.long)
        k_seq, v_seq = k_flat[slots], v_flat[slots]  # [L, KV, D], contiguous in position
        q_len = qsl[i + 1] - qsl[i]
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            for h in range(num_heads):
                s = (k_seq[lo:pos + 1, h // group] @ b.q[qsl[i] + j, h].double()) * b.scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                m = s.max() if sinks is None else torch.maximum(s.max(), sinks[h].double())
                e = torch.exp(s - m)
                denom = e.sum() + (0.0 if sinks is None else torch.exp(sinks[h].double() - m))
                out[qsl[i] + j, h] = (e / denom) @ v_seq[lo:pos + 1, h // group]
    return out


@pytest.mark.parametrize("window,softcap,with_sinks", [
    (1, None, False), (5, None, False), (13, None, False), (1000, None, False),
    (None, 0.7, False), (None, None, True), (7, 2.0, True),
])
def test_reference_matches_dense_float64(window, softcap, with_sinks, seed: int) -> None:
    b = make_batch([(45, 1), (30, 30), (41, 9), (3, 1), (17, 0)], 6, 2, 16, 8, torch.float64)
    b.q.mul_(2.0)
    sinks = torch.randn(6, dtype=torch.float64) * 2 if with_sinks else None
    truth = dense_extras(b, window, softcap, sinks)
    out = run_poisoned(paged_attention_ref, b, sliding_window=window, softcap=softcap, sinks=sinks)
    assert rel_err(out, truth) < 1e-12, f"seed {seed}"
    # The case exercises its extras: plain attention differs (a window past every context aside).
    plain = dense_extras(b, None, None, None)
    assert rel_err(plain, truth) < 1e-12 if window == 1000 else rel_err(plain, truth) > 1e-3, f"seed {seed}"


# ------------------------------------------------------------------ the backends


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("fn", [paged_attention_sdpa, paged_attention_cpu], ids=["sdpa", "cpu"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", CONFIGS)
def test_torch_paths_match_float64(fn, extras: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
                                   seed: int) -> None:
    b = batch(heads, kv_heads, head_dim, block_size, torch.float32)
    kw = extras_for(extras, heads)
    err = rel_err(run_poisoned(fn, b, **kw), ref64(b, **kw))
    assert err < 1e-4, f"seed {seed}: relative error {err:.2e}"


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", CONFIGS)
def test_triton_matches_float64(extras: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
                                seed: int) -> None:
    b = batch(heads, kv_heads, head_dim, block_size, torch.float32)
    kw = extras_for(extras, heads)
    truth = ref64(b, **kw)
    if kw["sliding_window"] is not None:
        b = hide_behind_window(b, kw["sliding_window"])
    err = rel_err(run_poisoned(paged_attention, b, **kw), truth)
    assert err < 1e-4, f"seed {seed}: relative error {err:.2e}"


@pytest.mark.parametrize("extras", ["window13", "sinks", "all"])
def test_triton_split_kv_matches_float64(extras: str, seed: int) -> None:
    """Flash-decoding forced with small partitions: with a window they count
    from the tile's window start; sinks join once, in the reduction."""
    b = batch(6, 2, 32, 8, torch.float32, seqs=[(200, 1), (150, 40), (37, 1), (53, 13), (17, 0)])
    kw = extras_for(extras, 6)
    truth = ref64(b, **kw)
    if kw["sliding_window"] is not None:
        b = hide_behind_window(b, kw["sliding_window"])
    err = rel_err(run_poisoned(paged_attention, b, partition_size=32, **kw), truth)
    assert err < 1e-4, f"seed {seed}: relative error {err:.2e}"


def test_triton_fp16_all_extras(seed: int) -> None:
    b = batch(6, 2, 32, 8, torch.float16)
    kw = extras_for("all", 6)
    truth = ref64(b, **kw)
    err = rel_err(run_poisoned(paged_attention, hide_behind_window(b, 24), **kw), truth)
    assert err < 1e-2, f"seed {seed}: relative error {err:.2e}"


def test_triton_window_keeps_long_decodes_unsplit(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long decode splits its keys for flash-decoding; with a small window
    there are too few keys left to split, and the answer is still right."""
    from pagedserve.kernels import triton_attention as ta

    launches = []
    real = ta._reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(ta, "_reduce_kernel", Spy())
    b = batch(4, 2, 32, 16, torch.float32, seqs=[(700, 1)])
    run_poisoned(paged_attention, b)
    assert len(launches) == 1  # the plain decode splits
    kw = extras_for("all", 4)
    truth = ref64(b, **kw)
    err = rel_err(run_poisoned(paged_attention, hide_behind_window(b, 24), **kw), truth)
    assert err < 1e-4, f"seed {seed}: relative error {err:.2e}"
    assert len(launches) == 1  # the windowed one does not


def test_triton_rejects_bad_extras() -> None:
    b = batch(4, 2, 32, 16, torch.float32, seqs=[(5, 1)])
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(*b.args(), sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(*b.args(), softcap=0.0)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention(*b.args(), sinks=torch.zeros(3))


# ------------------------------------------------------------------ the compiled CPU kernel's own paths


@pytest.mark.parametrize("extras", ["window13", "softcap", "all"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", [
    pytest.param(9, 3, 64, 16, torch.float32, id="d64-bs16-vector"),  # 16-key vector scores and full-block dots
    pytest.param(9, 3, 64, 16, torch.bfloat16, id="d64-bs16-bf16"),  # the bf16 pair paths
    pytest.param(4, 1, 128, 16, torch.float32, id="mqa-d128"),
])
def test_compiled_kernel_paths_match_float64(extras: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
                                             dtype: torch.dtype, seed: int) -> None:
    b = batch(heads, kv_heads, head_dim, block_size, dtype)
    kw = extras_for(extras, heads)
    err = rel_err(run_poisoned(paged_attention_cpu, b, **kw), ref64(b, **kw))
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"seed {seed}: relative error {err:.2e}"


def test_compiled_kernel_serves_window_and_softcap(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows and softcaps stay on the compiled kernel (sinks alone fall back),
    with shared-prefix sequences too, whose shared blocks some windows leave."""
    from pagedserve.kernels import cpu_attention, cpu_build

    if cpu_build.load() is None:
        pytest.skip("no compiler here")
    seqs = [(120, 1), (100, 1), (90, 30), (64, 1)]
    b = batch(6, 2, 64, 16, torch.float32, seqs=seqs)
    for i in (1, 2, 3):  # the first 64 tokens' blocks shared: a cascade group
        b.block_tables[i, :4] = b.block_tables[0, :4]
    calls = []
    monkeypatch.setattr(cpu_attention, "paged_attention_sdpa",
                        lambda *a, **k: calls.append(k) or paged_attention_sdpa(*a, **k))
    kw = dict(sliding_window=40, softcap=2.0)
    err = rel_err(run_poisoned(paged_attention_cpu, b, **kw), ref64(b, **kw))
    assert err < 1e-4 and not calls, f"seed {seed}: relative error {err:.2e}, {len(calls)} fallbacks"
    sinks = torch.randn(6)
    err = rel_err(run_poisoned(paged_attention_cpu, b, sinks=sinks), ref64(b, sinks=sinks))
    assert err < 1e-4 and len(calls) == 1, f"seed {seed}: relative error {err:.2e}"
