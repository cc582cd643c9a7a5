"""The compiled decoder stack (gpuworker/cpu_fused.py, kernels/cpu_model.cpp) over GGUF
blocks (issue 40): a model served from its quantized file runs the whole stack in one
call, its linears by the int8 kernels (quant_cpu.cpp), with the same logits and the same
K/V pool bit for bit as layer by layer; weights of different types side by side in one
linear (q/k/v of Q4_K_M) included; and layer by layer wherever a linear is not packed.
tests/test_quant_serve.py holds the quantized worker to the dequantized file."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from models import make_tiny_model
from test_cpu_fused import _run
from test_gguf_serve import write_llama_gguf
from test_quant_kernels import make_weight
from test_quant_serve import TINY, runner

from pagedserve.gpuworker import cpu_fused
from pagedserve.gpuworker.cpu_fused import FusedStack
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.kernels.quant import QuantWeight, prepare

def _pair(path: str, dtype: str, edit: Callable[[torch.nn.Module], None] | None = None) -> tuple[ModelRunner, ModelRunner]:
    """Two runners on the file (``_same`` runs the second layer by layer); ``edit(model)`` applied to both."""
    out = []
    for _ in range(2):
        r = runner(path, blocks=64, dtype=dtype)
        if edit is not None:
            edit(r.model)
        out.append(r)
    return out[0], out[1]


def _same(fused: ModelRunner, per_layer: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    toks_f, logits_f = _run(fused)
    assert fused.model.fused is not None  # the stack ran, not a silent fallback
    monkeypatch.setenv("PAGEDSERVE_" + cpu_fused.ENV, "0")
    toks_p, logits_p = _run(per_layer)
    assert per_layer.model.fused is None
    assert toks_f == toks_p
    assert logits_f.keys() == logits_p.keys()
    for key in logits_f:
        assert torch.equal(logits_f[key], logits_p[key]), key
    for (kf, vf), (kp, vp) in zip(fused.cache.gpu, per_layer.cache.gpu):
        assert torch.equal(kf.view(torch.uint8), kp.view(torch.uint8))
        assert torch.equal(vf.view(torch.uint8), vp.view(torch.uint8))


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0", "Q4_1"])
def tiny_quant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(f"tiny-{request.param}")
    folder = make_tiny_model(root / "hf", "llama", seed=3, **TINY)
    return write_llama_gguf(folder, root / f"tiny-{request.param}.gguf", qtype=request.param)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_stack_equals_layer_by_layer(tiny_quant: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fused, per_layer = _pair(str(tiny_quant), dtype)
    qkv = fused.model.layers[0].self_attn.qkv_proj
    assert qkv.qweights and qkv.qweights[0].packed is not None and qkv.packed is None  # blocks, not panels
    _same(fused, per_layer, monkeypatch)


# Hidden and intermediate of 256, so the K types' superblocks fit; 4 query / 2 KV heads of 64.
WIDE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=256)


def _mix(model: torch.nn.Module) -> None:
    """q/k in Q4_K and v in Q6_K (as Q4_K_M has them), gate in Q8_0 and up in Q4_K; random valid
    blocks, seeded, so both runners get the same weights."""
    for i, layer in enumerate(model.layers):
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        q_rows, v_rows = 256 + 128, 128
        qkv.qweights = [prepare(make_weight("Q4_K", q_rows, 256, seed=i)), prepare(make_weight("Q6_K", v_rows, 256, seed=50 + i))]
        gate_up.qweights = [prepare(make_weight("Q8_0", 256, 256, seed=100 + i)),
                            prepare(make_weight("Q4_K", 256, 256, seed=150 + i))]
        for m in (qkv, gate_up):
            m.qparts = None


def test_parts_of_different_types_run_in_the_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny_model(tmp_path / "hf", "llama", seed=4, **WIDE)
    path = str(write_llama_gguf(folder, tmp_path / "wide-q8.gguf", qtype="Q8_0"))
    fused, per_layer = _pair(path, "bfloat16", _mix)
    built = FusedStack.build(fused.model, fused.cache.gpu)
    assert built is not None and built.layers[0].qkv.parts == 2 and built.layers[0].gate_up.parts == 2
    assert list(built.layers[0].qkv.qtypes)[:2] == [12, 14]  # ggml's Q4_K, Q6_K
    _same(fused, per_layer, monkeypatch)


def test_a_linear_without_packed_blocks_runs_layer_by_layer(tiny_quant: Path) -> None:
    r = runner(str(tiny_quant), blocks=64)
    model, pools = r.model, r.cache.gpu
    assert FusedStack.build(model, pools) is not None
    down = model.layers[1].mlp.down_proj
    w = down.qweights[0]
    down.qweights = [QuantWeight(w.blocks(), w.qtype, w.shape)]  # not repacked: dequantized per call
    assert FusedStack.build(model, pools) is None
    down.qweights = [w]
    qkv = model.layers[0].self_attn.qkv_proj
    q = qkv.qweights[0]
    qkv.qweights = [q.split_rows(0, 16), q.split_rows(16, 32), q.split_rows(32, 48), q.split_rows(48, q.shape[0])]
    for part in qkv.qweights:
        prepare(part)
    assert FusedStack.build(model, pools) is None  # four parts: more than the stack's Linear holds


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_embedded_q4_1_stack_equals_layer_by_layer(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real file (SmolLM2-135M Q4_1, its embedding and head Q4_1 too): fused against layer by layer."""
    from pagedserve.common.default_model import gguf_path

    fused, per_layer = _pair(str(gguf_path()), dtype)
    assert fused.model.layers[0].mlp.down_proj.qweights
    _same(fused, per_layer, monkeypatch)
