"""Qwen3-MoE and Mixtral through the worker's paged forward against
transformers on seeded tiny checkpoints (8 experts, top 2), and the shared
``FusedMoE`` layer against a plain per-token loop written here."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import make_tiny_model
from test_worker import GREEDY, Driver, assert_logits_close, check_chunks_and_decodes, hf_logits, make_runner, prompts
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.gpuworker import moe_layer
from pagedserve.gpuworker.distributed import TPGroup
from pagedserve.gpuworker.llama import LlamaMLP
from pagedserve.gpuworker.loader import iter_weights
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.models import build_model
from pagedserve.gpuworker.moe_layer import FusedMoE, expert_entries, softmax_topk

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {},
    # dense MLPs on layers 0 (decoder_sparse_step) and 2 (mlp_only_layers); top-k weights not renormalized
    "qwen3_moe-mixed": {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [2], "norm_topk_prob": False},
    "mixtral": {},  # sliding window 24: the 30-token prompt and the decodes cross it
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for family, overrides in FAMILIES.items():
        folder = make_tiny_model(root, family.split("-")[0], seed=1, **overrides)
        out[family] = (folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_prefill_chunk_and_decode_match_transformers(family: str, checkpoints: dict[str, Any]) -> None:
    folder, hf = checkpoints[family]
    runner = make_runner(folder)
    kinds = [type(layer.mlp) for layer in runner.model.layers]
    if family == "qwen3_moe-mixed":
        assert kinds == [LlamaMLP, FusedMoE, LlamaMLP, FusedMoE]
    else:
        assert set(kinds) == {FusedMoE}
    check_chunks_and_decodes(runner, hf, [7, 30, 13], chunk=12, decodes=4)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_bfloat16_within_bf16_bounds_of_transformers(family: str, checkpoints: dict[str, Any]) -> None:
    """Within bf16 bounds of transformers in float32 or in bf16, whichever is
    nearer: a bf16 rounding may flip a near-tie expert choice, which moves
    the logits far beyond bf16 bounds (Mixtral here: transformers' own bf16
    is 0.8 off its float32 on one decode), and either side of the tie is
    right. A broken bf16 path is far from both."""
    folder, hf = checkpoints[family]
    hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, experts_implementation="eager").eval()
    runner = ModelRunner(EngineConfig(model=folder, device="cpu", dtype="bfloat16", block_size=8, num_gpu_blocks=64),
                         keep_logits=True)
    runner.init()
    d = Driver(runner)
    ps = prompts(3, [11, 26, 4], seed=5)
    d.step({i: len(p) for i, p in enumerate(ps)}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    worst, off_fp32 = 0.0, 0.0
    for _ in range(3):
        d.step({i: 1 for i in range(3)})
        for i in range(3):
            ours = runner.last_logits[i]
            refs = [hf_logits(hf, d.tokens[i][:-1])[-1], hf_logits(hf16, d.tokens[i][:-1])[-1]]
            worst = max(worst, min(((ours - ref).abs().max() / ref.abs().max()).item() for ref in refs))
            off_fp32 = max(off_fp32, (ours - refs[0]).abs().max().item())
    assert worst < 5e-2, f"relative error {worst:.2e}"  # bf16 keeps 8 bits of mantissa
    assert off_fp32 > 1e-6  # it really ran in bf16, not in float32


def test_mixtral_on_the_triton_backend_matches_transformers(checkpoints: dict[str, Any]) -> None:
    """The Triton kernels (interpreted on CPU) with Mixtral's window: small on purpose."""
    folder, hf = checkpoints["mixtral"]
    runner = make_runner(folder, attention_backend="triton", num_gpu_blocks=16)
    assert runner.backend.name == "triton"
    d = Driver(runner)
    ps = prompts(2, [27, 4], seed=8)
    d.step({0: 27, 1: 4}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    d.step({0: 1, 1: 1})
    for i in range(2):
        assert_logits_close(runner.last_logits[i], hf_logits(hf, d.tokens[i][:-1])[-1])


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_loads_the_same_weights(family: str, checkpoints: dict[str, Any]) -> None:
    """transformers 5 keeps experts as 3-D gate_up_proj / down_proj (its
    state_dict, and the dummy loader's names); save_pretrained writes one
    tensor per expert. Both fill the same parameters."""
    folder, hf = checkpoints[family]
    fused = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    cfg = AutoConfig.from_pretrained(folder)
    a = build_model(cfg, fused.items(), torch.float32, torch.device("cpu"), 64)
    b = build_model(cfg, iter_weights(folder, progress=False), torch.float32, torch.device("cpu"), 64)
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert torch.equal(p, pb[name]), name


# ---- the FusedMoE layer alone -------------------------------------------

def _clamped_swiglu(x: torch.Tensor) -> torch.Tensor:
    """A gpt-oss-like activation: what a pluggable activation must allow."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _full_weights(e: int, h: int, i: int, bias: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"gate.weight": torch.randn(e, h, generator=g), "gate.bias": torch.randn(e, generator=g),
         "gate_up": torch.randn(e, 2 * i, h, generator=g) / h**0.5, "down": torch.randn(e, h, i, generator=g) / i**0.5}
    if bias:
        w["gate_up_bias"], w["down_bias"] = torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)
    return w


def _build(w: dict[str, torch.Tensor], k: int, bias: bool, act: Any, tp: TPGroup = TPGroup(),
           renormalize: bool = True) -> FusedMoE:
    e, two_i, h = w["gate_up"].shape
    moe = FusedMoE(e, k, h, two_i // 2, tp, bias=bias, router_bias=True, activation=act,
                   routing=softmax_topk(k, renormalize)).requires_grad_(False)
    moe.gate.weight.data.copy_(w["gate.weight"])
    moe.gate.bias.data.copy_(w["gate.bias"])  # type: ignore[union-attr]
    names = {"experts.gate_up_proj": "gate_up", "experts.down_proj": "down"}
    if bias:
        names |= {"experts.gate_up_proj_bias": "gate_up_bias", "experts.down_proj_bias": "down_bias"}
    for ckpt, key in names.items():
        for param, t, shard in expert_entries(ckpt, w[key]):  # type: ignore[union-attr]
            module, attr = param.split(".")
            getattr(moe, module).load_shard(attr, t, shard)
    return moe


def _per_token_reference(x: torch.Tensor, w: dict[str, torch.Tensor], k: int, act: Any, renormalize: bool) -> torch.Tensor:
    """The obvious loop: every token, its k experts, one at a time (float64)."""
    x, w = x.double(), {n: t.double() for n, t in w.items()}
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(w["gate.weight"] @ x[t] + w["gate.bias"], dim=-1)
        top, ids = torch.topk(probs, k)
        if renormalize:
            top = top / top.sum()
        for weight, e in zip(top.tolist(), ids.tolist()):
            gu = w["gate_up"][e] @ x[t] + (w["gate_up_bias"][e] if "gate_up_bias" in w else 0)
            y = w["down"][e] @ act(gu[None])[0] + (w["down_bias"][e] if "down_bias" in w else 0)
            out[t] += weight * y
    return out


@pytest.mark.parametrize("path", ["loop", "loop-packed", "grouped", "dense"])
@pytest.mark.parametrize("variant", ["silu", "bias-clamped-swiglu"])
def test_fused_moe_matches_a_per_token_loop(path: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    bias = variant != "silu"
    act = _clamped_swiglu if bias else _silu_mul
    w = _full_weights(8, 16, 24, bias, seed=3)  # widths that grouped_mm accepts
    w["gate.bias"][[1, 4, 6]] = -1e4  # experts 1, 4 and 6 never get a token
    moe = _build(w, 2, bias, act, renormalize=not bias)
    if path == "loop-packed":  # each expert over the CPU GEMM's packed panels, as the runner packs them
        assert moe.pack_experts(8) == 16
        path = "loop"
    monkeypatch.setattr(FusedMoE, "path", path)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(4))
    ids = moe.routing(moe.gate(x))[1]
    assert not set(ids.flatten().tolist()) & {1, 4, 6} and len(set(ids.flatten().tolist())) == 5
    ref = _per_token_reference(x, w, 2, act, renormalize=not bias)
    torch.testing.assert_close(moe(x).double(), ref, rtol=1e-5, atol=1e-5)
    assert moe(x[:0]).shape == (0, 16)  # an empty batch


@dataclass(frozen=True)
class _NoReduce(TPGroup):
    """A rank of a group whose all-reduce is left to the test (the sum of the ranks)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_tensor_parallel_ranks_sum_to_the_whole_layer() -> None:
    """Each rank keeps its columns of every expert (uneven: 23 = 11 + 12);
    the down bias is added by one rank only."""
    w = _full_weights(8, 16, 23, True, seed=5)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(6))
    whole = _build(w, 2, True, _clamped_swiglu)(x)
    ranks = [_build(w, 2, True, _clamped_swiglu, _NoReduce(r, 2)) for r in range(2)]
    assert [m.w13.weight.shape[1] for m in ranks] == [22, 24] and [m.w2.weight.shape[2] for m in ranks] == [11, 12]
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole, rtol=1e-5, atol=1e-5)


def test_gpt_oss_layout_transposed_and_interleaved() -> None:
    """[E, H, 2I] with gate/up alternating (gpt-oss) lands as gate rows then up rows."""
    w = _full_weights(4, 8, 6, True, seed=7)
    gate, up = w["gate_up"].chunk(2, dim=1)  # [E, I, H] each
    interleaved = torch.stack([gate, up], dim=2).reshape(4, 12, 8)  # rows g0 u0 g1 u1 ...
    moe = FusedMoE(4, 2, 8, 6)
    for name, t in (("experts.gate_up_proj", interleaved.transpose(1, 2)), ("experts.down_proj", w["down"].transpose(1, 2))):
        for param, part, shard in expert_entries(name, t, transposed=True, interleaved=True):  # type: ignore[union-attr]
            module, attr = param.split(".")
            getattr(moe, module).load_shard(attr, part, shard)
    assert torch.equal(moe.w13.weight, w["gate_up"]) and torch.equal(moe.w2.weight, w["down"])
    assert expert_entries("gate.weight", w["gate.weight"]) is None  # the router is an ordinary parameter


def test_one_gemm_per_active_expert_not_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counting the expert GEMMs: two per active expert (gate/up, down),
    whatever the number of tokens; a loop over tokens would make 2 k T."""
    calls: list[int] = []
    real = moe_layer._expert_mm

    def counted(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *packed: object) -> None:
        calls.append(a.shape[0])
        real(a, w, out, *packed)

    monkeypatch.setattr(moe_layer, "_expert_mm", counted)
    moe = _build(_full_weights(8, 16, 24, False, seed=8), 2, False, _silu_mul)
    for n in (1, 64):
        calls.clear()
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
        moe(x)
        active = len(set(moe.routing(moe.gate(x))[1].flatten().tolist()))
        assert len(calls) == 2 * active and sum(calls) == 2 * 2 * n
    assert active == 8 and len(calls) == 16  # 64 tokens, 128 (token, expert) pairs: 16 GEMMs


def test_unsupported_activation_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "mixtral", seed=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu'"):
        ModelRunner(EngineConfig(model=folder, num_gpu_blocks=8)).init()
