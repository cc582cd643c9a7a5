"""GGUF quantized weights (kernels/quant.py, quant_cpu.cpp): ``dequantize``
against gguf-py's reference dequantizers, and the int8 VNNI product against
float64 of the dequantized weight times the activations, over odd shapes.

The product quantizes the activations per 32 to int8 (fp32 ones in two terms,
q1 d1 + q2 d2, the second over what the first rounded off), so it is held
tightly to float64 of (dequantized W) @ (x as the kernel quantized it), and
loosely to the unquantized x, within the bound that rounding implies: |x - q d|
<= d / 2 per element (d2 / 2 for fp32), so |error| <= sum_k |W[n, k]| d(m, k) / 2.
bf16 activations of a prompt (from ``quant_cpu.dequant_rows()`` rows) meet the
weight decoded to bf16 instead: held to float64 of x @ bf16(W).
"""
from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch

from pagedserve.kernels import cpu_build, quant_cpu
from pagedserve.kernels.quant import (
    GGML_QUANT_TYPES,
    QuantWeight,
    UnsupportedQuantType,
    dequantize,
    from_int8_per_channel,
    prepare,
    quant_linear,
    quant_type,
)

TYPES = list(GGML_QUANT_TYPES)
PY_QUANTIZERS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # gguf-py quantizes these; the K types get random valid blocks


def make_weight(qtype: str, n: int, k: int, seed: int) -> QuantWeight:
    rng = np.random.default_rng(seed)
    qt = GGML_QUANT_TYPES[qtype]
    if qtype in PY_QUANTIZERS:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[qtype])
    else:  # any bytes are valid blocks once the fp16 scales are finite; signs of both kinds
        raw = rng.integers(0, 256, (n, k // qt.block_size, qt.type_size), dtype=np.uint8)
        for off in {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype]:
            scales = (rng.uniform(-1e-2, 1e-2, raw.shape[:2])).astype(np.float16)
            raw[..., off:off + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
        raw = raw.reshape(n, -1)
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (n, k))


def test_types_are_ggmls() -> None:
    for name, qt in GGML_QUANT_TYPES.items():
        t = gguf.GGMLQuantizationType[name]
        assert (t.value, (qt.block_size, qt.type_size)) == (qt.code, gguf.GGML_QUANT_SIZES[t])
    # Q4_K_M files mix Q4_K and Q6_K with Q5_0 and Q8_0 (Gemma 3 270M's: 81 of its 127 matrices are Q5_0)
    assert {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"} <= set(GGML_QUANT_TYPES)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_equals_gguf_py(qtype: str) -> None:
    w = make_weight(qtype, 13, 2 * GGML_QUANT_TYPES[qtype].block_size * 3, seed=1)
    ref = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(dequantize(w).numpy(), ref)


@pytest.mark.parametrize("name", ["Q5_K", "IQ2_XXS", "F16"])
def test_an_unsupported_type_is_refused_by_name(name: str) -> None:
    with pytest.raises(UnsupportedQuantType, match=name):
        quant_type(name)
    with pytest.raises(UnsupportedQuantType, match=name):
        QuantWeight(torch.zeros((2, 18), dtype=torch.uint8), name, (2, 32))


def test_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="uint8"):
        QuantWeight(torch.zeros((2, 35), dtype=torch.uint8), "Q8_0", (2, 32))
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantWeight(torch.zeros((2, 144), dtype=torch.uint8), "Q4_K", (2, 128))


def test_the_kernels_build_here() -> None:
    # a silent fallback to the dequantizing path would hide a broken kernel
    assert cpu_build.load() is not None and quant_cpu._vnni(), "this CPU has AVX512-VNNI: the kernel must run"


def _references(w: QuantWeight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 (W @ x as the kernel uses them, W @ x, the bound on that rounding) for x [M, K]."""
    wd = dequantize(w).double()
    if x.dtype == torch.bfloat16 and x.shape[0] >= (quant_cpu.dequant_rows() or quant_cpu.NEVER):
        # a prompt's rows: x as it is against the weight decoded to bf16 (quant_bf16.cpp)
        wb = wd.to(torch.bfloat16).double()
        return x.double() @ wb.T, x.double() @ wd.T, x.double().abs() @ (wd - wb).abs().T
    xq, half_step = quant_cpu.activations_as_used(x)
    # within half a step, plus the float32 rounding of the fp32 residual x - q1 d1 (a few ulp of x)
    slack = 4 * torch.finfo(torch.float32).eps * x.double().abs() if x.dtype == torch.float32 else 1e-5 * half_step
    assert ((xq - x.double()).abs() <= half_step + slack).all(), "activations off their nearest step"
    return xq @ wd.T, x.double() @ wd.T, half_step @ wd.abs().T


@pytest.fixture
def prompt_rows() -> Iterator[int]:
    """The rows from which bf16 activations take the bf16 panels, at the library's default, 128
    (between the 64 and 130 rows of the tests; a worker in this process moves it per step), restored after."""
    with quant_cpu.dequant_rows_at(128):
        yield 128


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m", [1, 3, 17, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_product_equals_float64_of_the_dequantized_weight(qtype: str, m: int, dtype: torch.dtype,
                                                          prompt_rows: int) -> None:
    block = GGML_QUANT_TYPES[qtype].block_size
    n, k = 45, block * (3 if block == 256 else 13)  # 45 outputs: two groups of 16 and a cut one
    w = prepare(make_weight(qtype, n, k, seed=m))
    assert w.packed is not None
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4).to(dtype)  # uneven channels
    bias = torch.randn(n, generator=g).to(dtype)
    ref_q, ref, bound = _references(w, x)
    y = quant_linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    scale = (x.double().abs() @ dequantize(w).double().abs().T)  # sum |x||W|: what float error scales with
    out_tol = 1e-5 if dtype == torch.float32 else 2 ** -8  # bf16 output: one rounding of the result
    got = y.double() - bias.double()
    assert ((got - ref_q).abs() <= 1e-5 * scale + out_tol * y.double().abs() + 1e-6).all()
    assert ((got - ref).abs() <= bound * 1.001 + 1e-5 * scale + out_tol * y.double().abs() + 1e-6).all()


@pytest.mark.parametrize("qtype", TYPES)
def test_a_prompt_meets_the_weight_in_bf16_and_a_decode_batch_in_int8(qtype: str, prompt_rows: int) -> None:
    """bf16 activations at one shape, both paths: from ``dequant_rows`` rows up (a prompt step, which
    the worker marks so) x as it is against the weight rounded to bf16, equal to float64 of that
    product to fp32 accumulation; below it, x rounded to one int8 term, off that product."""
    k = GGML_QUANT_TYPES[qtype].block_size * (2 if GGML_QUANT_TYPES[qtype].block_size == 256 else 9)
    w = prepare(make_weight(qtype, 149, k, seed=7))  # 149 rows: three runs of 48 and a cut group
    x = (torch.randn(9, k, generator=torch.Generator().manual_seed(7)) * 3).to(torch.bfloat16)
    wd = dequantize(w).double()
    ref = x.double() @ wd.to(torch.bfloat16).double().T
    scale = x.double().abs() @ wd.abs().T
    with quant_cpu.dequant_rows_at(9):
        prompt = quant_linear(x, w).double()
    with quant_cpu.dequant_rows_at(10):
        decode = quant_linear(x, w).double()
    def within(y: torch.Tensor) -> torch.Tensor:  # fp32 sums, one bf16 rounding of the result
        return (y - ref).abs() <= 1e-5 * scale + 2 ** -8 * y.abs() + 1e-6

    assert within(prompt).all()
    assert within(decode).float().mean() < 0.9  # the int8 activations' rounding shows


@pytest.mark.parametrize("qtype", TYPES)
def test_unprepared_weight_dequantizes_per_call(qtype: str) -> None:
    k = GGML_QUANT_TYPES[qtype].block_size * 2
    w = make_weight(qtype, 21, k, seed=3)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    y = quant_linear(x, w)
    wd = dequantize(w).double()
    # fp32 of the dequantized product: error relative to sum |x||W|, not to a result that may cancel
    assert ((y.double() - x.double() @ wd.T).abs() <= 1e-5 * (x.double().abs() @ wd.abs().T) + 1e-6).all()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_split_rows_shards_the_output_features(qtype: str) -> None:
    k = GGML_QUANT_TYPES[qtype].block_size * 2
    w = prepare(make_weight(qtype, 50, k, seed=4))
    x = torch.randn(4, k)
    full = quant_linear(x, w)
    parts = [prepare(w.split_rows(a, b)) for a, b in ((0, 16), (16, 37), (37, 50))]
    assert [p.shape for p in parts] == [(16, k), (21, k), (13, k)]
    assert sum(p.data.numel() for p in parts) == w.data.numel()
    assert torch.equal(torch.cat([quant_linear(x, p) for p in parts], dim=1), full)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_triton_dequantizing_matmul_in_the_interpreter(qtype: str) -> None:
    from pagedserve.kernels import triton_quant  # the interpreter was chosen at import without CUDA

    block = GGML_QUANT_TYPES[qtype].block_size
    n, k, m = 37, block * (2 if block == 256 else 5), 3
    w = make_weight(qtype, n, k, seed=7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(n)
    y = triton_quant.quant_matmul(x, w, bias)
    ref_q, ref, bound = _references(w, x)
    scale = x.double().abs() @ dequantize(w).double().abs().T
    assert ((y.double() - bias.double() - ref).abs() <= 1e-5 * scale + 1e-6).all()  # fp32 of the dequantized product
    cpu = quant_linear(x, prepare(w), bias).double()  # the CPU kernel: int8 activations, so within their rounding
    assert ((y.double() - cpu).abs() <= bound * 1.001 + 2e-5 * scale + 1e-6).all()
    with pytest.raises(ValueError, match="Q4_1"):
        triton_quant.quant_matmul(x[:, :32], make_weight("Q4_1", 4, 32, seed=0))


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_form_holds_the_blocks_exactly(qtype: str) -> None:
    qt = GGML_QUANT_TYPES[qtype]
    raw = torch.randint(0, 256, (19, 2 * qt.type_size), dtype=torch.uint8)  # every bit pattern, scales too
    w = prepare(QuantWeight(raw.clone(), qtype, (19, 2 * qt.block_size)), keep_blocks=False)
    assert w.data is None and w.nbytes == w.packed.numel() <= raw.numel() * 1.03 + 16 * 2 * qt.type_size
    assert torch.equal(w.blocks(), raw)
    assert torch.equal(w.split_rows(3, 17).data, raw[3:17])


def test_int8_per_channel_weights_run_as_q8_0() -> None:
    g = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (21, 96), generator=g, dtype=torch.int8)
    scale = (torch.rand(21, generator=g) * 1e-2 + 1e-4).to(torch.bfloat16)  # bf16 scales, as checkpoints hold them
    w = from_int8_per_channel(q, scale)
    assert torch.equal(dequantize(w), q.float() * scale.float()[:, None])
    x = torch.randn(3, 96, generator=g)
    ref_q, _, _ = _references(w, x)
    scale_sum = x.double().abs() @ dequantize(w).double().abs().T
    assert ((quant_linear(x, prepare(w)).double() - ref_q).abs() <= 1e-5 * scale_sum + 1e-7).all()
    with pytest.raises(ValueError, match="fp16"):
        from_int8_per_channel(q, torch.full((21,), 1e-9))


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q8_0", "Q4_1"), ("Q5_0",)])
@pytest.mark.parametrize("m", [1, 5, 19, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_parts_side_by_side_equal_float64_and_each_part(types: tuple[str, ...], m: int, dtype: torch.dtype,
                                                        prompt_rows: int) -> None:
    """Weights of different types in one call (q/k/v of Q4_K_M; what the fused stack runs):
    float64 of the dequantized product with x as quantized, and bit for bit each part alone
    with its slice of the bias, written into its own columns."""
    from pagedserve.kernels.quant import packed_parts, quant_linear_parts

    k = 256 * 2 if any(t.endswith("_K") for t in types) else 32 * 7
    rows = [37, 16, 21][: len(types)]  # cut groups, and a whole one
    ws = [prepare(make_weight(t, n, k, seed=10 * m + i)) for i, (t, n) in enumerate(zip(types, rows))]
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * torch.rand(k, generator=g) * 4).to(dtype)
    bias = torch.randn(sum(rows), generator=g).to(dtype)
    parts = packed_parts(ws)
    assert parts is not None
    y = quant_linear_parts(x, ws, bias, parts)
    assert y.shape == (m, sum(rows)) and y.dtype == dtype
    offs = [0, rows[0], rows[0] + (rows[1] if len(rows) > 1 else 0)]
    alone = torch.cat([quant_linear(x, w, bias[o : o + w.shape[0]]) for w, o in zip(ws, offs)], dim=1)
    assert torch.equal(y, alone)
    ref_q = torch.cat([_references(w, x)[0] for w in ws], dim=1)
    scale = torch.cat([x.double().abs() @ dequantize(w).double().abs().T for w in ws], dim=1)
    out_tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    got = y.double() - bias.double()
    assert ((got - ref_q).abs() <= 1e-5 * scale + out_tol * y.double().abs() + 1e-6).all()
    assert packed_parts([*ws[:1], make_weight(types[0], 16, k, seed=0)]) is None  # one not repacked


@pytest.mark.parametrize("qtype", TYPES)
def test_rows_of_the_packed_form_dequantize_exactly(qtype: str) -> None:
    """An embedding lookup over the packed weight (a decode step's few rows, in one call) is
    exactly ``dequantize``'s rows (which gguf-py's dequantizers hold), cut last group included."""
    from pagedserve.gpuworker.gguf_weights import embedding_rows

    k = GGML_QUANT_TYPES[qtype].block_size * 2
    w = make_weight(qtype, 37, k, seed=8)
    full = dequantize(w)
    prepare(w, keep_blocks=False)
    ids = torch.tensor([36, 0, 17, 17, 5, 32])
    assert torch.equal(quant_cpu.rows(w.packed, w.quant.code, 37, k, ids), full[ids])
    assert torch.equal(embedding_rows(w, ids), full[ids])
    with pytest.raises(ValueError, match="out of range"):
        quant_cpu.rows(w.packed, w.quant.code, 37, k, torch.tensor([37]))
