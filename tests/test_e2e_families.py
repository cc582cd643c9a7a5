"""Issue 38, acceptance 1: each of today's families, as a seeded tiny checkpoint
made with transformers' own config class, serves through the real four
processes, and greedy token ids equal transformers' ``generate`` for prompts
shorter and longer than the sliding window (16-24 tokens), with and without
prefix caching, in a pool small enough to force preemption by swap (prefix
caching on) and by recompute (off)."""
from __future__ import annotations

import concurrent.futures
import random

import pytest
import torch
from e2e_util import Server, serve
from models import make_tiny_model

BLOCK = 8
MAX_TOKENS = 24
# family -> make_tiny_model overrides (the ARCHS entry otherwise)
FAMILIES: dict[str, dict[str, object]] = {
    "qwen3": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),  # layer 1 slides
    "gemma3": {},  # 5 sliding layers (16) to 1 full
    "qwen3_moe": {},
    "mixtral": {},  # every layer slides (24)
    "phi3": {},
    "gpt_oss": {},  # sliding (16) and full layers alternate, sinks
    "mistral": dict(sliding_window=16),  # served past its window since the window is masked, not a cap
}
# Extra serve flags (the later --num-gpu-blocks wins): the hybrid KV cache frees what leaves a
# sliding window, so a quarter-sized pool no longer forces preemption for every family by itself:
# prefill chunks of 16 keep more sequences in flight at once (a run of Qwen3's without them once
# preempted nothing); Gemma 3's six groups get the 8 blocks of every layer (48 of one layer) of
# tests/test_e2e_hybrid_kv.py. Mixtral slides on every layer (24 tokens), so its sequences hold 4-6
# blocks each: a quarter of the workload's 64 held three or four at once and preempted only when the
# requests' arrival overlapped enough (a CI run beside other work preempted none); 13 blocks (the longest
# request's 12 and one) hold two or three.
CHUNKS = ["--max-num-batched-tokens", "16"]
FLAGS: dict[str, list[str]] = {"gemma3": ["--num-gpu-blocks", "9", "--max-num-batched-tokens", "32"],
                               "mixtral": ["--num-gpu-blocks", "13", *CHUNKS]}


def workload() -> list[list[int]]:
    """Eight prompts of 5-70 tokens; four share a 40-token prefix, so prefix
    caching hits blocks that lie outside the window of the tokens after them."""
    rng = random.Random(38)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    alone = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 12, 20, 33)]
    return alone + [shared + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 7, 20, 30)]


def expected(folder: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def pool_blocks(prompts: list[list[int]]) -> int:
    """A quarter of what the workload needs at once, and room for its longest sequence."""
    need = [-(-(len(p) + MAX_TOKENS) // BLOCK) for p in prompts]
    return max(max(need) + 1, sum(need) // 4)


def greedy_all(server: Server, prompts: list[list[int]]) -> dict[int, list[int]]:
    """Greedy ids of ``workload()``'s prompts by index: the shared prefix first, and
    one prompt behind it, alone (so that one hits the prefix cache for sure: in a
    small pool the batch's admissions may evict it first), then the rest at once."""

    def one(p: list[int]) -> list[int]:
        with server.client() as c:
            ids, _, reason = c.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=300)
            assert reason == "length"
            return list(ids)

    got = {4: one(prompts[4]), 5: one(prompts[5])}
    rest = [i for i in range(len(prompts)) if i not in got]
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        got.update(zip(rest, pool.map(one, [prompts[i] for i in rest])))
    return got


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_serves_exactly_through_the_four_processes(family: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = make_tiny_model(tmp_path_factory.mktemp(family), family, seed=3, **FAMILIES[family])
    prompts = workload()
    want = expected(folder, prompts)
    blocks = pool_blocks(prompts)
    runs = {"swap, prefix caching": ["--preemption-mode", "swap", "--swap-space", "0.01", "--enable-prefix-caching"],
            "recompute, no prefix caching": ["--preemption-mode", "recompute", "--no-enable-prefix-caching"]}
    for run, flags in runs.items():
        with serve("--model", folder, "--block-size", str(BLOCK), "--num-gpu-blocks", str(blocks + 1),
                   "--max-num-seqs", "16", "--dtype", "float32", *FLAGS.get(family, CHUNKS), *flags) as server:
            got = greedy_all(server, prompts)
            with server.client() as c:
                info = c.server_info()
        print(f"{family}, {run}: {info.num_preemptions} preemptions in {info.num_gpu_blocks} blocks")
        assert [got[i] for i in range(len(prompts))] == want, f"{family}, {run}"
        assert info.num_preemptions > 0, f"{family}, {run}: the pool of {info.num_gpu_blocks} blocks forced no preemption"
        if "prefix caching" in run and "no" not in run:
            assert info.prefix_cache_hits > 0, f"{family}, {run}: no prefix-cache hit"
