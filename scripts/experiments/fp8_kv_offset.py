"""Does subtracting a per-channel K (and V) offset before fp8 rounding bring
fp8 KV greedy tokens close to an fp32 KV pool's? (issue 23, acceptance 4)

Softmax ignores a shift that is the same for every key, so q.(k - b) attends
exactly as q.k; and sum_j p_j (v_j - c) + c = sum_j p_j v_j. So an offset per
layer, KV head and channel, subtracted before the cache write (and c added back
to the output), changes nothing in exact arithmetic and leaves less magnitude
for e4m3's 3 mantissa bits. The offsets are the mean post-RoPE K and mean V of
an unrelated calibration text. Torch path (the fused CPU write is switched off
so that the subtraction can sit before it), the same 64 requests x 16 greedy
tokens as ``pagedserve bench kv_fp8``.

    .venv/bin/python scripts/experiments/fp8_kv_offset.py
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer

from pagedserve.bench import kv_fp8
from pagedserve.common.default_model import resolve_model
from pagedserve.gpuworker import layers
from pagedserve.kernels import cpu_ops

CALIBRATION = ("The history of computing is long. Early machines used vacuum tubes, then transistors; today a phone "
               "holds billions of them. Write a short story about a lighthouse keeper, then list five facts about "
               "rivers, and explain why the sky is blue. ") * 3

layer_index: dict[int, int] = {}  # module id -> layer, reset per runner (layers run in order)
sums: dict[int, list[Any]] = {}
offsets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
mode = {"collect": False, "k": False, "v": False}
plain_forward = layers.PagedAttention.forward


def forward(self: layers.PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any,
            meta: Any) -> torch.Tensor:
    i = layer_index.setdefault(id(self), len(layer_index))
    if mode["collect"]:
        s = sums.setdefault(i, [0.0, 0.0, 0])
        s[0] = s[0] + k.double().sum(0)
        s[1] = s[1] + v.double().sum(0)
        s[2] += k.shape[0]
    if mode["k"]:
        k = k - offsets[i][0].to(k.dtype)
    if not mode["v"]:
        return plain_forward(self, q, k, v, kv_cache, meta)
    c = offsets[i][1].to(v.dtype)
    out = plain_forward(self, q, k, v - c, kv_cache, meta)
    return out + c.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0).flatten()


def run(kind: str, batch: list[list[int]], tokens: int) -> list[tuple[list[int], list[float]]]:
    layer_index.clear()
    return kv_fp8.greedy(kind, batch, tokens)


def main() -> None:
    cpu_ops.rope_and_cache = lambda *a, **k: False  # type: ignore[assignment]
    layers.PagedAttention.forward = forward  # type: ignore[method-assign]
    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    calib = [list(tok.apply_chat_template([{"role": "user", "content": CALIBRATION}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"])]
    batch = kv_fp8.prompts(64)
    with torch.inference_mode():
        base = run("auto", batch, 16)
        mode["collect"] = True
        run("auto", calib, 64)
        mode["collect"] = False
        for i, (ks, vs, n) in sums.items():
            offsets[i] = ((ks / n).float(), (vs / n).float())
        for k_on, v_on in ((False, False), (True, False), (False, True), (True, True)):
            mode["k"], mode["v"] = k_on, v_on
            label = f"K offset {'on' if k_on else 'off'}, V offset {'on' if v_on else 'off'}"
            control = kv_fp8.compare(base, run("auto", batch, 16))
            r = kv_fp8.compare(base, run("fp8", batch, 16))
            print(f"{label}: fp8 e4m3 {r['identical_count']}/64 identical, mean |dlogprob| "
                  f"{r['mean_abs_dlogprob']:.3f}, max {r['max_abs_dlogprob']:.2f}; fp32 control "
                  f"{control['identical_count']}/64", flush=True)


if __name__ == "__main__":
    main()
