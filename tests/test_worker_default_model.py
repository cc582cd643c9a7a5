"""The worker on the embedded SmolLM2-135M-Instruct: same logits and greedy
tokens as transformers on the converted folder."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedserve.common.config import EngineConfig
from pagedserve.common.default_model import resolve_model
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq
from pagedserve.gpuworker.model_runner import ModelRunner


@torch.no_grad()
def test_smollm2_greedy_matches_transformers() -> None:
    folder = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True,
        return_dict=True,
    )["input_ids"]
    runner = ModelRunner(EngineConfig(model=None, block_size=16, num_gpu_blocks=16), keep_logits=True)
    ready = runner.init()
    assert ready.model.model_name == "SmolLM2-135M-Instruct" and ready.model.eos_token_ids == (2,)
    assert ready.model.max_model_len == 8192 and ready.model.vocab_size == 49152
    n_new = 8
    blocks = list(range(15, 15 - (len(prompt) + n_new + 15) // 16, -1))
    greedy = SamplingParams(temperature=0.0)
    tokens = list(prompt)
    step = ExecuteStep(0, [NewSeq(0, list(prompt), 0, greedy, len(prompt))], [BlockDiff(0, 0, blocks)],
                       [ScheduledSeq(0, len(prompt))], [])
    logits = []
    for i in range(n_new):
        res = runner.execute(step)
        tokens.append(res.sampled[0].token_id)
        logits.append(runner.last_logits[0])
        step = ExecuteStep(i + 1, [], [], [ScheduledSeq(0, 1)], [])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref = hf(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1:]
    err = (torch.stack(logits) - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, f"relative error {err:.2e}"
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False)
    assert tokens == out[0].tolist()
    assert "Paris" in tok.decode(tokens[len(prompt):])
