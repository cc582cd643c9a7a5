"""`pagedserve bench frontend-cpu` at CI size: the real frontend process fed by
its simulated scheduler streams every token over gRPC and HTTP SSE, each text
equal to tokenizer.decode of its ids; the in-process core and detokenizer modes."""
from __future__ import annotations

import json
import subprocess
import sys

from models import make_tiny_model


def _bench(*args: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "frontend-cpu", "--json", *args],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_frontend_cpu_bench_streams_every_token_with_its_text(tmp_path) -> None:
    model = make_tiny_model(tmp_path, "llama")
    out = _bench("--model", model, "--requests", "4", "--concurrency", "2", "--max-tokens", "24", "--step-ms", "5")
    assert [r["protocol"] for r in out["results"]] == ["grpc", "http"]
    for r in out["results"]:
        assert r["tokens"] == 4 * 24 and r["cpu_s"] > 0
        assert r["texts_as_vllm"] == 4  # the decoded ids up to the last whole character (vLLM's rule, the default)
    core = _bench("--model", model, "--core", "--concurrency", "3", "--max-tokens", "20")["results"][0]
    assert core["tokens"] == 60 and core["texts_as_vllm"] == 3
    detok = _bench("--model", model, "--detokenizer")["results"]
    assert [r["texts_as_vllm"] for r in detok] == [1, 1] and detok[0]["text_sha256"] == detok[1]["text_sha256"]
