"""The ops Gemma 3's layer adds to the compiled CPU stack (kernels/cpu_ops.cpp)
against float64 references: the (1 + w) RMSNorm with float32 weights (one
rounding, as transformers' Gemma3RMSNorm), per-head q/k norms in place on the
strided rows of a fused projection, and GELU-tanh(gate) * up; and each against
the torch ops of gpuworker/gemma3.py's layer-by-layer path in bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.gpuworker.gemma3 import GemmaRMSNorm
from pagedserve.kernels import cpu_ops

DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)]  # bf16: within one rounding of the float64 value


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_norm_equals_float64(dtype: torch.dtype, tol: float, rows: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 640, generator=g) * 4).to(dtype)
    residual = torch.randn(rows, 640, generator=g).to(dtype) if with_residual else None
    w = 1.0 + 0.5 * torch.randn(640, generator=g)  # float32 (1 + weight)
    got = cpu_ops.gemma_rms_norm(x.clone(), None if residual is None else residual.clone(), w, 1e-6)
    assert got is not None
    out, summed = got
    want_sum = x if residual is None else x + residual  # the residual add rounds in the model dtype
    assert torch.equal(summed, want_sum)
    assert _rel(out, _norm64(want_sum, w, 1e-6)) < tol
    # the layer-by-layer path's op: one rounding of the float32 product (a Llama norm would round twice)
    norm = GemmaRMSNorm(640, 1e-6)
    norm.weight.data = w - 1.0
    ref = norm(want_sum)
    assert _rel(out, ref.double()) < tol
    if dtype == torch.bfloat16:  # the same rounding: bf16 values agree but for float32 ties (float32: last bits)
        assert (out != ref).float().mean().item() < 0.01


def test_gemma_norm_in_place() -> None:
    """The stack norms a sublayer's output into itself (out is x)."""
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    w = torch.rand(256) + 0.5
    want = cpu_ops.gemma_rms_norm(x.clone(), None, w, 1e-6)
    assert want is not None
    from pagedserve.kernels import cpu_build

    assert cpu_build.load().pagedserve_add_rms_norm_f32w(1, x.data_ptr(), None, w.data_ptr(), x.data_ptr(), 3, 256, 1e-6) == 0
    assert torch.equal(x, want[0])


@pytest.mark.parametrize("dtype,tol,f32_weights", [(*DTYPES[0], True), (*DTYPES[1], True), (*DTYPES[1], False)],
                         ids=["fp32", "bf16-gemma", "bf16-llama"])  # fp32: both norms are one formula
def test_head_norms_in_place_on_strided_rows(dtype: torch.dtype, tol: float, f32_weights: bool) -> None:
    heads, kv_heads, d, tokens = 4, 1, 256, 6
    width = (heads + 2 * kv_heads) * d
    g = torch.Generator().manual_seed(7)
    buf = (torch.randn(tokens, width + 32, generator=g) * 3).to(dtype)  # rows padded: a strided view
    qkv = buf[:, :width]
    before = buf.clone()
    qw, kw = (torch.rand(d, generator=g) + 0.5 for _ in range(2))
    if not f32_weights:
        qw, kw = qw.to(dtype), kw.to(dtype)
    assert cpu_ops.head_norms(qkv, heads, kv_heads, d, qw, kw, 1e-6)
    q = before[:, :heads * d].reshape(tokens, heads, d)
    k = before[:, heads * d:(heads + kv_heads) * d].reshape(tokens, kv_heads, d)
    assert _rel(buf[:, :heads * d].reshape(tokens, heads, d), _norm64(q, qw, 1e-6)) < tol
    assert _rel(buf[:, heads * d:(heads + kv_heads) * d].reshape(tokens, kv_heads, d), _norm64(k, kw, 1e-6)) < tol
    assert torch.equal(buf[:, (heads + kv_heads) * d:], before[:, (heads + kv_heads) * d:])  # v and padding untouched


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 40])
def test_gelu_tanh_and_mul_equals_float64(dtype: torch.dtype, tol: float, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 2048, generator=g) * 3).to(dtype)
    x[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 1e-3]).to(dtype)  # exp's clamps, and tanh near 0
    gate, up = x.double().chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    got = cpu_ops.gelu_tanh_and_mul(x)
    assert got is not None
    assert _rel(got, want) < (2e-6 if dtype == torch.float32 else 1.6e-2)  # bf16: the GELU rounds, then the product
    torch_gate, torch_up = x.chunk(2, dim=-1)
    ref = F.gelu(torch_gate, approximate="tanh") * torch_up  # the layer-by-layer path's ops
    if dtype == torch.bfloat16:  # as close to float64 as torch's bf16 ops (which round the same steps)
        ours, theirs = ((t.double() - want).abs().mean().item() for t in (got, ref))
        assert ours < 1.01 * theirs, (ours, theirs)


def test_gemma_ops_decline_what_they_do_not_take() -> None:
    x = torch.randn(4, 8, dtype=torch.float64)
    assert cpu_ops.gelu_tanh_and_mul(x) is None
    assert cpu_ops.gemma_rms_norm(x, None, torch.ones(8), 1e-6) is None
    assert cpu_ops.gemma_rms_norm(torch.randn(4, 8), None, torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert not cpu_ops.head_norms(torch.randn(2, 48).t(), 1, 1, 16, torch.ones(16), torch.ones(16), 1e-6)
    bf16 = torch.ones(16, dtype=torch.bfloat16)  # weights in neither qkv's dtype nor float32
    assert not cpu_ops.head_norms(torch.randn(2, 48), 1, 1, 16, bf16, bf16, 1e-6)
