"""Gemma 3 text (gpuworker/gemma3.py) through the worker's paged forward,
against transformers' Gemma3ForCausalLM on the same seeded tiny checkpoints:
6 layers, 5 sliding (window 16) + 1 full, prompts shorter and longer than
the window, chunked prefill and decodes, through the compiled CPU stack and
layer by layer; softcapping, rope scaling on the
full layers, untied head; bf16; the Triton kernels in the interpreter; and a
real Gemma 3 270M config built on the meta device."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import make_tiny_model
from safetensors.torch import load_file, save_file
from test_worker import GREEDY, Driver, assert_logits_close, check_chunks_and_decodes, hf_logits, make_runner, prompts
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from pagedserve.common.config import EngineConfig
from pagedserve.gpuworker import cpu_fused
from pagedserve.gpuworker.distributed import TPGroup
from pagedserve.gpuworker.gemma3 import FULL, SLIDING, Gemma3ForCausalLM, rope_params
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.models import model_class

WINDOW = 16  # ARCHS["gemma3"]["sliding_window"]
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "softcap": {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0},  # logits reach about 4
    "rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},  # the full layers only, as 4B+ ship
    "untied": {"tie_word_embeddings": False},
}


def gemma_checkpoint(root: str | os.PathLike[str], seed: int = 1, **overrides: Any) -> str:
    """The tiny Gemma 3 with random norm weights: transformers initializes every
    (1 + w) weight to 0, which would hide a swapped or misplaced norm."""
    folder = make_tiny_model(root, "gemma3", seed, **overrides)
    marker = os.path.join(folder, "norms-randomized")
    if not os.path.exists(marker):
        path = os.path.join(folder, "model.safetensors")
        tensors = load_file(path)
        gen = torch.Generator().manual_seed(seed)
        for name in sorted(tensors):
            if name.endswith("norm.weight"):
                tensors[name] = 0.5 * torch.randn(tensors[name].shape, generator=gen)
        save_file(tensors, path, metadata={"format": "pt"})
        Path(marker).touch()
    return folder


def hf_model(folder: str, **kw: Any) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()


@pytest.mark.parametrize("fused", ["1", "0"], ids=["stack", "layers"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gemma3_prefill_chunk_and_decode_match_transformers(variant: str, fused: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled CPU stack (cpu_fused.py) and the layer-by-layer torch path, each against transformers."""
    monkeypatch.setenv("PAGEDSERVE_" + cpu_fused.ENV, fused)
    folder = gemma_checkpoint(tmp_path, **VARIANTS[variant])
    hf = hf_model(folder)
    runner = make_runner(folder)
    assert isinstance(runner.model, Gemma3ForCausalLM)
    check_chunks_and_decodes(runner, hf, [7, 40, 23], chunk=20, decodes=5)  # shorter than the window, and longer
    assert (runner.model.fused is not None) == (fused == "1")  # the path named ran, not a silent fallback


def test_transformers_applies_final_softcap_and_ignores_attention_softcap(tmp_path: Path) -> None:
    """Why gemma3.py softcaps the logits but not the attention scores: transformers'
    Gemma 3 keeps attn_logit_softcapping in its config and never uses it (eager
    or sdpa). If a release starts applying it, this fails and gemma3.py must too."""
    folder = gemma_checkpoint(tmp_path, **VARIANTS["softcap"])
    tokens = prompts(1, [40], seed=4)[0]
    for impl in ("eager", "sdpa"):
        capped = hf_logits(hf_model(folder, attn_implementation=impl), tokens)
        no_attn_cap = hf_logits(hf_model(folder, attn_implementation=impl, attn_logit_softcapping=None), tokens)
        raw = hf_logits(hf_model(folder, attn_implementation=impl, final_logit_softcapping=None), tokens)
        assert torch.equal(capped, no_attn_cap), impl
        assert raw.abs().max() > 3.0 > capped.abs().max()  # the cap bites
        torch.testing.assert_close(capped, 3.0 * torch.tanh(raw / 3.0))


@pytest.mark.parametrize("fused", ["1", "0"], ids=["stack", "layers"])
def test_gemma3_bfloat16_within_bf16_bounds(fused: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ours in bf16 is as far from transformers in float32 as transformers' own
    bf16 forward is (sqrt(hidden) rounded to bf16, norms in float32, ...)."""
    monkeypatch.setenv("PAGEDSERVE_" + cpu_fused.ENV, fused)
    folder = gemma_checkpoint(tmp_path, intermediate_size=72)  # bf16 panels need an even K (71 runs F.linear)
    hf32 = hf_model(folder)
    hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    runner = ModelRunner(EngineConfig(model=folder, device="cpu", dtype="bfloat16", block_size=8, num_gpu_blocks=64), keep_logits=True)
    runner.init()
    assert runner.cache.gpu[0][0].dtype == torch.bfloat16
    ids = torch.arange(500)
    assert torch.equal(runner.model.embed(ids), hf16.model.embed_tokens(ids))  # sqrt(48) as bf16 6.9375, not 6.928
    d = Driver(runner)
    ps = prompts(3, [7, 40, 23], seed=5)
    d.step({0: 7, 1: 20, 2: 23}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    d.step({0: 1, 1: 20, 2: 1})
    ours_err, hf_err = 0.0, 0.0
    for _ in range(4):
        d.step({i: 1 for i in range(3)})
        for i in range(3):
            ref = hf_logits(hf32, d.tokens[i][:-1])[-1]
            scale = ref.abs().max().item()
            ours_err = max(ours_err, (runner.last_logits[i] - ref).abs().max().item() / scale)
            hf_err = max(hf_err, (hf_logits(hf16, d.tokens[i][:-1])[-1] - ref).abs().max().item() / scale)
    assert 1e-6 < ours_err < max(2 * hf_err, 2e-2), f"ours {ours_err:.2e}, transformers bf16 {hf_err:.2e}"
    assert (runner.model.fused is not None) == (fused == "1")


def test_gemma3_triton_backend_matches_transformers(tmp_path: Path) -> None:
    """The Triton kernels (interpreted on CPU) with sliding layers: small on purpose."""
    folder = gemma_checkpoint(tmp_path)
    hf = hf_model(folder)
    runner = make_runner(folder, attention_backend="triton", num_gpu_blocks=16)
    assert runner.backend.name == "triton"
    d = Driver(runner)
    ps = prompts(2, [WINDOW + 5, 4], seed=8)
    d.step({0: WINDOW + 5, 1: 4}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    d.step({0: 1, 1: 1})
    for i in range(2):
        assert_logits_close(runner.last_logits[i], hf_logits(hf, d.tokens[i][:-1])[-1])


def test_gemma3_270m_config_builds_on_meta() -> None:
    """The real 270M shapes (head_dim 256, one KV head, 262144 vocab): the served
    class, its windows and RoPEs, and the parameter count transformers has."""
    import transformers

    cfg = Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256, rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0, max_position_embeddings=32768, architectures=["Gemma3ForCausalLM"],
    )
    assert model_class(cfg) is Gemma3ForCausalLM
    with torch.device("meta"):
        ours = Gemma3ForCausalLM(cfg)
        theirs = transformers.Gemma3ForCausalLM(cfg)
    assert (ours.num_layers, ours.num_kv_heads, ours.total_kv_heads, ours.head_dim) == (18, 1, 1, 256)
    windows = [layer.self_attn.attn.sliding_window for layer in ours.layers]
    assert windows == ([512] * 5 + [None]) * 3
    assert ours.layers[0].self_attn.attn.scale == 256**-0.5
    assert rope_params(cfg) == {FULL: {"rope_type": "default", "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) and 268_000_000 < count < 268_200_000
    ours = ours.to(torch.bfloat16)  # as build_model casts on meta
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ours.init_buffers(cfg.max_position_embeddings, torch.device("cpu"))
    assert ours.rotary[FULL].cos.shape == ours.rotary[SLIDING].cos.shape == (32768, 128)
    assert not torch.equal(ours.rotary[FULL].cos, ours.rotary[SLIDING].cos)
    with torch.device("meta"):  # tensor parallel 2: 2 query heads a rank, the one KV head replicated
        rank1 = Gemma3ForCausalLM(cfg, TPGroup(1, 2))
    assert (rank1.num_kv_heads, rank1.layers[0].self_attn.num_heads) == (1, 2)
    assert rank1.layers[0].mlp.gate_up_proj.weight.shape == (2048, 640)


def test_rope_params_from_either_config_shape() -> None:
    """transformers 5's per-layer-type dict, and the older flat fields."""
    new = SimpleNamespace(rope_parameters={
        FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4},
    })
    old = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    want = {FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
    assert rope_params(new) == rope_params(old) == want
    assert rope_params(SimpleNamespace()) == {FULL: {"rope_theta": 1e6}, SLIDING: {"rope_theta": 1e4, "rope_type": "default"}}
