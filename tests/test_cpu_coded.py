"""bf16 panels with coded exponents (kernels/cpu_coded.cpp): the same weights in 12 bits each,
whose linear equals the plain panels' bit for bit, and which the compiled decoder stack reads
for steps of up to ``coded_rows()`` rows."""
from __future__ import annotations

import os

import pytest
import torch
from test_cpu_fused import _run, make_runner
from test_cpu_fused import folder as folder  # noqa: F401 - the module-scoped tiny checkpoints

from pagedserve.gpuworker import cpu_gemm
from pagedserve.kernels import cpu_build, cpu_ops

pytestmark = pytest.mark.skipif(cpu_build.load() is None or cpu_ops.coded_rows() == 0,
                                reason="needs the compiled CPU kernels on a CPU with AVX512-BF16 and VBMI2")


def _escapes(coded: torch.Tensor) -> int:
    return int(coded[:64].view(torch.int64)[2])  # the header's third field


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


# 142 and 40: the last group's last panel is cut (padding features past N); 145, 50: a panel after the groups
@pytest.mark.parametrize("n,k", [(48, 8), (40, 16), (50, 64), (142, 48), (145, 132), (300, 1024)])
def test_coded_linear_equals_the_panels_bit_for_bit(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    # exponents spread over ~30 binades: far more than the 15 coded high bytes, so many weights escape
    w = (torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, k, generator=g) * 3)).to(torch.bfloat16)
    panels = cpu_ops.pack_linear(w)
    coded = cpu_ops.pack_coded(panels, n)
    assert coded is not None and _escapes(coded) > 0
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    for m in range(1, cpu_ops.coded_rows() + 3):  # coded rows, then the panels past them
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        y = cpu_ops.packed_linear(x, panels, n, bias, coded)
        out = torch.full((m + 1, n), 7.0, dtype=torch.bfloat16)  # with a row past y, where nothing may be written
        assert cpu_build.load().pagedserve_coded_linear(x.data_ptr(), coded.data_ptr(), panels.data_ptr(),
                                                        bias.data_ptr(), out.data_ptr(), m, n, k) == 0
        assert torch.equal(_bits(out[:m]), _bits(y)) and bool((out[m] == 7.0).all()), m
        assert torch.equal(_bits(y), _bits(cpu_ops.packed_linear(x, panels, n, bias))), m
        ref = x.double() @ w.double().T + bias.double()
        scale = (x.double().abs() @ w.double().abs().T).clamp_min(1e-30)
        assert ((y.double() - ref).abs() / scale).max() < 2 ** -7, m  # bf16 output rounding, fp32 sums


def test_coded_form_is_three_quarters_of_the_panels_and_says_where_it_cannot_run() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(480, 1024, generator=g) * 0.02).to(torch.bfloat16)  # a checkpoint's spread
    panels = cpu_ops.pack_linear(w)
    coded = cpu_ops.pack_coded(panels, 480)
    assert coded is not None
    assert coded.numel() <= 0.751 * panels.numel() * panels.element_size()
    assert _escapes(coded) < 1e-3 * w.numel()
    assert cpu_ops.pack_coded(cpu_ops.pack_linear(w.float()), 480) is None  # fp32: no coded form
    odd = torch.randn(64, 66).to(torch.bfloat16)  # K % 4 != 0
    assert cpu_ops.pack_coded(cpu_ops.pack_linear(odd), 64) is None
    small = torch.randn(16, 64).to(torch.bfloat16)  # one panel: no whole group of three
    assert cpu_ops.pack_coded(cpu_ops.pack_linear(small), 16) is None


def test_the_layouts_pack_coded_for_bf16_only_and_within_the_memory_left(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(96, 64).to(torch.bfloat16)
    packed = cpu_gemm.pack(w, 8)
    assert packed is not None and packed.layout is cpu_gemm.Layout.CODED and packed.coded is not None
    assert cpu_gemm.pack(w.float(), 8).layout is cpu_gemm.Layout.PANELS
    budget = cpu_gemm.coded_budget()
    assert budget is not None and budget < _ram_bytes()
    size = packed.coded.numel()
    assert cpu_ops.pack_coded(packed.data, 96, size) is not None
    assert cpu_ops.pack_coded(packed.data, 96, size - 1) is None
    monkeypatch.setattr(cpu_gemm, "coded_budget", lambda: size - 1)  # no room left: the panels alone
    tight = cpu_gemm.pack(w, 8)
    assert tight is not None and tight.layout is cpu_gemm.Layout.PANELS and tight.coded is None
    monkeypatch.undo()
    monkeypatch.setenv("PAGEDSERVE_CPU_LINEAR", "panels")
    plain = cpu_gemm.pack(w, 8)
    assert plain is not None and plain.layout is cpu_gemm.Layout.PANELS and plain.coded is None


def test_the_stack_reads_its_layers_coded_copies(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The compiled stack with coded weights equals the plain panels' bit for bit, and it reads the
    coded copy: with its layers' coded copies zeroed past their headers, the 3-row decodes change."""
    coded = make_runner(folder, dtype="bfloat16")
    toks_c, logits_c = _run(coded)
    assert coded.model.fused is not None
    layouts = [m.packed.layout for m in coded.model.modules() if getattr(m, "packed", None) is not None]
    assert cpu_gemm.Layout.CODED in layouts
    monkeypatch.setenv("PAGEDSERVE_CPU_LINEAR", "panels")
    plain = make_runner(folder, dtype="bfloat16")
    toks_p, logits_p = _run(plain)
    assert toks_c == toks_p and logits_c.keys() == logits_p.keys()
    for key in logits_c:
        assert torch.equal(logits_c[key], logits_p[key]), key
    monkeypatch.delenv("PAGEDSERVE_CPU_LINEAR")
    broken = make_runner(folder, dtype="bfloat16")
    stack = [m for m in broken.model.layers.modules() if getattr(m, "packed", None) is not None]  # not the LM head
    assert any(m.packed.coded is not None for m in stack)
    for m in stack:
        if m.packed.coded is not None:
            groups = int(m.packed.coded[:64].view(torch.int64)[0])
            m.packed.coded[64 + 8 * (groups + 1):].zero_()
    _, logits_b = _run(broken)
    assert not torch.equal(logits_b[0], logits_p[0])  # the first 3-row decode step


def test_steps_past_the_coded_rows_read_the_panels() -> None:
    """A coded copy zeroed past its header changes steps of up to ``coded_rows()`` rows only."""
    w = (torch.randn(96, 64) * 0.02).to(torch.bfloat16)
    panels = cpu_ops.pack_linear(w)
    coded = cpu_ops.pack_coded(panels, 96)
    assert coded is not None
    coded[64 + 8 * 2:].zero_()  # one group: two escape offsets after the header
    for m in range(1, cpu_ops.coded_rows() + 3):
        x = torch.randn(m, 64).to(torch.bfloat16)
        same = torch.equal(_bits(cpu_ops.packed_linear(x, panels, 96, None, coded)),
                           _bits(cpu_ops.packed_linear(x, panels, 96, None)))
        assert same == (m > cpu_ops.coded_rows()), m
