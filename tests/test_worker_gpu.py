"""The worker on CUDA (skipped without it): Triton attention in the real
forward, pinned swap space, and a KV pool sized from profiled free memory."""
from __future__ import annotations

import pytest
import torch
from models import make_tiny_model
from test_worker import BS, GREEDY, Driver, hf_logits, prompts
from transformers import AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.worker import ExecuteStep, ScheduledSeq
from pagedserve.gpuworker.model_runner import ModelRunner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_forward_with_swap_matches_transformers(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineConfig(model=folder, device="cuda", dtype="float32", block_size=BS, num_gpu_blocks=64, swap_space=0.01))
    runner.init()
    assert runner.backend.name == "triton" and runner.cache.cpu[0][0].is_pinned()
    d = Driver(runner)
    ps = prompts(3, [9, 26, 3], seed=3)
    d.step({i: len(p) for i, p in enumerate(ps)}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    for _ in range(3):
        d.step({i: 1 for i in range(3)})
    # swap seq 1 out and back into other blocks, then keep decoding
    old = list(d.blocks[1])
    cpu = list(range(len(old)))
    d.step({0: 1, 2: 1}, swap_out=list(zip(old, cpu)))
    new = [d.free.pop() for _ in old]
    d.blocks[1] = new
    from pagedserve.common.messages.worker import BlockDiff

    d.step_id += 1
    runner.execute(ExecuteStep(d.step_id, [], [BlockDiff(1, 0, new)], [ScheduledSeq(1, 1)], [], swap_in=list(zip(cpu, new))))
    d.computed[1] += 1
    ref = hf_logits(hf, d.tokens[1])[-1]
    err = (runner.last_logits[1].cpu() - ref).abs().max() / ref.abs().max()
    assert err < 1e-3, f"relative error {err:.2e}"
    for i in (0, 2):
        out = hf.generate(torch.tensor([ps[i]]), max_new_tokens=len(d.tokens[i]) - len(ps[i]), do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert d.tokens[i] == out[0].tolist()


def test_cuda_pool_takes_the_profiled_share_of_memory(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)
    util = 0.5
    torch.cuda.empty_cache()
    runner = ModelRunner(EngineConfig(model=folder, device="cuda", block_size=16, gpu_memory_utilization=util,
                                      max_num_batched_tokens=2048))
    ready = runner.init()
    free, total = torch.cuda.mem_get_info()
    used_share = (total - free) / total
    print(f"blocks={ready.num_gpu_blocks} used={used_share:.3f} of {total / 2**30:.0f} GiB")
    assert abs(used_share - util) < 0.05
