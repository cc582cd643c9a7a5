"""Llama 3 RoPE scaling (as in Llama-3.1 checkpoints) matches transformers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import make_tiny_model
from transformers import AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq
from pagedserve.gpuworker.model_runner import ModelRunner

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 2.0}])
def test_scaled_rope_logits_match_transformers(tmp_path: Path, scaling: dict[str, object]) -> None:
    d = make_tiny_model(tmp_path, "llama", seed=0, rope_scaling=scaling, rope_theta=500000.0)
    ids = list(range(5, 205))  # past original_max_position_embeddings, where llama3 scaling bites
    runner = ModelRunner(EngineConfig(model=d, num_gpu_blocks=64), keep_logits=True)
    runner.init()
    blocks = list(range(20, 7, -1))
    runner.execute(ExecuteStep(0, [NewSeq(0, ids, 0, SamplingParams(temperature=0.0), len(ids))], [BlockDiff(0, 0, blocks)],
                               [ScheduledSeq(0, len(ids))], []))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    err = (runner.last_logits[0] - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, f"relative error {err:.2e}"
