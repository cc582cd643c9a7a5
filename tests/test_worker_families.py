"""OPT, GPT-2 and Mistral (past its sliding window) through the worker's paged forward, against
transformers on the same seeded tiny checkpoints."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import make_tiny_model
from test_worker import check_chunks_and_decodes, make_runner
from transformers import AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.gpuworker.model_runner import ModelRunner

FAMILIES = {
    "opt": {},
    "opt-post-ln": {"do_layer_norm_before": False},  # opt-350m style
    "gpt2": {},
    "mistral": {"sliding_window": 8},  # prompts of 7-20 tokens cross the window
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_prefill_chunk_and_decode_match_transformers(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    arch = family.split("-")[0]
    folder = make_tiny_model(tmp_path_factory.mktemp(family), arch, seed=1, **FAMILIES[family])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = make_runner(folder)
    check_chunks_and_decodes(runner, hf, [7, 20, 13], chunk=12, decodes=4)


def test_mistral_context_is_not_capped_at_the_sliding_window(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "mistral", seed=1)  # window 64, 512 positions
    assert make_runner(folder).init().model.max_model_len == 512
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        ModelRunner(EngineConfig(model=folder, max_model_len=1024, num_gpu_blocks=8)).init()


def test_unsupported_activation_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama", seed=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        ModelRunner(EngineConfig(model=folder, num_gpu_blocks=8)).init()
