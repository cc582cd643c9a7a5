"""Qwen3 and Phi-3 through the worker's paged forward against transformers on
the same seeded tiny checkpoints, and the YaRN / LongRoPE frequencies
against transformers' own ``ROPE_INIT_FUNCTIONS``.

LongRoPE: we pick the short or long factors once, as vLLM does, from the
served context (``max_position_embeddings`` here) against
``original_max_position_embeddings``; transformers picks per forward call
from that call's largest position. The end-to-end tests stay where both
agree: "short" serves no more than the original context (every position is
below it, transformers stays short), "long" serves more and every sequence
compared (and every ``generate`` prefill) is longer than the original
context, so each of transformers' calls picks the long factors too.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from models import make_tiny_model
from test_worker import BS, GREEDY, Driver, assert_logits_close, check_chunks_and_decodes, hf_logits, make_runner, prompts
from transformers import AutoModelForCausalLM, Phi3Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.common.config import EngineConfig
from pagedserve.gpuworker.layers import RotaryEmbedding, rope_frequencies
from pagedserve.gpuworker.model_runner import ModelRunner

# head_dim 12 for the tiny Phi-3 (48 / 4 heads): 6 factors; clearly apart, so picking the wrong set shows.
SHORT = [1.0, 1.25, 1.5, 2.0, 3.0, 4.0]
LONG = [1.5, 2.5, 4.0, 6.0, 9.0, 12.0]


def longrope(**extra: Any) -> dict[str, Any]:
    return {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, **extra}


WINDOW = 16
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {}),
    # layer 0 full, layer 1 slides over 16 tokens (layer_types from max_window_layers)
    "qwen3-sliding": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3-yarn": ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}}),
    "phi3": ("phi3", {}),
    # served context 512 == original 512: short factors, attention factor 1
    "phi3-longrope-short": ("phi3", {"original_max_position_embeddings": 512, "rope_scaling": longrope()}),
    # served 512 > original 16: long factors, attention factor sqrt(1 + ln 32 / ln 16)
    "phi3-longrope-long": ("phi3", {"original_max_position_embeddings": 16, "rope_scaling": longrope()}),
    # Phi-4-mini-like partial rotary (half of each head turns) with Phi-3's every-layer window
    "phi3-partial-sliding": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": WINDOW}),
}
LENGTHS = [19, 40, 23]  # all past the window and the long regime's original context (16)


def _folder(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    arch, overrides = FAMILIES[family]
    # a copy: transformers' config classes fill defaults into the rope dict they are given
    return make_tiny_model(tmp_path_factory.mktemp(family), arch, seed=1, **copy.deepcopy(overrides))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_prefill_chunks_and_decode_match_transformers(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = _folder(tmp_path_factory, family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = make_runner(folder)
    model = runner.model
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[FAMILIES[family][0]]
    windows = [layer.self_attn.attn.sliding_window for layer in model.layers]
    assert windows == {"qwen3-sliding": [None, WINDOW], "phi3-partial-sliding": [WINDOW, WINDOW]}.get(family, [None, None])
    check_chunks_and_decodes(runner, hf, list(LENGTHS), chunk=24, decodes=4)


@pytest.mark.parametrize("family", ["qwen3-sliding", "phi3-longrope-long"])
def test_bfloat16_within_bf16_bounds_of_transformers(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = _folder(tmp_path_factory, family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = ModelRunner(EngineConfig(model=folder, device="cpu", dtype="bfloat16", block_size=BS, num_gpu_blocks=64),
                         keep_logits=True)
    runner.init()
    assert runner.cache.gpu[0][0].dtype == torch.bfloat16
    d = Driver(runner)
    ps = prompts(3, LENGTHS, seed=5)
    d.step({0: 19, 1: 24, 2: 23}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    d.step({0: 1, 1: 16, 2: 1})
    worst = 0.0
    for _ in range(3):
        d.step({i: 1 for i in range(3)})
        for i in range(3):
            ref = hf_logits(hf, d.tokens[i][:-1])[-1]
            worst = max(worst, ((runner.last_logits[i] - ref).abs().max() / ref.abs().max()).item())
    # bf16 keeps 8 bits of mantissa; through 2 layers the logits drift by a few 1e-2.
    assert 1e-6 < worst < 5e-2, f"relative error {worst:.2e}"


@pytest.mark.parametrize("family", ["qwen3-sliding", "phi3-partial-sliding"])
def test_triton_backend_matches_transformers(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The Triton kernels (interpreted on CPU) in the real forward: small on purpose."""
    folder = _folder(tmp_path_factory, family)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    runner = make_runner(folder, attention_backend="triton", num_gpu_blocks=16)
    assert runner.backend.name == "triton"
    d = Driver(runner)
    ps = prompts(2, [19, 4], seed=8)  # 19 crosses the window of 16
    d.step({0: 19, 1: 4}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    d.step({0: 1, 1: 1})
    for i in range(2):
        assert_logits_close(runner.last_logits[i], hf_logits(hf, d.tokens[i][:-1])[-1])


# ------------------------------------------------------------ RoPE frequencies

def _qwen3(rope: dict[str, Any], **kw: Any) -> Qwen3Config:
    return Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=kw.pop("head_dim", 64),
                       max_position_embeddings=kw.pop("max_position_embeddings", 4096), rope_parameters=rope, **kw)


YARN = {
    "gpt-oss": dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096),
    "qwen3-truncated": dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=1024),
    "betas": dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, beta_fast=16, beta_slow=2,
                  original_max_position_embeddings=512),
    "mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.707,
                   original_max_position_embeddings=4096),
    "attention-factor": dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, attention_factor=0.9,
                             original_max_position_embeddings=2048),
    "factor-from-context": dict(rope_type="yarn", rope_theta=10000.0, factor=None, original_max_position_embeddings=1024),
    "partial": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, partial_rotary_factor=0.5,
                    original_max_position_embeddings=1024),
}


@pytest.mark.parametrize("name", list(YARN))
def test_yarn_frequencies_match_transformers(name: str) -> None:
    cfg = _qwen3(dict(YARN[name]))
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, None)
    got, scale = rope_frequencies(64, dict(YARN[name]), 4096, max_position_embeddings=cfg.max_position_embeddings)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert abs(scale - want_scale) < 1e-6 and (name == "attention-factor" or scale > 1.0)


def _phi3(rope: dict[str, Any], original: int, **kw: Any) -> Phi3Config:
    return Phi3Config(hidden_size=96, num_attention_heads=4, max_position_embeddings=kw.pop("max_position_embeddings", 4096),
                      original_max_position_embeddings=original, rope_parameters=rope, **kw)


LONGROPE = {  # head_dim 24: 12 factors
    "phi3.5": (dict(rope_type="longrope", short_factor=[1.0 + i / 8 for i in range(12)],
                    long_factor=[1.0 + i for i in range(12)], rope_theta=10000.0), 256),
    "attention-factor": (dict(rope_type="longrope", short_factor=[1.1] * 12, long_factor=[3.0] * 12, rope_theta=500.0,
                              attention_factor=1.3), 1024),
    "explicit-factor": (dict(rope_type="longrope", short_factor=[1.1] * 12, long_factor=[3.0] * 12, rope_theta=1e4,
                             factor=8.0), 512),
    "partial": (dict(rope_type="longrope", short_factor=[1.0 + i / 4 for i in range(9)],
                     long_factor=[2.0 + i for i in range(9)], rope_theta=1e4, partial_rotary_factor=0.75), 256),
}


@pytest.mark.parametrize("name", list(LONGROPE))
@pytest.mark.parametrize("served", ["short", "long"])
def test_longrope_frequencies_match_transformers(name: str, served: str) -> None:
    rope, original = LONGROPE[name]
    cfg = _phi3(dict(rope), original)
    params = dict(cfg.rope_parameters)
    assert params["original_max_position_embeddings"] == original
    # transformers: long factors when a call's sequence outgrows the original context
    want, want_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, None, seq_len=original + 1 if served == "long" else None)
    max_position = cfg.max_position_embeddings if served == "long" else original
    got, scale = rope_frequencies(24, params, max_position, max_position_embeddings=cfg.max_position_embeddings)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert abs(scale - want_scale) < 1e-6
    if name == "phi3.5":
        assert abs(scale - math.sqrt(1 + math.log(4096 / 256) / math.log(256))) < 1e-9


@pytest.mark.parametrize("served", ["short", "long"])
def test_longrope_cos_sin_match_transformers_rotary(served: str) -> None:
    """cos and sin with the attention factor, against Phi3RotaryEmbedding run
    over all served positions (its per-call choice then agrees with ours)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rope, original = LONGROPE["phi3.5"]
    cfg = _phi3(dict(rope), original, max_position_embeddings=1024)
    max_position = 1024 if served == "long" else original
    ours = RotaryEmbedding(24, max_position, dict(cfg.rope_parameters), max_position_embeddings=1024)
    cos, sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), torch.arange(max_position)[None])
    torch.testing.assert_close(torch.cat([ours.cos, ours.cos], -1), cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([ours.sin, ours.sin], -1), sin[0], rtol=1e-6, atol=1e-6)
    assert cos.abs().max() > 1.05  # the attention factor (about 1.22) is in


def test_partial_rotary_turns_only_the_leading_features() -> None:
    rotary = RotaryEmbedding(8, 32, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    assert rotary.rotary_dim == 4 and rotary.cos.shape == (32, 2)
    q, k = torch.randn(5, 3, 8), torch.randn(5, 2, 8)
    pos = torch.tensor([0, 3, 7, 30, 31])
    rq, rk = rotary(pos, q, k)
    assert torch.equal(rq[..., 4:], q[..., 4:]) and torch.equal(rk[..., 4:], k[..., 4:])
    full = RotaryEmbedding(4, 32, {"rope_theta": 10000.0})
    fq, fk = full(pos, q[..., :4], k[..., :4])
    torch.testing.assert_close(rq[..., :4], fq)
    torch.testing.assert_close(rk[..., :4], fk)


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'"):
        RotaryEmbedding(16, 32, {"rope_type": "dynamic", "factor": 2.0})


def test_phi3_fused_checkpoint_with_wrong_qkv_rows_is_refused(tmp_path: Path) -> None:
    from pagedserve.gpuworker.loader import iter_weights, load_hf_config
    from pagedserve.gpuworker.models import build_model

    folder = make_tiny_model(tmp_path, "phi3", seed=0)
    cfg = load_hf_config(folder)
    cfg.num_key_value_heads = 4  # the checkpoint has 2: its qkv_proj rows no longer add up
    with pytest.raises(ValueError, match="shape mismatch for .*qkv_proj.weight"):
        build_model(cfg, iter_weights(folder, progress=False), torch.float32, torch.device("cpu"), 512)
