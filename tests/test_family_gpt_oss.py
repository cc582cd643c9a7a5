"""gpt-oss through the worker's paged forward against transformers' own
``GptOssForCausalLM`` on the same seeded tiny checkpoint: attention biases
and sinks, alternating sliding (16) / full layers, YaRN, the biased router
and clamped-SwiGLU experts. Prompts are shorter and longer than the window,
prefilled in chunks, then decoded; fp32 exact, bf16 within bf16 bounds, and
the Triton kernels in the interpreter (small)."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pytest
import torch
from models import make_tiny_model
from safetensors.torch import load_file, save_file
from test_worker import BS, GREEDY, Driver, assert_logits_close, check_chunks_and_decodes, hf_logits, make_runner, prompts
from transformers import AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.gpuworker.distributed import SINGLE, TPGroup
from pagedserve.gpuworker.gpt_oss import GptOssForCausalLM
from pagedserve.gpuworker.loader import iter_weights, load_hf_config
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.models import build_model

WINDOW = 16
LENGTHS = [12, 40, 14]  # shorter, much longer and a little shorter than the window


def _loud(folder: str) -> str:
    """transformers initializes every bias to zero and the sinks small, which
    would let a dropped bias or sink pass: give them real values, and push the
    expert pre-activations past the SwiGLU clamp (limit 7) so it bites."""
    path = f"{folder}/model.safetensors"
    sd = load_file(path)
    gen = torch.Generator().manual_seed(5)
    for name, t in sd.items():
        if name.endswith("bias") or name.endswith("sinks"):
            sd[name] = torch.randn(t.shape, generator=gen) * (1.0 if name.endswith("sinks") else 0.3)
        elif name.endswith("experts.gate_up_proj"):
            sd[name] = t * 4.0
    save_file(sd, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    folder = _loud(make_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=1))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                              experts_implementation="eager").eval()  # the modeling code itself
    assert hf.config.sliding_window == WINDOW and hf.config.layer_types == ["sliding_attention", "full_attention"]
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    return folder, hf


def test_checkpoint_exercises_biases_sinks_and_the_clamp(ckpt: tuple[str, torch.nn.Module]) -> None:
    """The fixture really is loud: otherwise the tests below could not fail on those features."""
    _, hf = ckpt
    layer = hf.model.layers[0]
    assert layer.self_attn.o_proj.bias.abs().min() > 0 and layer.mlp.experts.down_proj_bias.abs().min() > 0
    assert layer.self_attn.sinks.abs().max() > 0.5
    x = hf.model.layers[0].post_attention_layernorm(hf.model.embed_tokens(torch.tensor(prompts(1, [40])[0])))
    gate_up = x @ layer.mlp.experts.gate_up_proj[0]
    assert (gate_up.abs() > hf.config.swiglu_limit).float().mean() > 0.05


def test_yarn_tables_match_transformers(ckpt: tuple[str, torch.nn.Module]) -> None:
    """The model's cos/sin tables are transformers' YaRN ones, attention factor included."""
    folder, hf = ckpt
    model = build_model(load_hf_config(folder), iter_weights(folder, progress=False), torch.float32,
                        torch.device("cpu"), 512, SINGLE)
    positions = torch.arange(512)
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, 512, D / 2]
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1)
    torch.testing.assert_close(model.rotary.cos, cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.rotary.sin, sin[0], rtol=1e-6, atol=1e-6)


def test_prefill_chunks_and_decode_match_transformers(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    runner = make_runner(folder)
    assert isinstance(runner.model, GptOssForCausalLM)
    windows = [layer.self_attn.attn.sliding_window for layer in runner.model.layers]
    assert windows == [WINDOW, None]
    # seq 1 in chunks of 12 past the window; six decodes cross block boundaries and, for seqs 0 and 2, the window
    d = check_chunks_and_decodes(runner, hf, list(LENGTHS), chunk=12, decodes=6)
    assert all(len(d.tokens[i]) - 1 > WINDOW for i in range(3))  # the last query no longer sees the first key


def test_bfloat16_within_bf16_bounds_of_transformers(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    runner = ModelRunner(EngineConfig(model=folder, device="cpu", dtype="bfloat16", block_size=BS, num_gpu_blocks=64),
                         keep_logits=True)
    runner.init()
    assert runner.cache.gpu[0][0].dtype == torch.bfloat16
    d = Driver(runner)
    ps = prompts(3, LENGTHS, seed=11)
    d.step({i: len(p) for i, p in enumerate(ps)}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    worst = 0.0
    for _ in range(4):
        d.step({i: 1 for i in range(3)})
        for i in range(3):
            ref = hf_logits(hf, d.tokens[i][:-1])[-1]
            worst = max(worst, ((runner.last_logits[i] - ref).abs().max() / ref.abs().max()).item())
    # bf16, and within its bounds: measured 2.7e-2, transformers' own bf16 forward 3.3e-2 on these tokens.
    assert 1e-6 < worst < 5e-2, f"relative error {worst:.2e}"


@pytest.mark.parametrize("path", ["loop", "dense"])
def test_moe_paths_match_the_transformers_mlp(ckpt: tuple[str, torch.nn.Module], path: str) -> None:
    """Each FusedMoE path on CPU ("dense" is what CUDA graph capture runs; "grouped" needs CUDA)
    against transformers' GptOssMLP: biased router, top-k softmax, biased clamped-SwiGLU experts."""
    folder, hf = ckpt
    model = build_model(load_hf_config(folder), iter_weights(folder, progress=False), torch.float32,
                        torch.device("cpu"), 64, SINGLE)
    x = torch.randn(1, 29, hf.config.hidden_size, generator=torch.Generator().manual_seed(4)) * 2
    for ours, theirs in zip(model.layers, hf.model.layers):
        ours.mlp.path = path
        with torch.no_grad():
            torch.testing.assert_close(ours.mlp(x[0]), theirs.mlp(x)[0][0], rtol=1e-5, atol=1e-5)


@dataclass(frozen=True)
class _Alone(TPGroup):
    """Rank ``rank`` of a group of two whose all-reduce returns the partial sum
    unchanged, so one process can hold both ranks' halves and add them."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_tp_halves_of_experts_and_sinks_add_up(ckpt: tuple[str, torch.nn.Module]) -> None:
    """TP=2 on the loud checkpoint (test_tp.py runs the real group on one with zero biases):
    the ranks' expert partial sums add up to the whole MLP, down biases counted once, and
    each rank holds its heads' sinks."""
    folder, hf = ckpt
    cfg = load_hf_config(folder)

    def build(tp: TPGroup) -> torch.nn.Module:
        return build_model(cfg, iter_weights(folder, progress=False), torch.float32, torch.device("cpu"), 64, tp)

    whole, ranks = build(SINGLE), [build(_Alone(r, 2)) for r in range(2)]
    x = torch.randn(23, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    for i in range(cfg.num_hidden_layers):
        ref = whole.layers[i].mlp(x)
        torch.testing.assert_close(ranks[0].layers[i].mlp(x) + ranks[1].layers[i].mlp(x), ref, rtol=1e-5, atol=1e-5)
        sinks = hf.model.layers[i].self_attn.sinks
        for r, m in enumerate(ranks):
            torch.testing.assert_close(m.layers[i].self_attn.attn.sinks, sinks[2 * r : 2 * r + 2], rtol=0, atol=0)


def _triton_sinks() -> str | None:
    """Why the Triton test cannot run here, or None."""
    try:
        from pagedserve.kernels.triton_attention import paged_attention
    except ModuleNotFoundError as e:
        return f"Triton is not installed ({e.name})"
    if "sinks" not in inspect.signature(paged_attention).parameters:
        return "the Triton attention kernel has no sinks yet"
    return None


def test_triton_backend_matches_transformers(ckpt: tuple[str, torch.nn.Module]) -> None:
    """The Triton kernels (interpreted on CPU) with sinks and the window: small on purpose."""
    reason = _triton_sinks()
    if reason:
        pytest.skip(reason)
    folder, hf = ckpt
    runner = make_runner(folder, attention_backend="triton", num_gpu_blocks=16)
    assert runner.backend.name == "triton"
    d = Driver(runner)
    ps = prompts(2, [20, 5], seed=8)  # one longer than the window
    d.step({0: 20, 1: 5}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    d.step({0: 1, 1: 1})
    for i in range(2):
        assert_logits_close(runner.last_logits[i], hf_logits(hf, d.tokens[i][:-1])[-1])
