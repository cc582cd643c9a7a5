"""The worker on CUDA (skipped without it): Triton attention in the real
forward, pinned swap space, decode CUDA graphs against eager and
transformers, and a KV pool sized from profiled free memory."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from models import make_tiny_model
from test_worker import BS, GREEDY, Driver, assert_logits_close, hf_logits, prompts
from transformers import AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq
from pagedserve.gpuworker.cache_engine import bytes_per_block
from pagedserve.gpuworker.model_runner import ModelRunner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_forward_with_swap_matches_transformers(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineConfig(model=folder, device="cuda", dtype="float32", block_size=BS, num_gpu_blocks=64,
                                      swap_space=0.01, max_num_seqs=8), keep_logits=True)
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_graph_decode_matches_eager_and_transformers(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Padded batches (5 -> graph 8, 3 -> graph 4) through the captured
    graphs: same logits as the eager forward, same tokens as transformers."""
    folder = make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = EngineConfig(model=folder, device="cuda", dtype="float32", block_size=BS, num_gpu_blocks=96, max_num_seqs=8)
    graphed, eager = ModelRunner(cfg, cuda_graphs=True, keep_logits=True), ModelRunner(cfg, cuda_graphs=False, keep_logits=True)
    graphed.init()
    eager.init()
    assert graphed.graphs is not None and graphed.graphs.sizes == [1, 2, 4, 8] and eager.graphs is None
    drivers = [Driver(graphed), Driver(eager)]
    ps = prompts(5, [9, 17, 4, 30, 12], seed=9)
    for d in drivers:
        d.step({i: len(p) for i, p in enumerate(ps)}, new={i: (p, GREEDY) for i, p in enumerate(ps)})

    def both(schedule: dict[int, int], **kw: object) -> None:
        for d in drivers:
            d.step(schedule, **kw)
        for s in schedule:
            assert_logits_close(graphed.last_logits[s].cpu(), eager.last_logits[s].cpu())

    for _ in range(6):  # crosses block boundaries
        both({i: 1 for i in range(5)})
    for step in range(4):
        both({i: 1 for i in (0, 2, 4)}, finished=[1, 3] if step == 0 else None)
    assert graphed.graphs.replays == 10
    assert drivers[0].tokens == drivers[1].tokens
    for i in (0, 2, 4):
        ref = hf_logits(hf, drivers[0].tokens[i][:-1])[-1]
        err = (graphed.last_logits[i].cpu() - ref).abs().max() / ref.abs().max()
        assert err < 1e-3, f"relative error {err:.2e}"
        out = hf.generate(torch.tensor([ps[i]]), max_new_tokens=len(drivers[0].tokens[i]) - len(ps[i]), do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert drivers[0].tokens[i] == out[0].tolist()


def test_cuda_graphs_are_optional(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)
    cfg = EngineConfig(model=folder, device="cuda", dtype="float32", block_size=BS, num_gpu_blocks=16, max_num_seqs=4)
    monkeypatch.setenv("PAGEDSERVE_CUDA_GRAPHS", "0")
    off = ModelRunner(cfg)
    off.init()
    assert off.graphs is None
    torch_backend = ModelRunner(dataclasses.replace(cfg, attention_backend="torch"), cuda_graphs=True)
    torch_backend.init()
    assert torch_backend.graphs is None  # the torch reference syncs on the host: not capturable
    d = Driver(off)
    d.step({0: 5}, new={0: ([3, 4, 5, 6, 7], GREEDY)})
    d.step({0: 1})
    assert len(d.tokens[0]) == 7


@pytest.mark.parametrize("model", ["tiny-llama", "smollm2-135m"])
def test_cuda_pool_takes_the_profiled_share_of_memory(model: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Acceptance 4 on CUDA: after start-up the device holds
    gpu_memory_utilization of its memory (weights + pool + what the profile
    left for activations), within 5%, and a full-budget prefill fits in it."""
    from pagedserve.bench.worker import RANDOM_CONFIGS
    from pagedserve.gpuworker.model_runner import ModelSource

    util, max_tokens = 0.5, 2048
    source, folder = None, None
    if model == "tiny-llama":
        folder = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=0)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_cfg = LlamaConfig(architectures=["LlamaForCausalLM"], **RANDOM_CONFIGS[model])
        weights = {k: v.to(torch.bfloat16) for k, v in LlamaForCausalLM(hf_cfg).state_dict().items()}
        source = ModelSource(hf_cfg, weights.items, f"{model} (random weights)")
    gc.collect()  # earlier tests' runners (graphs hold cycles) must not count as this one's weights
    torch.cuda.empty_cache()
    cfg = EngineConfig(model=folder, device="cuda", dtype="bfloat16", block_size=16, gpu_memory_utilization=util,
                       max_num_batched_tokens=max_tokens, max_num_seqs=64)
    runner = ModelRunner(cfg, source=source, cuda_graphs=False)
    ready = runner.init()
    free, total = torch.cuda.mem_get_info()
    prof = runner.profile
    per_block = bytes_per_block(runner.num_layers, 16, runner.num_kv_heads, runner.head_dim, torch.bfloat16)
    budget = total * util - prof["peak"] - prof["non_torch"]
    used_share = (total - free) / total
    print(f"POOL-SIZING {model}: blocks={ready.num_gpu_blocks} pool={ready.num_gpu_blocks * per_block / 2**30:.2f} GiB "
          f"budget={budget / 2**30:.2f} GiB peak(weights+activations)={prof['peak'] / 2**30:.2f} GiB "
          f"non_torch={prof['non_torch'] / 2**30:.2f} GiB device used={used_share:.4f} of {total / 2**30:.0f} GiB "
          f"(target {util})")
    assert abs(ready.num_gpu_blocks * per_block - budget) < 0.05 * budget
    assert abs(used_share - util) < 0.05 * util
    # The activations the profile reserved room for: a full max_num_batched_tokens step.
    seq_len = min(max_tokens, runner.max_model_len)
    n = max_tokens // seq_len
    per_seq = seq_len // 16
    new = [NewSeq(i, prompts(1, [seq_len], seed=i)[0], 0, GREEDY, seq_len) for i in range(n)]
    tables = [BlockDiff(i, 0, list(range(i * per_seq, (i + 1) * per_seq))) for i in range(n)]
    res = runner.execute(ExecuteStep(1, new, tables, [ScheduledSeq(i, seq_len) for i in range(n)], []))
    assert len(res.sampled) == n
    free_after, _ = torch.cuda.mem_get_info()
    print(f"POOL-SIZING {model}: after a {n}x{seq_len}-token step device used={(total - free_after) / total:.4f}")
    assert (total - free_after) / total < util * 1.05
    del runner, res
    gc.collect()
    torch.cuda.empty_cache()
