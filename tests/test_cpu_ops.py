"""The CPU path's fused per-layer ops (kernels/cpu_ops.cpp) against the torch
ops they replace, in fp32 and bf16: residual add + RMSNorm, rotary
embedding with the K/V cache write (strided q/k/v rows of a fused
projection, padding slots skipped), and SiLU(gate) * up."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pagedserve.gpuworker import cpu_gemm
from pagedserve.gpuworker.distributed import SINGLE
from pagedserve.gpuworker.layers import RMSNorm, RotaryEmbedding, _rotate
from pagedserve.gpuworker.linear import RowParallelLinear
from pagedserve.kernels import cpu_build, cpu_ops

DTYPES = [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)]


def test_the_fused_ops_build_here() -> None:
    assert cpu_build.load() is not None  # a silent fallback would hide a broken library


def _torch_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_torch(dtype: torch.dtype, tol: float, rows: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype) * 3
    residual = torch.randn(rows, 576, generator=g).to(dtype) if with_residual else None
    weight = torch.randn(576, generator=g).to(dtype)
    want_out, want_res = _torch_norm(x, residual, weight, 1e-5)
    got = cpu_ops.add_rms_norm(x.clone(), None if residual is None else residual.clone(), weight, 1e-5)
    assert got is not None
    out, res = got
    assert torch.equal(res, want_res) if dtype == torch.bfloat16 else torch.allclose(res, want_res, atol=1e-6)
    err = ((out.double() - want_out.double()).abs().max() / want_out.double().abs().max()).item()
    assert err < tol, err


def test_rms_norm_layer_uses_the_fused_op_and_writes_the_sum_into_residual() -> None:
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2, 64))
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    want = _torch_norm(x, residual, norm.weight.detach(), 1e-6)
    buf = residual.clone()
    out, res = norm(x, buf)
    assert res is buf and torch.allclose(buf, x + residual)  # one pass, no new residual tensor
    assert torch.allclose(out, want[0], atol=1e-5)


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
def test_rope_and_cache_equals_rotary_plus_cache_write(dtype: torch.dtype, tol: float, heads: int, kv_heads: int,
                                                       head_dim: int) -> None:
    g = torch.Generator().manual_seed(heads * head_dim)
    tokens, num_blocks, block_size = 11, 6, 4
    rotary = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0})
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width + 8, generator=g).to(dtype)[:, :width]  # strided rows, as a fused projection's view
    positions = torch.randint(0, 512, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3] = -1  # padding: skipped
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    # The torch path: split, rotate, write through the slot mapping.
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    want_q, want_k = rotary(positions, q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim))
    got_qkv = qkv.clone()
    k_flat, v_flat = k_cache.view(-1, kv_heads, head_dim), v_cache.view(-1, kv_heads, head_dim)
    assert cpu_ops.rope_and_cache(got_qkv, heads, kv_heads, head_dim, positions, rotary.cos, rotary.sin,
                                  k_cache, v_cache, slots)
    got_q = got_qkv[:, : heads * head_dim].reshape(tokens, heads, head_dim)
    keep = slots >= 0

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()

    assert rel(got_q, want_q) < tol
    assert rel(k_flat[slots[keep]], want_k[keep]) < tol
    assert torch.equal(v_flat[slots[keep]], v.reshape(tokens, kv_heads, head_dim)[keep])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert k_flat[untouched].isnan().all() and v_flat[untouched].isnan().all()  # only the given slots written
    assert torch.equal(got_qkv[:, (heads + kv_heads) * head_dim:], qkv[:, (heads + kv_heads) * head_dim:])  # v as it was


def test_rotate_helper_matches_the_bf16_rounding_of_the_fused_op() -> None:
    # bf16: the fused op rounds after every product and sum, as the torch ops do; equal bit for bit.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 2, 64, generator=g).to(torch.bfloat16)
    cos, sin = torch.rand(3, 1, 32, generator=g), torch.rand(3, 1, 32, generator=g)
    want = _rotate(x, cos, sin)
    qkv = torch.cat([x.reshape(3, 128), torch.zeros(3, 2 * 64, dtype=torch.bfloat16)], dim=1)
    pos = torch.arange(3)
    kc = torch.zeros(4, 1, 1, 64, dtype=torch.bfloat16)
    assert cpu_ops.rope_and_cache(qkv, 2, 1, 64, pos, cos[:, 0].contiguous(), sin[:, 0].contiguous(), kc, kc.clone(),
                                  torch.full((3,), -1))
    assert torch.equal(qkv[:, :128].reshape(3, 2, 64), want)


@pytest.mark.parametrize("dtype,tol", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 40])
def test_silu_and_mul_equals_torch(dtype: torch.dtype, tol: float, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=g) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # exp's clamps
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_ops.silu_and_mul(x)
    assert got is not None
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert err < tol, err


def test_fused_ops_decline_what_they_do_not_take() -> None:
    x = torch.randn(4, 8, dtype=torch.float64)
    assert cpu_ops.silu_and_mul(x) is None
    assert cpu_ops.add_rms_norm(x, None, torch.ones(8, dtype=torch.float64), 1e-6) is None
    assert cpu_ops.add_rms_norm(torch.randn(8, 4).t(), None, torch.ones(8), 1e-6) is None  # not contiguous


def test_silu_flushes_denormals_inside_and_leaves_the_callers_mode() -> None:
    """The silu kernel runs with denormals flushed (without it, denormal assists
    made it 18x slower than with them, kernels/cpu_common.h), and gives the
    caller's floating-point mode back: denormals keep working in torch after."""
    tiny = 1e-39  # a float32 denormal
    x = torch.tensor([[tiny, 1.0], [2.0, 1.0]])
    out = cpu_ops.silu_and_mul(x)
    assert out is not None
    ref = torch.nn.functional.silu(x[:, :1]) * x[:, 1:]
    assert ref[0, 0].item() != 0.0  # torch keeps the denormal: silu(tiny) is about tiny / 2
    assert out[0, 0].item() == 0.0  # the kernel flushed it
    assert out[1, 0].item() == pytest.approx(ref[1, 0].item(), rel=1e-6)
    assert (torch.tensor([tiny]) * 1.0).item() != 0.0  # the mode was restored


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16, 17, 67])
@pytest.mark.parametrize("n,k,with_bias", [(963, 576, True), (576, 1536, False), (40, 64, True), (3, 10, False)])
def test_packed_linear_equals_a_float64_matmul(dtype: torch.dtype, tol: float, rows: int, n: int, k: int,
                                               with_bias: bool) -> None:
    """cpu_linear.cpp over its panels: one tile of up to 8 rows, or tiles of nearly
    equal rows (17: 6 + 6 + 5), N past the last group of 3 panels and inside a
    panel (963 = 60 panels + 3), small K."""
    g = torch.Generator().manual_seed(rows * 7 + n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    packed = cpu_ops.pack_linear(w)
    assert packed is not None and packed.shape == (-(-n // 16) * 16, k)
    got = cpu_ops.packed_linear(x, packed, n, bias)
    assert got is not None and got.shape == (rows, n) and got.dtype == dtype
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < tol, err


def test_pack_linear_lays_out_panels_of_16_features() -> None:
    """Panel p holds w[16p : 16p + 16] side by side per k, zero past N; a whole
    group of 3 panels (AVX-512) is interleaved per k, [K][3][16], so a tile reads
    one stream; the panel after it is [K][16]. bf16: k pairs side by side."""
    avx512 = "avx512f" in Path("/proc/cpuinfo").read_text().split()
    assert cpu_ops.linear_group() == (3 if avx512 else 1)
    g = cpu_ops.linear_group()
    w = torch.arange(56 * 4, dtype=torch.float32).view(56, 4)  # 4 panels, the last with 8 features
    p = cpu_ops.pack_linear(w).flatten()
    group = p[:g * 16 * 4].view(4, g, 16)  # [K][g][16]
    for j in range(g):
        assert torch.equal(group[:, j], w[16 * j:16 * j + 16].T), j
    rest = p[g * 16 * 4:].view(4 - g, 4, 16)  # the panels after the group: [K][16] each
    assert torch.equal(rest[-1, :, :8], w[48:].T) and not rest[-1, :, 8:].any()
    if g == 3:
        assert p[1 * 48 + 2 * 16 + 5].item() == w[37, 1].item()  # k = 1, third panel, feature 32 + 5
    b = cpu_ops.pack_linear(w.bfloat16()).flatten()
    pairs = b[:g * 16 * 4].view(2, g, 16, 2)  # [K/2][g][16][2]
    assert torch.equal(pairs[1, g - 1, 3], w[16 * (g - 1) + 3, 2:4].bfloat16())  # k = 2 and 3
    assert torch.equal(b[g * 16 * 4:].view(4 - g, 2, 16, 2)[-1, 0, 7], w[55, 0:2].bfloat16())


def test_packed_linear_declines_what_it_does_not_take() -> None:
    w = torch.randn(32, 64)
    p = cpu_ops.pack_linear(w)
    assert cpu_ops.pack_linear(torch.randn(8, 9).bfloat16()) is None  # bf16 needs k pairs
    assert cpu_ops.pack_linear(w.double()) is None
    assert cpu_ops.packed_linear(torch.randn(2, 64).double(), p, 32, None) is None
    assert cpu_ops.packed_linear(torch.randn(2, 32), p, 32, None) is None  # K differs
    assert cpu_ops.packed_linear(torch.randn(2, 64), p, 16, None) is None  # a whole panel past the features
    assert cpu_ops.packed_linear(torch.randn(2, 64), p, 32, torch.randn(31)) is None  # bias of another size
    assert cpu_ops.packed_linear(torch.randn(0, 64), p, 32, None) is None
    x = torch.randn(3, 5, 64)  # leading dimensions kept
    assert torch.allclose(cpu_ops.packed_linear(x, p, 32, None), x @ w.T, atol=1e-4)


def test_cpu_linear_packs_panels_and_falls_back_to_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_gemm: panels by default, oneDNN with PAGEDSERVE_CPU_LINEAR=onednn, plain
    F.linear with PAGEDSERVE_CPU_PACKED_GEMM=0; each result is the layout's own."""
    calls: list[int] = []
    real = cpu_ops.packed_linear
    monkeypatch.setattr(cpu_ops, "packed_linear", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    layer = RowParallelLinear(64, 48, (0, 64), True, SINGLE)
    nn.init.normal_(layer.weight)
    nn.init.normal_(layer.bias)
    x = torch.randn(5, 64)
    assert cpu_gemm.pack_model(layer, 64) == 1 and layer.packed.layout is cpu_gemm.Layout.PANELS
    panels = real(x, layer.packed.data, 48, layer.bias)
    assert torch.equal(layer(x), panels) and len(calls) == 1
    monkeypatch.setenv("PAGEDSERVE_CPU_LINEAR", "onednn")
    assert cpu_gemm.pack_model(layer, 64) == 1 and layer.packed.layout is cpu_gemm.Layout.ONEDNN
    onednn = torch.ops.mkldnn._linear_pointwise(x, layer.packed.data, layer.bias, "none", [], "")
    assert torch.equal(layer(x), onednn) and len(calls) == 1
    monkeypatch.setenv("PAGEDSERVE_CPU_PACKED_GEMM", "0")
    assert cpu_gemm.pack_model(layer, 64) == 0 and layer.packed is None
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias)) and len(calls) == 1
    monkeypatch.setenv("PAGEDSERVE_CPU_LINEAR", "mkl")
    monkeypatch.delenv("PAGEDSERVE_CPU_PACKED_GEMM")
    with pytest.raises(ValueError):
        cpu_gemm.pack_model(layer, 64)
