"""Run by the peer venv's Python (vLLM 0.32 CPU build): vLLM's own seeded CPU
sampling over logits read from a file; prints the sampled ids as JSON
(tests/test_seeded_sampling.py).

argv: a file of float32 logits [steps, rows, vocab] (raw bytes), then a JSON
{"shape": [steps, rows, vocab], "seeds": [seed or null per row], "temperatures": [...]}.
Per row a ``torch.Generator("cpu").manual_seed(seed)`` as vLLM's model runner
makes it; per step the draw and the kernel exactly as
``TopKTopPSampler.forward_cpu`` runs them (the test pins that source text)."""
from __future__ import annotations

import importlib
import json
import sys

import torch

importlib.import_module("vllm._C")  # registers torch.ops._C.fused_gumbel_argmax


def main() -> None:
    spec = json.loads(sys.argv[2])
    steps, rows, vocab = spec["shape"]
    with open(sys.argv[1], "rb") as f:
        logits = torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(steps, rows, vocab)
    gens: dict[int, torch.Generator] = {}
    for i, seed in enumerate(spec["seeds"]):
        if seed is not None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            gens[i] = gen
    temps = torch.tensor(spec["temperatures"], dtype=torch.float32)
    out = []
    for s in range(steps):
        x = logits[s].clone().div_(temps.unsqueeze(dim=1))  # Sampler.apply_temperature
        seeds = torch.randint(0, 2**31, (rows,), dtype=torch.long)
        for i, gen in gens.items():
            seeds[i] = torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long).item()
        out.append(torch.ops._C.fused_gumbel_argmax(x.to(dtype=torch.float32), seeds).tolist())
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
