"""The CPU kernels pack weights into 2 MiB pages (kernels/cpu_memory.py): each packed
weight's whole huge pages are backed by transparent huge pages, which the kernel reports
per mapping in /proc/self/smaps, and the packed bytes are those of the plain packing."""
from __future__ import annotations

import contextlib

import pytest
import torch

from pagedserve.kernels import cpu_build, cpu_memory, cpu_ops
from pagedserve.kernels.quant import QuantWeight, prepare
from pagedserve.kernels.quant_bench import random_weight

pytestmark = [
    pytest.mark.skipif(cpu_memory.thp_mode() not in ("madvise", "always"),
                       reason=f"transparent huge pages are {cpu_memory.thp_mode()} here"),
    pytest.mark.skipif(cpu_build.load() is None, reason="no CPU kernel library (no compiler)"),
]


def huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def whole_huge_page(t: torch.Tensor) -> int:
    """The address of the first 2 MiB page that lies wholly inside ``t``."""
    start = -(-t.data_ptr() // cpu_memory.HUGE_PAGE) * cpu_memory.HUGE_PAGE
    assert start + cpu_memory.HUGE_PAGE <= t.data_ptr() + t.numel() * t.element_size(), "weight too small"
    return start


def huge_pages(on: bool) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if on else cpu_memory.small_pages()


def packed_panels(on: bool) -> torch.Tensor:
    w = (torch.randn(3072, 2048, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    with huge_pages(on):
        p = cpu_ops.pack_linear(w)
    assert p is not None
    return p


def packed_q8_0(on: bool) -> torch.Tensor:
    with huge_pages(on):
        w = prepare(random_weight("Q8_0", 4096, 2048))
    if w.packed is None:
        pytest.skip("the quantized kernels need AVX-512 VNNI")
    return w.packed


@pytest.mark.parametrize("pack", [packed_panels, packed_q8_0], ids=["bf16-panels", "Q8_0-blocks"])
def test_a_packed_weight_sits_in_huge_pages(pack) -> None:  # type: ignore[no-untyped-def]
    huge, small = pack(True), pack(False)
    assert torch.equal(huge.view(torch.uint8), small.view(torch.uint8))
    advised = (huge.numel() * huge.element_size() - cpu_memory.HUGE_PAGE) // 1024  # at least this much is whole pages
    # Compaction may fail for a page on a fragmented machine; most must be huge.
    assert huge_kb(whole_huge_page(huge)) >= advised // 2, (huge_kb(whole_huge_page(huge)), advised)
    if cpu_memory.thp_mode() == "madvise":  # the control: unadvised memory stays in 4 KiB pages
        assert huge_kb(whole_huge_page(small)) == 0


def test_small_or_switched_off_is_plain_torch_empty() -> None:
    """Under 2 MiB, or inside small_pages(), no mapping of its own (its storage is
    torch's, resizable; a frombuffer view's is not)."""
    assert cpu_memory.empty((1000,), torch.float32).untyped_storage().resizable()
    with huge_pages(False):
        assert cpu_memory.empty((1 << 20,), torch.float32).untyped_storage().resizable()
    t = cpu_memory.empty((1 << 20,), torch.float32)
    assert not t.untyped_storage().resizable() and t.shape == (1 << 20,) and t.dtype == torch.float32


def test_the_huge_pages_benchmark_pairs_the_two_copies(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m benchmarks huge-pages`` on SmolLM2's shapes: its huge copy is in huge pages
    (the LM head's 56 MB at least) and each row count has a paired ratio."""
    import json

    from benchmarks import huge_pages

    assert huge_pages.main(["--shape", "smol", "--rows", "1,2", "--kind", "bf16", "--repeats", "3"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]["bf16"]
    assert res["huge_copy_in_huge_pages_mib"] >= 40, res
    assert all(res[m]["ratio"] > 0 and res[m]["small_ms"] > 0 for m in ("1", "2")), res
