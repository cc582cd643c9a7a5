"""The Llama decoder stack in one compiled call (gpuworker/cpu_fused.py,
kernels/cpu_model.cpp) against the per-op path it replaces: the same logits and
the same K/V pool, bit for bit, over prefills, chunked prefills and decodes, in
fp32, bf16 and with an fp8 pool; the stack rebuilt when the runner swaps a
layer's scales; and the per-op path wherever the stack cannot run.
tests/test_worker.py holds the default (fused) forward to transformers."""
from __future__ import annotations

import pytest
import torch
from models import make_tiny_model
from test_worker import BS, GREEDY, Driver, prompts

from pagedserve.common.config import EngineConfig
from pagedserve.gpuworker import cpu_fused
from pagedserve.gpuworker.cpu_fused import FusedStack
from pagedserve.gpuworker.model_runner import ModelRunner


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    # An even intermediate size: bf16 panels need an even K (odd ones run F.linear, and so no stack).
    return make_tiny_model(tmp_path_factory.mktemp("models"), request.param, seed=3, intermediate_size=98)


def make_runner(folder: str, dtype: str = "float32", **kw: object) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=folder, device="cpu", dtype=dtype, block_size=BS, num_gpu_blocks=64, **kw),  # type: ignore[arg-type]
                         keep_logits=True)
    runner.init()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # random norm weights (a fresh checkpoint's are all ones: a swapped norm would not show)
        for name, p in runner.model.named_parameters():
            if "norm" in name:
                p.mul_(torch.rand(p.shape, generator=g).to(p.dtype) + 0.5)
    return runner


def _run(runner: ModelRunner) -> tuple[list[list[int]], dict[int, torch.Tensor]]:
    """A mixed schedule: two prefills, one of them chunked, beside decodes; returns every
    step's logits and the final tokens."""
    d = Driver(runner)
    ps = prompts(3, [21, 6, 13], seed=5)
    logits: dict[int, torch.Tensor] = {}
    d.step({0: 8, 1: 6}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    logits[1] = runner.last_logits[1].clone()
    d.step({0: 13, 1: 1, 2: 13}, new={2: (ps[2], GREEDY)})
    for step in range(9):  # decodes across block boundaries (block size 8)
        d.step({0: 1, 1: 1, 2: 1})
        for i in range(3):
            logits[100 * step + i] = runner.last_logits[i].clone()
    return [d.tokens[i] for i in range(3)], logits


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"),
                                      ("bfloat16", "fp8_e5m2")])
def test_fused_stack_equals_the_per_op_path(folder: str, dtype: str, kv: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fused = make_runner(folder, dtype=dtype, kv_cache_dtype=kv)
    toks_f, logits_f = _run(fused)
    assert fused.model.fused is not None  # the stack ran, not a silent fallback
    monkeypatch.setenv("PAGEDSERVE_" + cpu_fused.ENV, "0")
    per_op = make_runner(folder, dtype=dtype, kv_cache_dtype=kv)
    toks_p, logits_p = _run(per_op)
    assert per_op.model.fused is None
    assert toks_f == toks_p
    assert logits_f.keys() == logits_p.keys()
    for key in logits_f:
        assert torch.equal(logits_f[key], logits_p[key]), key
    for (kf, vf), (kp, vp) in zip(fused.cache.gpu, per_op.cache.gpu):  # the same bytes written to the pool
        assert torch.equal(kf.view(torch.uint8), kp.view(torch.uint8))
        assert torch.equal(vf.view(torch.uint8), vp.view(torch.uint8))


def test_new_scales_rebuild_the_stack(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 layer whose scale tensor the runner replaces is read through the new one."""
    runners = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PAGEDSERVE_" + cpu_fused.ENV, flag)
        runner = make_runner(folder, kv_cache_dtype="fp8")
        d = Driver(runner)
        ps = prompts(2, [9, 14], seed=2)
        d.step({0: 9, 1: 14}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
        first = runner.model.fused
        attn = runner.model.layers[-1].self_attn.attn
        attn.k_scale, attn.v_scale = torch.tensor(0.03125), torch.tensor(0.0625)
        d.step({0: 1, 1: 1})
        assert (runner.model.fused is not first and runner.model.fused is not None) == (flag == "1")
        runners.append(runner)
    for i in range(2):
        assert torch.equal(runners[0].last_logits[i], runners[1].last_logits[i])


def test_the_stack_is_not_built_where_an_op_would_not_run_compiled(folder: str) -> None:
    runner = make_runner(folder)
    model, pools = runner.model, runner.cache.gpu
    assert FusedStack.build(model, pools) is not None
    lin = model.layers[1].mlp.down_proj
    packed, lin.packed = lin.packed, None  # a layer on plain F.linear
    assert FusedStack.build(model, pools) is None
    lin.packed = packed
    assert FusedStack.build(model, pools[:-1]) is None  # a pool per layer
    float_pools = [(k.double(), v.double()) for k, v in pools]  # a pool dtype the library does not read
    assert FusedStack.build(model, float_pools) is None


def test_opt_and_gpt2_run_layer_by_layer(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Families without the fused stack still serve (and keep matching transformers in test_worker)."""
    for arch in ("opt", "gpt2"):
        runner = make_runner(make_tiny_model(tmp_path_factory.mktemp(arch), arch, seed=0))
        assert not hasattr(runner.model, "fused")
        d = Driver(runner)
        d.step({0: 5}, new={0: (prompts(1, [5])[0], GREEDY)})
        assert len(d.tokens[0]) == 6
