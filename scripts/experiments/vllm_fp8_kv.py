"""vLLM's own fp8 KV cache on the CPU, on the accuracy check of
`pagedserve bench kv_fp8` (docs/benchmarks.md, "fp8 KV cache"): the same 64
chat prompts, 16 greedy tokens each, SmolLM2 fp32, every request in one
batch, each fp8 format against vLLM's unquantized pool ("auto"). Does the
peer meet acceptance 4's 90 % identical where we do not?

Runs inside the peer venv (vLLM spawns processes, hence the guard); the
prompts' token ids come from a JSON file written by this tree's venv:

    .venv/bin/python -c "import json; from pagedserve.bench.kv_fp8 import prompts; \
        json.dump(prompts(64), open('/tmp/fp8-prompts.json', 'w'))"
    .venv-peers/bin/python scripts/experiments/vllm_fp8_kv.py MODEL_DIR /tmp/fp8-prompts.json
"""
from __future__ import annotations

import json
import statistics
import sys


def run(model: str, prompts: list[list[int]], kv_cache_dtype: str) -> list[tuple[list[int], list[float]]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", seed=0, max_model_len=256, max_num_seqs=len(prompts),
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    del llm
    return result


def main(argv: list[str]) -> int:
    model, path = argv
    with open(path) as f:
        prompts = json.load(f)
    ref = run(model, prompts, "auto")
    for dtype in ("fp8", "fp8_e5m2"):
        try:
            got = run(model, prompts, dtype)
        except Exception as e:  # noqa: BLE001 - report what the peer refuses and go on
            print(f"vLLM kv_cache_dtype={dtype}: refused: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        same, deltas = 0, []
        for (rt, rl), (gt, gl) in zip(ref, got):
            same += rt == gt
            for a, b, x, y in zip(rt, gt, rl, gl):
                if a != b:
                    break
                deltas.append(abs(x - y))
        print(f"vLLM kv_cache_dtype={dtype}: identical {same} / {len(prompts)}, |delta logprob| mean "
              f"{statistics.fmean(deltas):.3f} max {max(deltas):.2f} over {len(deltas)} positions", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
