"""vLLM's own serving benchmark client (`vllm bench serve`, backends
openai-chat and openai) completes against pagedserve's OpenAI API with no
failed request. It needs the peer venv (`scripts/setup-peers.sh`, about 6
minutes and 2 GB), which CI does not build: without it the test is skipped
with that reason, shown in pytest's summary."""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from e2e_util import serve
from models import make_tiny_model
from benchmarks import vllm_bench_client

PEERS_PY = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin" / "python"
NAME = "pagedserve-tiny"

pytestmark = pytest.mark.skipif(not PEERS_PY.exists(), reason="needs the vLLM peer venv: scripts/setup-peers.sh")


@pytest.mark.parametrize("backend,endpoint", [("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")])
def test_vllm_bench_serve_completes_with_no_errors(tmp_path: Path, backend: str, endpoint: str) -> None:
    folder = make_tiny_model(tmp_path, "llama", seed=0)
    with serve("--model", folder, "--served-model-name", NAME, "--block-size", "8", "--num-gpu-blocks", "256") as s:
        cmd = [str(PEERS_PY), "-I", vllm_bench_client.__file__, "--backend", backend, "--base-url", s.http,
               "--endpoint", endpoint, "--model", NAME, "--tokenizer", folder, "--dataset-name", "random",
               "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "12",
               "--request-rate", "inf", "--ignore-eos", "--disable-tqdm"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tempfile.gettempdir())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(vllm_bench_client.TAG)]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len(vllm_bench_client.TAG):])
    assert result["failed"] == 0 and result["completed"] == 12, result
    assert result["total_output_tokens"] == 12 * 8, result
