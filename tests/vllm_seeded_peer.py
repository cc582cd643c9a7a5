"""Run by the peer venv's Python (vLLM 0.32 CPU build): vLLM's own seeded CPU
sampling over logits read from a file; prints the sampled ids as JSON
(tests/test_seeded_sampling.py).

argv: a file of float32 logits [jobs, steps, rows, vocab] (raw bytes), then a JSON
{"shape": [jobs, steps, rows, vocab], "seeds": [seed or null per row],
 "jobs": [{"temperatures": [...], "top_k": [...], "top_p": [...], "min_p": [...]}, ...]}.
Per row a ``torch.Generator("cpu").manual_seed(seed)`` as vLLM's model runner
makes it; per step vLLM's Sampler order on the CPU: temperature, min-p (the
MinPLogitsProcessor's arithmetic), vLLM's ``apply_top_k_top_p``, then the draw
and the kernel exactly as ``TopKTopPSampler.forward_cpu`` runs them (the test
pins those source lines). stdout: ids [jobs][steps][rows]."""
from __future__ import annotations

import importlib
import json
import sys

import torch

importlib.import_module("vllm._C")  # registers torch.ops._C.fused_gumbel_argmax


def job(logits: torch.Tensor, seeds: list[int | None], spec: dict) -> list[list[int]]:
    steps, rows, vocab = logits.shape
    gens: dict[int, torch.Generator] = {}
    for i, seed in enumerate(seeds):
        if seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            gens[i] = gen
    temps = torch.tensor(spec["temperatures"], dtype=torch.float32)
    top_k, top_p, min_p = spec.get("top_k"), spec.get("top_p"), spec.get("min_p")
    k = None if not top_k or all(x in (0, -1) for x in top_k) else torch.tensor(
        [x if 0 < x < vocab else vocab for x in top_k], dtype=torch.int32)
    p = None if not top_p or all(x >= 1.0 for x in top_p) else torch.tensor(top_p, dtype=torch.float32)
    mp = None if not min_p or not any(min_p) else torch.tensor(min_p, dtype=torch.float32).unsqueeze_(1)
    if k is not None or p is not None:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    out = []
    for s in range(steps):
        x = logits[s].clone().div_(temps.unsqueeze(dim=1))  # Sampler.apply_temperature
        if mp is not None:  # MinPLogitsProcessor.apply
            probability_values = torch.nn.functional.softmax(x, dim=-1)
            max_probabilities = torch.amax(probability_values, dim=-1, keepdim=True)
            adjusted_min_p = max_probabilities.mul_(mp)
            x.masked_fill_(probability_values < adjusted_min_p, -float("inf"))
        if k is not None or p is not None:
            x = apply_top_k_top_p(x, None if k is None else k.clone(), p)
        draws = torch.randint(0, 2**31, (rows,), dtype=torch.long)
        for i, gen in gens.items():
            draws[i] = torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long).item()
        out.append(torch.ops._C.fused_gumbel_argmax(x.to(dtype=torch.float32), draws).tolist())
    return out


def main() -> None:
    spec = json.loads(sys.argv[2])
    jobs, steps, rows, vocab = spec["shape"]
    with open(sys.argv[1], "rb") as f:
        logits = torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(jobs, steps, rows, vocab)
    json.dump([job(logits[j], spec["seeds"], spec["jobs"][j]) for j in range(jobs)], sys.stdout)


if __name__ == "__main__":
    main()
