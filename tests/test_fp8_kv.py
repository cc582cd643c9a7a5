"""The fp8 KV cache (``--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2``, kernels/fp8.py):
every writer stores the same bits (round to nearest even, saturating), the
CPU kernel, its SDPA fallback and the Triton kernel (interpreter) dequantize
with per-layer scales != 1 and agree with the float64 reference on the
dequantized values (tight) and on the unquantized ones (fp8 bounds), copies
and swaps move bytes, the pool has twice the blocks of a 16-bit one in the
same memory, and greedy decoding on the embedded SmolLM2 (issue 23,
acceptance 4). The KV-limited throughput run is opt-in (PAGEDSERVE_BENCH_FP8=1)."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from models import make_tiny_model
from test_kernels import MIXED, Batch, make_batch, rel_err, run_poisoned, seed  # noqa: F401 - fixture

from pagedserve.common.config import EngineConfig
from pagedserve.kernels import copy_blocks, copy_blocks_ref, cpu_build, cpu_ops, paged_attention, reshape_and_cache
from pagedserve.kernels import reshape_and_cache_ref, swap_blocks
from pagedserve.kernels.cpu_attention import paged_attention_cpu, paged_attention_sdpa
from pagedserve.kernels.fp8 import dequantize, kv_cache_dtype, quantize
from pagedserve.kernels.reference import paged_attention_ref

FORMATS = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]
K_SCALE, V_SCALE = torch.tensor(0.37), torch.tensor(2.5)
# Against the unquantized values: e4m3 keeps 3 mantissa bits, e5m2 2 (relative
# steps of 1/8 and 1/4), so outputs move by a few percent of their largest value
# (measured over 30 seeds, largest error / largest output: e4m3 0.042 mean, 0.058
# worst; e5m2 0.086, 0.110).
FP8_BOUND = {torch.float8_e4m3fn: 0.08, torch.float8_e5m2: 0.16}


def quantized(b: Batch, fmt: torch.dtype) -> tuple[Batch, Batch]:
    """(the batch with its pool stored as ``fmt`` with the test's scales, the
    float64 batch of the values that pool stands for)."""
    k8, v8 = quantize(b.k_cache, K_SCALE, fmt), quantize(b.v_cache, V_SCALE, fmt)
    deq = dataclasses.replace(b, q=b.q.double(), k_cache=dequantize(k8, K_SCALE, torch.float64),
                              v_cache=dequantize(v8, V_SCALE, torch.float64))
    return dataclasses.replace(b, k_cache=k8, v_cache=v8), deq


def ref(b: Batch) -> torch.Tensor:
    return paged_attention_ref(b.q.double(), b.k_cache.double(), b.v_cache.double(), *b.args()[3:])


# ---------------------------------------------------------------- writes

@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_rounds_as_torch_and_saturates(fmt: torch.dtype) -> None:
    limit = torch.finfo(fmt).max
    x = torch.cat([torch.randn(4000) * 4, torch.randn(1000) * 1e-3, torch.tensor([0.0, -0.0, limit, -limit])])
    assert torch.equal(quantize(x, None, fmt).view(torch.uint8), x.to(fmt).view(torch.uint8))
    big = quantize(torch.tensor([1e9, -1e9, limit * 1.2]), None, fmt).float()
    assert big.tolist() == [limit, -limit, limit]  # saturated, never inf or NaN
    s = torch.tensor(0.5)  # a power of two: x / s is exact, so ties stay ties
    assert torch.equal(quantize(x, s, fmt).view(torch.uint8), (x * 2).clamp(-limit, limit).to(fmt).view(torch.uint8))


def _tricky_rows(tokens: int, width: int, fmt: torch.dtype) -> torch.Tensor:
    """Random rows with ties, subnormals, signed zeros and out-of-range values at the front."""
    x = torch.randn(tokens, width) * 3
    step = 2.0 ** -9 if fmt == torch.float8_e4m3fn else 2.0 ** -16  # the least subnormal
    mant = 1 / 16 if fmt == torch.float8_e4m3fn else 1 / 8  # half a mantissa step at 1.0
    special = torch.tensor([1 + mant, 1 + 3 * mant, -(1 + mant), step / 2, 3 * step / 2, -step / 2, 0.0, -0.0,
                            1e6, -1e6, torch.finfo(fmt).max])
    x[:, :special.numel()] = special * K_SCALE  # the writers divide by the scale again
    return x


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_writer_stores_the_same_bits(fmt: torch.dtype, dtype: torch.dtype) -> None:
    heads, kv_heads, d, blocks, bs, tokens = 4, 2, 64, 6, 16, 40
    qkv = _tricky_rows(tokens, (heads + 2 * kv_heads) * d, fmt).to(dtype)
    key = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    value = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    slots = torch.randperm(blocks * bs)[:tokens]
    slots[5] = -1  # padding
    pools = {}
    for name in ("ref", "cpu", "triton"):
        pools[name] = (torch.zeros(blocks, bs, kv_heads, d, dtype=fmt), torch.zeros(blocks, bs, kv_heads, d, dtype=fmt))
    reshape_and_cache_ref(key, value, *pools["ref"], slots, K_SCALE, V_SCALE)
    # position 0: the rotary embedding is the identity, so q and k are left as they are
    zeros, cos, sin = torch.zeros(tokens, dtype=torch.long), torch.ones(8, d // 2), torch.zeros(8, d // 2)
    assert cpu_ops.rope_and_cache(qkv.clone(), heads, kv_heads, d, zeros, cos, sin, *pools["cpu"], slots, K_SCALE, V_SCALE)
    reshape_and_cache(key.float() if dtype == torch.bfloat16 else key, value.float() if dtype == torch.bfloat16 else value,
                      *pools["triton"], slots, K_SCALE, V_SCALE)
    want = quantize(key.float(), K_SCALE, fmt)
    assert torch.equal(pools["ref"][0].view(-1, kv_heads, d)[slots[slots >= 0]].view(torch.uint8),
                       want[slots >= 0].view(torch.uint8))
    for name in ("cpu", "triton"):
        for got, exp in zip(pools[name], pools["ref"]):
            assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8)), name
    assert (pools["ref"][0].view(-1, kv_heads, d)[slots[5]].float() == 0).all() or slots[5] < 0


# ---------------------------------------------------------------- attention

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fn", [paged_attention_cpu, paged_attention_sdpa], ids=["compiled", "sdpa"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 64, 16), (6, 2, 80, 8), (2, 2, 128, 32)])
def test_cpu_attention_fp8(fn, fmt: torch.dtype, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                           block_size: int, seed: int) -> None:
    b = make_batch(MIXED + [(180, 1), (90, 30)], heads, kv_heads, head_dim, block_size, dtype, device="cpu")
    b = dataclasses.replace(b, k_cache=b.k_cache.float(), v_cache=b.v_cache.float())
    b8, deq = quantized(b, fmt)
    out = run_poisoned(fn, b8, k_scale=K_SCALE, v_scale=V_SCALE)
    tight = 1e-4 if dtype == torch.float32 else 2e-2
    assert rel_err(out, ref(deq)) < tight, f"seed {seed}"
    assert rel_err(out, ref(b)) < FP8_BOUND[fmt] + tight, f"seed {seed}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("partition_size", [None, 32], ids=["one-pass", "split-kv"])
def test_triton_attention_fp8(fmt: torch.dtype, dtype: torch.dtype, partition_size: int | None, seed: int) -> None:
    # Small: the interpreter runs this on CPU (bf16 dots are wrong there; fp16 and fp32 are not).
    b = make_batch([(37, 1), (20, 20), (45, 9), (70, 1)], 4, 2, 32, 16, dtype, device="cpu")
    b = dataclasses.replace(b, k_cache=b.k_cache.float(), v_cache=b.v_cache.float())
    b8, deq = quantized(b, fmt)
    out = run_poisoned(paged_attention, b8, k_scale=K_SCALE, v_scale=V_SCALE, partition_size=partition_size)
    tight = 1e-4 if dtype == torch.float32 else 1e-2
    assert rel_err(out, ref(deq)) < tight, f"seed {seed}"
    assert rel_err(out, ref(b)) < FP8_BOUND[fmt] + tight, f"seed {seed}"


def test_fp8_kernels_use_the_scales() -> None:
    b = make_batch([(40, 1), (30, 30)], 4, 2, 64, 16, torch.float32, device="cpu")
    b8, deq = quantized(b, torch.float8_e4m3fn)
    truth = ref(deq)
    for fn in (paged_attention_cpu, paged_attention_sdpa, paged_attention):
        assert rel_err(run_poisoned(fn, b8), truth) > 0.3, fn.__name__  # scales left out: far off
        assert rel_err(run_poisoned(fn, b8, k_scale=K_SCALE, v_scale=V_SCALE), truth) < 1e-4, fn.__name__


# ---------------------------------------------------------------- copies, swaps, pool size

@pytest.mark.parametrize("fmt", FORMATS)
def test_copies_and_swaps_move_bytes(fmt: torch.dtype) -> None:
    layers = [(quantize(torch.randn(12, 8, 2, 64), None, fmt), quantize(torch.randn(12, 8, 2, 64), None, fmt))
              for _ in range(3)]
    expect = [(k.clone(), v.clone()) for k, v in layers]
    pairs = torch.tensor([[0, 5], [3, 7], [11, 1]])
    copy_blocks(layers, pairs)
    copy_blocks_ref(expect, pairs)
    for got, exp in zip(layers, expect):
        for g, e in zip(got, exp):
            assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
            assert torch.equal(g[5].view(torch.uint8), g[0].view(torch.uint8))
    srcs = [t for kv in layers for t in kv]
    dsts = [torch.zeros(4, 8, 2, 64, dtype=fmt) for _ in srcs]
    assert swap_blocks(srcs, dsts, torch.tensor([[2, 0], [3, 1], [9, 3]])) is None
    for s, d in zip(srcs, dsts):
        assert torch.equal(d[[0, 1, 3]].view(torch.uint8), s[[2, 3, 9]].view(torch.uint8))


def _runner(folder: str, dtype: str, kv: str, memory: int):
    from pagedserve.gpuworker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=folder, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory))
    runner.init()
    assert runner.cache.gpu[0][0].dtype == kv_cache_dtype(kv, getattr(torch, dtype))
    return runner


def test_fp8_pool_has_twice_the_blocks_of_a_16_bit_one(tmp_path) -> None:
    folder = make_tiny_model(tmp_path / "m")
    probe = _runner(folder, "float32", "fp8", 1 << 20)
    # bytes of one fp8 block: K and V, every layer, block_size 16, one byte an element
    per_block_fp8 = 2 * probe.num_layers * 16 * probe.num_kv_heads * probe.head_dim
    memory = 1000 * per_block_fp8 + 123
    counts = {(dtype, kv): _runner(folder, dtype, kv, memory).ready.num_gpu_blocks
              for dtype, kv in [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"),
                                ("bfloat16", "fp8_e4m3"), ("float32", "fp8_e5m2")]}
    assert counts[("float32", "fp8")] == counts[("bfloat16", "fp8_e4m3")] == counts[("float32", "fp8_e5m2")] == 1000
    assert counts[("bfloat16", "auto")] == 500 and counts[("float32", "auto")] == 250


def test_config_accepts_the_fp8_kinds() -> None:
    for kind in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert EngineConfig(kv_cache_dtype=kind).kv_cache_dtype == kind
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        EngineConfig(kv_cache_dtype="fp4")


# ---------------------------------------------------------------- the worker end to end

@pytest.mark.parametrize("kind", ["fp8", "fp8_e5m2"])
def test_worker_with_fp8_pool_same_on_both_backends(tmp_path, kind: str) -> None:
    """A tiny model through the real worker, every path that writes or reads the
    pool (prefill, decodes; the compiled CPU ops and the Triton kernels in the
    interpreter) with an fp8 pool: both backends store the same bits and
    dequantize alike, so they pick the same tokens with the same logprobs; and
    the fp8 pool stays near an fp32 pool."""
    from benchmarks.kv_fp8 import compare, greedy

    folder = make_tiny_model(tmp_path / "m")
    batch = [[5 + i, 9, 17 + 2 * i, 4, 30 + i] * (i + 1) for i in range(4)]
    cpu = greedy(kind, batch, 6, model=folder, backend="torch")
    tri = greedy(kind, batch, 6, model=folder, backend="triton")
    assert [t for t, _ in cpu] == [t for t, _ in tri]
    assert max(abs(a - b) for (_, x), (_, y) in zip(cpu, tri) for a, b in zip(x, y)) < 1e-3
    r = compare(greedy("auto", batch, 6, model=folder, backend="torch"), cpu)
    assert r["mean_abs_dlogprob"] < 0.2, r


def test_smollm2_greedy_with_fp8_kv() -> None:
    """Issue 23 acceptance 4: 64 requests x 16 greedy tokens on the embedded
    SmolLM2, fp8 (e4m3) KV against fp32 KV. Measured (docs/benchmarks.md): 31
    of 64 identical, mean |delta logprob| 0.049. The error is the format's: a
    torch emulation (K/V rounded to e4m3 in an fp32 pool) gives 16 of 32, and
    even bf16 KV only 30 of 32; so the bounds below guard the implementation,
    and the acceptance's 90 % is reported as not met (xfail)."""
    from benchmarks.kv_fp8 import accuracy

    r = accuracy(64, 16, ["fp8"])["fp8"]
    print(r)
    assert r["identical"] >= 0.35 and r["mean_abs_dlogprob"] < 0.07 and r["max_abs_dlogprob"] < 1.0, r
    # vLLM's own bar for its fp8 KV (check_logprobs_close, 8 logprobs): measured 64 / 64.
    assert r["close_count"] >= 62, r
    if r["identical"] < 0.9:
        pytest.xfail(f"acceptance 4 wants >= 90 % identical; fp8 e4m3 gives {r['identical']:.0%} on SmolLM2-135M")


@pytest.mark.skipif(not os.environ.get("PAGEDSERVE_BENCH_FP8"),
                    reason="opt-in: PAGEDSERVE_BENCH_FP8=1 (two fresh servers per round, a few minutes on two cores)")
def test_kv_limited_workload_is_faster_with_fp8() -> None:
    from benchmarks.kv_fp8 import throughput

    r = throughput("16MiB", 32, 64, rounds=1)
    print(r)
    assert r["ratio"] >= 1.5, r


def test_bench_kv_fp8_accuracy_in_the_models_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    """``--dtype bfloat16``: the model and the baseline pool in bf16 (the
    acceptance's 16-bit KV), not the fp32 run under another label; and
    ``--close-top`` reaches the close count."""
    from benchmarks.kv_fp8 import accuracy, main

    assert main(["--dtype", "bfloat16", "--skip-throughput", "--requests", "4", "--accuracy-tokens", "3",
                 "--kinds", "fp8", "--close-top", "2"]) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])
    assert "SmolLM2 bfloat16, vs a bfloat16 KV pool" in out and res["accuracy_dtype"] == "bfloat16"
    bf16 = res["accuracy"]["fp8"]
    assert bf16["requests"] == 4 and bf16 == accuracy(4, 3, ["fp8"], "bfloat16", top=2)["fp8"]
    assert bf16["identical_count"] <= bf16["close_count"] <= 4 and bf16["close_top"] == 2
    assert bf16["mean_abs_dlogprob"] != accuracy(4, 3, ["fp8"], "float32")["fp8"]["mean_abs_dlogprob"]


def test_logprobs_close_is_vllms_check() -> None:
    """Identical runs pass; a run that differs passes only when, at its first
    difference, each token is in the other's top logprobs; later positions are
    not compared (the contexts differ there)."""
    from benchmarks.kv_fp8 import Run, logprobs_close

    def run(tokens: list[int], tops: list[list[int]]) -> Run:
        return Run(tokens, [0.0] * len(tokens), [{t: -1.0 for t in top} for top in tops])

    base = run([1, 2, 3], [[1, 9], [2, 5], [3]])
    cases = {
        "identical": (run([1, 2, 3], [[1], [2], [3]]), 1),
        "each in the other's top": (run([1, 5, 7], [[1], [5, 2], [7]]), 1),
        "only one way": (run([1, 5, 7], [[1], [5], [7]]), 0),
        "not in the base's top": (run([1, 6, 3], [[1], [6, 2], [3]]), 0),
        "first difference decides": (run([9, 8, 8], [[9, 1], [8], [8]]), 1),
    }
    for name, (other, want) in cases.items():
        assert logprobs_close([base], [other]) == want, name
    assert logprobs_close([base] * 5, [o for o, _ in cases.values()]) == 3
