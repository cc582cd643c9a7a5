"""`pagedserve bench worker` in CI size on CPU: a tiny checkpoint, two decode
batch sizes and a short prefill, with the transformers baseline."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from models import make_tiny_model

from pagedserve.bench import worker


def test_bench_worker_tiny_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_tiny_model(tmp_path, "llama", seed=0)
    rc = worker.main(["--model", folder, "--device", "cpu", "--batch-sizes", "1,3", "--context", "20", "--prefill", "24",
                      "--steps", "2", "--warmup", "1", "--block-size", "8"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("bench worker on CPU")
    assert any(line.startswith("phase") and "vs_hf" in line for line in lines)
    result = json.loads(lines[-1])
    assert result["bench"] == "worker" and result["weights"] == "checkpoint" and result["cuda_graphs"] is False
    assert [(p["phase"], p["batch"], p["tokens_per_step"]) for p in result["points"]] == [
        ("decode", 1, 1), ("decode", 3, 3), ("prefill", 1, 24)]
    for p in result["points"]:
        assert p["steps_per_s"] > 0 and p["hf_steps_per_s"] > 0 and p["vs_hf"] > 0
        assert p["tokens_per_s"] == pytest.approx(p["steps_per_s"] * p["tokens_per_step"], rel=1e-3)
    assert result["prefill_logits_rel_err"] < 1e-4  # the worker's forward agrees with transformers on the same tokens


def test_bench_worker_random_weights_without_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
        "max_position_embeddings": 256,
    }))
    rc = worker.main(["--random-weights", str(config), "--device", "cpu", "--batch-sizes", "2", "--context", "8",
                      "--prefill", "16", "--steps", "1", "--warmup", "1", "--no-baseline"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["weights"] == "random" and "random weights" in result["model"]
    assert [p["phase"] for p in result["points"]] == ["decode", "prefill"]
    assert "hf_steps_per_s" not in result["points"][0] and result["prefill_logits_rel_err"] is None
