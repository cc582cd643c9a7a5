"""``--dtype bfloat16`` on CPU (the compiled attention kernel's bf16 path,
oneDNN's bf16 matmuls): logits stay within bf16 bounds of transformers run in
float32 on the same weights, prefill and decode, with shuffled blocks."""
from __future__ import annotations

import torch
from models import make_tiny_model
from test_worker import GREEDY, Driver, hf_logits, prompts
from transformers import AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.gpuworker.model_runner import ModelRunner


def test_bfloat16_on_cpu_within_bf16_bounds_of_transformers(tmp_path) -> None:
    folder = make_tiny_model(tmp_path, "llama", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineConfig(model=folder, device="cpu", dtype="bfloat16", block_size=8, num_gpu_blocks=64), keep_logits=True)
    runner.init()
    assert runner.cache.gpu[0][0].dtype == torch.bfloat16
    d = Driver(runner)
    ps = prompts(3, [11, 26, 4], seed=5)
    d.step({i: len(p) for i, p in enumerate(ps)}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    worst = 0.0
    for _ in range(4):
        d.step({i: 1 for i in range(3)})
        for i in range(3):
            ref = hf_logits(hf, d.tokens[i][:-1])[-1]
            ours = runner.last_logits[i]
            worst = max(worst, ((ours - ref).abs().max() / ref.abs().max()).item())
    # bf16 keeps 8 bits of mantissa; through 2 layers the logits drift by a few 1e-2.
    assert worst < 5e-2, f"relative error {worst:.2e}"
    assert worst > 1e-6  # it really ran in bf16, not in float32
