"""bench sharing --decoding beam: block savings from real beam-search runs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from models import make_tiny_model

from pagedserve.bench import sharing


def test_beam_sharing_ci_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=0)
    assert sharing.main(["--decoding", "beam", "--model", model, "--widths", "2,4", "--workloads", "alpaca",
                         "--beam-requests", "2", "--beam-max-output", "8"]) == 0
    out = capsys.readouterr().out
    assert "real model runs" in out
    res = json.loads(out.strip().splitlines()[-1])
    assert res["simulated"] is False and res["decoding"] == "beam"
    by_width = res["results"]["alpaca"]
    # Beams share their prompt and common history: a real saving, growing with the width.
    assert 0 < by_width["2"]["saving_pct"] < by_width["4"]["saving_pct"] < 100
