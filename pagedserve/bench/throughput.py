"""``pagedserve bench throughput``: output tokens/s of the engine (the real four
processes, driven over gRPC with all requests in flight at once) and of
transformers' batched ``generate`` on the same model, prompts and lengths, in
the same run. No target: the honest number and the ratio."""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import subprocess
import sys
import time

import torch

from pagedserve.bench.serve_proc import stop_process
from pagedserve.common.default_model import resolve_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three uses of a paged memory allocator.",
    "Translate 'good morning' into German and Spanish.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Hamlet.",
]


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_engine(model: str | None, prompts: list[list[int]], max_tokens: int, serve_args: list[str]) -> float:
    from pagedserve.client import GenerationClient
    from pagedserve.launcher import wait_healthy

    port = _free_port()
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", str(port), "--port", str(_free_port()),
           *serve_args]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        addr = f"127.0.0.1:{port}"
        if not wait_healthy(addr, 600, lambda: proc.poll() is None):
            raise RuntimeError("the server did not start")

        def one(p: list[int]) -> int:
            with GenerationClient(addr) as c:
                ids, _, _ = c.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=600)
                return len(ids)

        with GenerationClient(addr) as c:  # warm-up
            c.generate(prompts[0], max_tokens=2, temperature=0.0)
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            n = sum(pool.map(one, prompts))
        dt = time.perf_counter() - t0
        assert n == max_tokens * len(prompts)
        return dt
    finally:
        stop_process(proc, 30)


def run_transformers(model_dir: str, prompts: list[list[int]], max_tokens: int, device: str) -> float:
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                  pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False, pad_token_id=pad)
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        dt = time.perf_counter() - t0
    assert out.shape[1] - width == max_tokens
    return dt


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve bench throughput")
    p.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [list(tok(PROMPTS[i % len(PROMPTS)]).input_ids) for i in range(args.num_requests)]
    serve_args = ["--device", args.device]
    if args.num_gpu_blocks:
        serve_args += ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    total = args.num_requests * args.max_tokens
    t_engine = run_engine(args.model, prompts, args.max_tokens, serve_args)
    t_hf = run_transformers(model_dir, prompts, args.max_tokens, args.device)
    engine_tps, hf_tps = total / t_engine, total / t_hf
    name = os.path.basename(model_dir.rstrip("/"))
    print(f"bench throughput on {machine()}: {name}, {args.num_requests} requests x {args.max_tokens} tokens, "
          f"greedy, {args.device}")
    print(f"{'system':<34}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'pagedserve (4 processes, gRPC)':<34}{t_engine:>10.2f}{engine_tps:>12.1f}")
    print(f"{'transformers generate (batched)':<34}{t_hf:>10.2f}{hf_tps:>12.1f}")
    print(f"ratio pagedserve / transformers: {engine_tps / hf_tps:.2f}x")
    print(json.dumps({"bench": "throughput", "machine": machine(), "model": name, "device": args.device,
                      "num_requests": args.num_requests, "max_tokens": args.max_tokens,
                      "engine_tokens_per_s": engine_tps, "transformers_tokens_per_s": hf_tps,
                      "ratio": engine_tps / hf_tps}))
    return 0
