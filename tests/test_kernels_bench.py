"""`pagedserve bench kernel` runs end to end on CPU (tiny, in the Triton
interpreter) and its final JSON line carries every point."""
from __future__ import annotations

import json

import pytest
import torch

from pagedserve.bench import kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU (interpreter) configuration")
def test_bench_kernel_tiny_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rc = kernel.main(["--batches", "1,2", "--contexts", "33", "--prefill", "1x20", "--block-size", "8"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "interpreter" in lines[0]
    result = json.loads(lines[-1])
    assert result["bench"] == "kernel" and result["mode"] == "interpreter"
    assert [(p["kind"], p["batch"], p["len"]) for p in result["points"]] == [
        ("decode", 1, 33), ("decode", 2, 33), ("prefill", 1, 20)]
    for p in result["points"]:
        assert p["us"] > 0 and p["sdpa_us"] > 0 and p["copy_gbps"] > 0
        assert p["max_abs_diff_vs_sdpa"] < 1e-4  # the paged kernel agrees with SDPA on the same K/V


def test_bench_kernel_rejects_bad_geometry(capsys: pytest.CaptureFixture[str]) -> None:
    assert kernel.main(["--device", "cpu", "--num-heads", "5", "--num-kv-heads", "2"]) == 2
