"""The CPU serving path's batched attention (compiled kernel and vectorised
torch fallback) against the float64 reference: mixed prefill/decode batches,
shuffled blocks, NaN-poisoned padding and tails, GQA/MQA, and the Triton
kernel held to the same results."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_kernels import CASES, MIXED, Batch, make_batch, ref64, rel_err, run_poisoned, seed  # noqa: F401 - fixture

from pagedserve.kernels import cpu_build, get_attention_backend, paged_attention
from pagedserve.kernels.cpu_attention import _groups, cascade_groups, paged_attention_cpu, paged_attention_sdpa

LONG_MIXED = MIXED + [(300, 1), (257, 1), (180, 60), (90, 90)]


def test_the_compiled_kernel_builds_here() -> None:
    # CI has g++; a silent fallback would hide a broken kernel behind the torch path.
    assert cpu_build.load() is not None


@pytest.mark.parametrize("fn", [paged_attention_cpu, paged_attention_sdpa], ids=["compiled", "sdpa"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", CASES)
def test_batched_cpu_attention_matches_float64(fn, heads: int, kv_heads: int, head_dim: int, block_size: int,
                                               seed: int) -> None:
    b = make_batch(LONG_MIXED, heads, kv_heads, head_dim, block_size, torch.float32, device="cpu")
    out = run_poisoned(fn, b)
    err = rel_err(out, ref64(b))
    assert err < 1e-4, f"seed {seed}: relative error {err:.2e}"


@pytest.mark.parametrize("fn", [paged_attention_cpu, paged_attention_sdpa], ids=["compiled", "sdpa"])
def test_batched_cpu_attention_bfloat16_within_bf16_bounds(fn, seed: int) -> None:
    b = make_batch(LONG_MIXED, 6, 2, 64, 16, torch.bfloat16, device="cpu")
    err = rel_err(run_poisoned(fn, b), ref64(b))
    assert err < 2e-2, f"seed {seed}: relative error {err:.2e}"


def test_decode_only_batch_of_many_sequences(seed: int) -> None:
    seqs = [(int(n), 1) for n in torch.randint(1, 200, (48,))]
    b = make_batch(seqs, 9, 3, 64, 16, torch.float32, device="cpu")
    truth = ref64(b)
    for fn in (paged_attention_cpu, paged_attention_sdpa):
        assert rel_err(run_poisoned(fn, b), truth) < 1e-4, f"seed {seed}: {fn.__name__}"


def test_torch_backend_on_cpu_is_the_batched_path() -> None:
    b = make_batch(MIXED, 4, 2, 64, 16, torch.float32, device="cpu")
    backend = get_attention_backend("torch", "cpu")
    out = run_poisoned(backend.paged_attention, b)
    assert torch.equal(out, paged_attention_cpu(*b.args()))


def test_triton_kernel_matches_the_cpu_path(seed: int) -> None:
    # Small: the interpreter runs this on CPU.
    b = make_batch([(37, 1), (20, 20), (45, 9), (3, 1)], 4, 2, 32, 16, torch.float32, device="cpu")
    ours = run_poisoned(paged_attention_cpu, b)
    triton_out = run_poisoned(paged_attention, b)
    assert rel_err(triton_out, ours.double()) < 1e-4, f"seed {seed}"


def test_sdpa_groups_bound_padding() -> None:
    q_lens = [1, 1, 500, 20, 1, 480, 30, 0]
    lens = [40, 90, 500, 20, 300, 600, 60, 10]
    groups = _groups(q_lens, lens)
    assert groups[0] == [0, 1, 4]  # all decodes in one call
    prefill = [i for g in groups[1:] for i in g]
    assert sorted(prefill) == [2, 3, 5, 6]  # every prefill once, the empty sequence nowhere
    for g in groups[1:]:
        real = sum(q_lens[i] * lens[i] for i in g)
        padded = len(g) * max(q_lens[i] for i in g) * max(lens[i] for i in g)
        assert padded <= 2 * real or len(g) == 1


def test_disabled_kernel_falls_back_to_torch() -> None:
    saved = cpu_build.settings()
    cpu_build.configure(enabled=False)  # what a worker passes for PAGEDSERVE_CPU_KERNEL=0
    try:
        assert cpu_build.load() is None
        b = make_batch(MIXED, 4, 2, 64, 16, torch.float32, device="cpu")
        assert rel_err(run_poisoned(paged_attention_cpu, b), ref64(b)) < 1e-4
    finally:
        cpu_build.configure(*saved)


def test_the_worker_passes_the_switch_and_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pagedserve.gpuworker.model_runner import configure_kernels

    saved = cpu_build.settings()
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv(cpu_build.DISABLE_ENV, "0")
    try:
        configure_kernels()
        assert cpu_build.settings() == (tmp_path / "kernels", False) and cpu_build.load() is None
    finally:
        cpu_build.configure(*saved)


def test_loading_the_kernel_keeps_subnormals() -> None:
    # A -ffast-math link would set flush-to-zero for the whole process (and break hypothesis).
    assert cpu_build.load() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert tiny.item() != 0.0 and (tiny * 0.5).item() != 0.0


# ---------------------------------------------------------------- shared prefixes (cascade)

# (seq_len, q_len), then who shares whose leading tokens, as (sequence, source, tokens):
# A: 0-4 share 192 tokens, decodes (5 members: 15 query rows per KV head, the per-key dot path);
# 5: alone. B: 6-9 share 128, with 3- and 2-token queries and 9 wholly inside the prefix
# (21 rows, the transposed path). 10 shares only 80 with 6, too little for B; C: 10-11 share 96.
# 12: a 40-token prefill chunk on a shared prefix (more than one tile: no member).
# D, E: 70 decodes sharing 80 tokens, split at 64 query tokens per group.
CASCADE = [(300, 1), (257, 1), (290, 1), (401, 1), (333, 1), (200, 1), (200, 1), (180, 3), (150, 2), (128, 1),
           (200, 1), (220, 1), (90, 40)] + [(100, 1)] * 70
CASCADE_SHARES = ([(i, 0, 192) for i in range(1, 5)] + [(i, 6, 128) for i in (7, 8, 9)] + [(10, 6, 80), (11, 10, 96),
                  (12, 10, 80)] + [(i, 13, 80) for i in range(14, 83)])


def share_prefixes(b: Batch, shares: list[tuple[int, int, int]]) -> Batch:
    """Point each sequence's leading blocks at its source's (its source's own
    blocks first, so chains share too)."""
    bs = b.k_cache.shape[1]
    for seq, src, tokens in shares:
        b.block_tables[seq, :tokens // bs] = b.block_tables[src, :tokens // bs]
    return b


def test_cascade_groups_are_the_runs_of_shared_leading_blocks() -> None:
    b = share_prefixes(make_batch(CASCADE, 9, 3, 64, 16, torch.float32, device="cpu"), CASCADE_SHARES)
    assert cascade_groups(b.block_tables, b.seq_lens, b.query_start_loc, 16) == [
        (0, 5, 12), (6, 10, 8), (10, 12, 6), (13, 77, 5), (77, 83, 5)]
    # No sharing, no groups: every sequence reads its own blocks.
    plain = make_batch(CASCADE, 9, 3, 64, 16, torch.float32, device="cpu")
    assert cascade_groups(plain.block_tables, plain.seq_lens, plain.query_start_loc, 16) == []


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,dtype", [
    pytest.param(9, 3, 64, 16, torch.float32, id="smollm2-fp32"),
    pytest.param(9, 3, 64, 16, torch.bfloat16, id="smollm2-bf16"),
    pytest.param(4, 1, 128, 16, torch.float32, id="mqa-d128"),
    pytest.param(6, 2, 80, 8, torch.float32, id="d80-bs8-scalar"),
    pytest.param(2, 2, 64, 32, torch.float32, id="mha-bs32"),
])
def test_shared_prefix_batch_matches_float64(heads: int, kv_heads: int, head_dim: int, block_size: int,
                                             dtype: torch.dtype, seed: int) -> None:
    b = share_prefixes(make_batch(CASCADE, heads, kv_heads, head_dim, block_size, dtype, device="cpu"),
                       CASCADE_SHARES)
    assert len(cascade_groups(b.block_tables, b.seq_lens, b.query_start_loc, block_size)) >= 2
    err = rel_err(run_poisoned(paged_attention_cpu, b), ref64(b))
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), f"seed {seed}: relative error {err:.2e}"


def test_full_block_decode_dots_match_float64(seed: int) -> None:
    # Decode over full 16-key blocks (the one-vector-per-key dot path) and partial last blocks.
    seqs = [(16 * int(n), 1) for n in torch.randint(1, 12, (20,))] + [(int(n), 1) for n in torch.randint(1, 200, (20,))]
    for kv_heads, dtype, tol in [(3, torch.float32, 1e-4), (1, torch.float32, 1e-4), (3, torch.bfloat16, 2e-2)]:
        b = make_batch(seqs, 9 if kv_heads == 3 else 8, kv_heads, 64, 16, dtype, device="cpu")
        assert rel_err(run_poisoned(paged_attention_cpu, b), ref64(b)) < tol, f"seed {seed}: {kv_heads} {dtype}"
