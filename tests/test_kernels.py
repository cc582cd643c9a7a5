"""Triton kernels vs the torch reference vs a float64 naive attention.

Inputs are fresh random every run (the seed is in every failure message):
shuffled, non-contiguous physical blocks; block-table padding that points at a
NaN-filled block and NaN in the unused tail slots of the last block (so a read
outside a sequence shows up); outputs poisoned with NaN before each call.
On CPU the kernels run in the Triton interpreter (tests/conftest.py).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

from pagedserve.kernels import (
    copy_blocks,
    copy_blocks_ref,
    get_attention_backend,
    paged_attention,
    paged_attention_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    swap_blocks,
    swap_blocks_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.fixture
def seed() -> int:
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    random.seed(s)
    return s


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.query_start_loc, self.scale)


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, device: str = DEV, spare_blocks: int = 5) -> Batch:
    """``seqs`` is [(seq_len, q_len)]: q_len == 1 decode, == seq_len fresh
    prefill, in between a prefix-cache tail or a prefill chunk."""
    n_blocks = [-(-seq_len // block_size) for seq_len, _ in seqs]
    total = sum(n_blocks) + spare_blocks + 1
    perm = torch.randperm(total - 1).tolist()  # physical block total-1 is the NaN block
    poison = total - 1
    width = max(n_blocks) + 2
    tables = torch.full((len(seqs), width), poison, dtype=torch.int32)
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, dtype=torch.float32)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, dtype=torch.float32)
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    for i, ((seq_len, _), n) in enumerate(zip(seqs, n_blocks)):
        blocks = [perm.pop() for _ in range(n)]
        tables[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        tail = seq_len - (n - 1) * block_size
        k_cache[blocks[-1], tail:] = float("nan")
        v_cache[blocks[-1], tail:] = float("nan")
    q_lens = torch.tensor([q for _, q in seqs], dtype=torch.int32)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q_lens, 0)
    # q as a strided view, the way a fused QKV projection hands it over
    q = torch.randn(int(qsl[-1]), num_heads + 2, head_dim).to(device, dtype)[:, 1:num_heads + 1]
    return Batch(q, k_cache.to(device, dtype), v_cache.to(device, dtype), tables.to(device),
                 torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device), qsl.to(device),
                 head_dim ** -0.5)


def naive_attention(b: Batch) -> torch.Tensor:
    """float64, one (sequence, head) at a time, keys fetched slot by slot: a
    different code path from the reference."""
    num_heads, head_dim = b.q.shape[1:]
    block_size, num_kv_heads = b.k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    k_flat = b.k_cache.double().reshape(-1, num_kv_heads, head_dim)
    v_flat = b.v_cache.double().reshape(-1, num_kv_heads, head_dim)
    out = torch.zeros(b.q.shape, dtype=torch.float64, device=b.q.device)
    qsl, lens = b.query_start_loc.tolist(), b.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_len = qsl[i + 1] - qsl[i]
        slots = [int(b.block_tables[i, p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        slots_t = torch.tensor(slots, dtype=torch.long, device=b.q.device)
        for h in range(num_heads):
            k = k_flat[slots_t, h // group]  # [L, D]
            v = v_flat[slots_t, h // group]
            for j in range(q_len):
                pos = seq_len - q_len + j
                s = (k[: pos + 1] @ b.q[qsl[i] + j, h].double()) * b.scale
                out[qsl[i] + j, h] = torch.softmax(s, 0) @ v[: pos + 1]
    return out


def ref64(b: Batch) -> torch.Tensor:
    """The reference run in float64: the ground truth for the kernels."""
    return paged_attention_ref(b.q.double(), b.k_cache.double(), b.v_cache.double(), *b.args()[3:])


def rel_err(x: torch.Tensor, truth: torch.Tensor) -> float:
    return ((x.double() - truth).abs().max() / truth.abs().max()).item()


def run_poisoned(fn, b: Batch, **kw) -> torch.Tensor:
    out = torch.full_like(b.q, float("nan"))
    ret = fn(*b.args(), out=out, **kw)
    assert ret is out
    assert not out.isnan().any(), f"{out.isnan().sum().item()} output elements not written (or NaN read)"
    return out


# decode, fresh prefill, prefix-cache tail, prefill chunk, one-token prompt,
# lengths off the block grid; a sequence with no queries this step.
MIXED = [(37, 1), (40, 40), (53, 13), (1, 1), (29, 5), (17, 0), (16, 16), (70, 1)]

CASES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    pytest.param(4, 2, 64, 16, id="gqa2-d64-bs16"),
    pytest.param(6, 2, 80, 8, id="gqa3-d80-bs8"),
    pytest.param(2, 2, 96, 32, id="mha-d96-bs32"),
    pytest.param(8, 1, 64, 16, id="mqa8-d64-bs16"),
]


def test_reference_matches_naive_float64(seed: int) -> None:
    b = make_batch(MIXED, 6, 2, 80, 8, torch.float64)
    truth = naive_attention(b)
    out = run_poisoned(paged_attention_ref, b)
    assert rel_err(out, truth) < 1e-12, f"seed {seed}"
    b32 = Batch(b.q.float(), b.k_cache.float(), b.v_cache.float(), *b.args()[3:])
    assert rel_err(run_poisoned(paged_attention_ref, b32), truth) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", CASES)
def test_paged_attention_mixed_batch(seed: int, dtype, num_heads, num_kv_heads, head_dim, block_size) -> None:
    b = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    truth = ref64(b)
    ref = run_poisoned(paged_attention_ref, b)
    out = run_poisoned(paged_attention, b)
    assert rel_err(ref, truth) <= TOL[dtype], f"seed {seed}: reference"
    assert rel_err(out, truth) <= TOL[dtype], f"seed {seed}: triton {rel_err(out, truth):.2e}"


def test_paged_attention_bf16_in_interpreter(seed: int) -> None:
    """bf16 runs on CPU too (the kernel upcasts its dots in the interpreter)."""
    b = make_batch(MIXED[:5], 4, 2, 64, 16, torch.bfloat16)
    truth = ref64(b)
    assert rel_err(run_poisoned(paged_attention, b), truth) <= TOL[torch.bfloat16], f"seed {seed}"


@pytest.mark.parametrize("partition_size", [16, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_split_kv_decode(seed: int, dtype, partition_size: int) -> None:
    """Flash-decoding forced with tiny partitions: several per sequence, empty
    ones for the short sequences, and partitions ending mid-block."""
    b = make_batch([(150, 1), (9, 1), (97, 1)], 4, 2, 64, 8, dtype)
    truth = naive_attention(b)
    out = run_poisoned(paged_attention, b, partition_size=partition_size)
    assert rel_err(out, truth) <= TOL[dtype], f"seed {seed}"


def test_split_kv_mixed_batch(seed: int) -> None:
    """The split path is general: prefill tiles split across partitions too."""
    b = make_batch([(60, 1), (45, 45), (50, 20)], 6, 2, 80, 16, torch.float32)
    truth = ref64(b)
    assert rel_err(run_poisoned(paged_attention, b, partition_size=32), truth) <= 1e-4, f"seed {seed}"


def test_split_kv_chosen_for_long_decode(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One long decode: the heuristic alone picks flash-decoding (checked by
    counting launches of the reduction kernel), hints give the same answer."""
    from pagedserve.kernels import triton_attention as ta

    launches = []
    real = ta._reduce_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(ta, "_reduce_kernel", Spy())
    b = make_batch([(700, 1)], 4, 2, 64, 16, torch.float32)
    truth = ref64(b)
    assert rel_err(run_poisoned(paged_attention, b), truth) <= 1e-4, f"seed {seed}"
    assert len(launches) == 1
    hinted = run_poisoned(paged_attention, b, max_seq_len=700, max_query_len=1)
    assert rel_err(hinted, truth) <= 1e-4, f"seed {seed}"


def test_paged_attention_allocates_out_and_checks_shapes(seed: int) -> None:
    b = make_batch([(20, 3), (5, 1)], 4, 2, 64, 8, torch.float32)
    out = paged_attention(*b.args())
    assert out.shape == b.q.shape and out.dtype == b.q.dtype
    assert rel_err(out, naive_attention(b)) <= 1e-4, f"seed {seed}"
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(b.q[:, :3], *b.args()[1:])
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(b.q.half(), *b.args()[1:])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reshape_and_cache(seed: int, cache_dtype) -> None:
    num_blocks, block_size, kv, d = 9, 8, 2, 80
    qkv = torch.randn(11, (4 + 2 * kv) * d, device=DEV)  # key/value are strided views of a fused QKV
    key = qkv[:, 4 * d:(4 + kv) * d].view(11, kv, d)
    value = qkv[:, (4 + kv) * d:].view(11, kv, d)
    slots = torch.randperm(num_blocks * block_size)[:11]
    slots[torch.randperm(11)[:3]] = -1  # padding tokens
    slots = slots.to(DEV)
    k_cache = torch.full((num_blocks, block_size, kv, d), float("nan"), dtype=cache_dtype, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")
    written = (slots >= 0).sum().item()
    assert (~k_cache.isnan()).sum().item() == written * kv * d  # exactly the kept slots, nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_copy_blocks_all_layers(seed: int, dtype) -> None:
    layers = [(torch.randn(12, 16, 2, 64, device=DEV).to(dtype), torch.randn(12, 16, 2, 64, device=DEV).to(dtype))
              for _ in range(3)]
    ref = [(k.clone(), v.clone()) for k, v in layers]
    blocks = torch.randperm(12)
    pairs = torch.stack([blocks[:4], blocks[4:8]], 1)  # four CoW copies, dsts disjoint from srcs
    pairs[3, 0] = pairs[0, 0]  # one source forked twice
    copy_blocks(layers, pairs)
    copy_blocks_ref(ref, pairs)
    for (k, v), (kr, vr) in zip(layers, ref):
        assert torch.equal(k, kr) and torch.equal(v, vr), f"seed {seed}"
    copy_blocks(layers, torch.empty(0, 2, dtype=torch.int64))  # no-op


def test_copy_blocks_falls_back_for_odd_layouts(seed: int) -> None:
    base = torch.randn(2, 12, 8, 2, 64, device=DEV)
    layers = [(base[0], base[1][:, :, :, :32])]  # differently shaped caches
    ref = [(k.clone(), v.clone()) for k, v in layers]
    pairs = torch.tensor([[0, 5], [3, 7]])
    copy_blocks(layers, pairs)
    copy_blocks_ref(ref, pairs)
    assert all(torch.equal(a, b) for pair, rpair in zip(layers, ref) for a, b in zip(pair, rpair))


def test_swap_blocks_cpu(seed: int) -> None:
    srcs = [torch.randn(10, 8, 2, 16) for _ in range(4)]  # 2 layers x (K, V)
    dsts = [torch.full_like(s, float("nan")) for s in srcs]
    refs = [d.clone() for d in dsts]
    mapping = torch.tensor([[2, 0], [3, 1], [4, 2], [9, 7], [0, 5]])  # a run and singles
    assert swap_blocks(srcs, dsts, mapping) is None
    for s, r in zip(srcs, refs):
        swap_blocks_ref(s, r, mapping)
    for d, r in zip(dsts, refs):
        torch.testing.assert_close(d, r, rtol=0, atol=0, equal_nan=True, msg=f"seed {seed}")
    with pytest.raises(ValueError):
        swap_blocks(srcs, dsts[:1], mapping)


def test_backend_dispatch() -> None:
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_attention_backend("torch", "cpu").paged_attention is not paged_attention
    if torch.cuda.is_available():  # kernels were compiled for CUDA, not the interpreter
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            get_attention_backend("triton", "cpu")
    else:
        assert get_attention_backend("triton", "cpu").paged_attention is paged_attention
    assert get_attention_backend("auto", "cuda").name == "triton"
    with pytest.raises(ValueError):
        get_attention_backend("flash", "cpu")
    b = make_batch([(9, 2)], 2, 1, 64, 8, torch.float32)
    out = get_attention_backend("torch", "cpu").paged_attention(*b.args(), max_seq_len=9, max_query_len=2)
    assert rel_err(out, naive_attention(b)) < 1e-5


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_dim,block_size", [(64, 8), (80, 16), (96, 32), (128, 16), (128, 32), (256, 8)])
def test_gpu_paged_attention(seed: int, dtype, head_dim: int, block_size: int) -> None:
    seqs = [(random.randint(1, 900), 1) for _ in range(12)]
    seqs += [(n, n) for n in random.sample(range(1, 600), 4)]
    seqs += [(n, random.randint(1, n)) for n in random.sample(range(1, 1200), 4)]
    b = make_batch(seqs, 32, 8, head_dim, block_size, dtype)
    truth = ref64(b)
    assert rel_err(run_poisoned(paged_attention, b), truth) <= TOL[dtype], f"seed {seed}"
    assert rel_err(run_poisoned(paged_attention, b, partition_size=128), truth) <= TOL[dtype], f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 8192), (4, 3000), (16, 2048)])
def test_gpu_split_kv_auto(seed: int, batch: int, ctx: int) -> None:
    seqs = [(ctx - random.randint(0, 50), 1) for _ in range(batch)]
    b = make_batch(seqs, 32, 8, 128, 16, torch.bfloat16)
    truth = ref64(b)
    assert rel_err(run_poisoned(paged_attention, b), truth) <= TOL[torch.bfloat16], f"seed {seed}"


@pytest.mark.gpu
def test_gpu_cache_ops_bf16(seed: int) -> None:
    key, value = torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:300]
    slots[::7] = -1
    k_cache = torch.zeros(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    layers = [(torch.randn_like(k_cache), torch.randn_like(v_cache)) for _ in range(4)]
    ref = [(k.clone(), v.clone()) for k, v in layers]
    pairs = torch.tensor([[1, 40], [2, 41], [1, 42]])
    copy_blocks(layers, pairs)
    copy_blocks_ref(ref, pairs)
    assert all(torch.equal(a, b) for pair, rpair in zip(layers, ref) for a, b in zip(pair, rpair))


@pytest.mark.gpu
def test_gpu_swap_blocks_pinned_roundtrip(seed: int) -> None:
    """Swap out to pinned memory, then overwrite the GPU blocks on the current
    stream after waiting on the event: the CPU copy must hold the old data."""
    gpu = [torch.randn(32, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    cpu = [torch.zeros(32, 16, 8, 128, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
    before = [g.clone() for g in gpu]
    out_map = torch.tensor([[3, 0], [4, 1], [5, 2], [20, 9]])
    ev = swap_blocks(gpu, cpu, out_map)
    assert isinstance(ev, torch.cuda.Event)
    torch.cuda.current_stream().wait_event(ev)
    for g in gpu:
        g[3:6].zero_()
        g[20].zero_()
    ev.synchronize()
    for c, g0 in zip(cpu, before):
        assert torch.equal(c[0:3], g0[3:6].cpu()) and torch.equal(c[9], g0[20].cpu())
    in_map = torch.tensor([[0, 10], [1, 11], [2, 12], [9, 30]])
    ev = swap_blocks(cpu, gpu, in_map)
    torch.cuda.current_stream().wait_event(ev)
    for g, g0 in zip(gpu, before):
        assert torch.equal(g[10:13], g0[3:6]) and torch.equal(g[30], g0[20])
