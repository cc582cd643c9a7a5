"""Issue 2, acceptance 6: the throughput benchmark runs both systems in one run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from models import make_tiny_model

from pagedserve.bench import throughput


def test_bench_throughput_ci_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=0)
    assert throughput.main(["--model", model, "--num-requests", "4", "--max-tokens", "8", "--device", "cpu",
                            "--num-gpu-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert "pagedserve (4 processes, gRPC)" in out and "transformers generate" in out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["bench"] == "throughput" and res["engine_tokens_per_s"] > 0 and res["transformers_tokens_per_s"] > 0
    assert res["ratio"] == pytest.approx(res["engine_tokens_per_s"] / res["transformers_tokens_per_s"])
