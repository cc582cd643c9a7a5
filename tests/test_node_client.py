"""The Node.js client (clients/node, @grpc/grpc-js + @grpc/proto-loader)
against the real server: its streamed tokens equal the Python client's.
Node and npm are required: this test fails, not skips, without them. It
installs the client's locked dependencies itself (npm ci) when needed."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e_util import Server, serve
from models import make_tiny_model

NODE_DIR = Path(__file__).resolve().parent.parent / "clients" / "node"
PROMPT = "The quick brown fox"


def npm_ready() -> str:
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "node and npm must be installed to test clients/node (Node.js 18+)"
    marker = NODE_DIR / "node_modules" / ".package-lock.json"
    lock = NODE_DIR / "package-lock.json"
    if not marker.exists() or marker.stat().st_mtime < lock.stat().st_mtime:
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=600,
                       capture_output=True)
    return node


@pytest.fixture(scope="module")
def node() -> str:
    return npm_ready()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    with serve("--model", model_dir, "--num-gpu-blocks", "64") as s:
        yield s


def run_node(node: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([node, str(NODE_DIR / "generate.js"), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ})


def streamed(proc: subprocess.CompletedProcess[str]) -> tuple[list[dict[str, object]], dict[str, object]]:
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    return lines[:-1], lines[-1]["summary"]  # type: ignore[return-value]


def test_node_client_streams_the_same_tokens_as_the_python_client(node: str, server: Server) -> None:
    with server.client() as c:
        want_ids, want_text, want_reason = c.generate(PROMPT, max_tokens=16, temperature=0.0)
        seeded = c.generate([5, 6, 7, 8], max_tokens=10, temperature=1.0, seed=2**40 + 3)
        stopped = c.generate(PROMPT, max_tokens=16, temperature=0.0, stop=[want_text[3:6]])
    chunks, summary = streamed(run_node(node, "--addr", server.addr, "--prompt", PROMPT, "--max-tokens", "16",
                                        "--temperature", "0"))
    # It streamed (message boundaries depend on timing: the frontend folds deltas a slow reader missed).
    assert len(chunks) > 1
    assert [t for ch in chunks for t in ch["token_ids"]] == want_ids  # type: ignore[union-attr]
    assert "".join(str(ch["text"]) for ch in chunks) == want_text
    out = summary["outputs"][0]  # type: ignore[index]
    assert out["token_ids"] == want_ids and out["text"] == want_text and out["finish_reason"] == want_reason
    assert summary["usage"]["completion_tokens"] == len(want_ids)  # type: ignore[index]
    # Token-id prompt with a 64-bit seed, and a stop string.
    _, s2 = streamed(run_node(node, "--addr", server.addr, "--prompt-ids", "5,6,7,8", "--max-tokens", "10",
                              "--temperature", "1", "--seed", str(2**40 + 3)))
    assert s2["outputs"][0]["token_ids"] == seeded[0]  # type: ignore[index]
    _, s3 = streamed(run_node(node, "--addr", server.addr, "--prompt", PROMPT, "--max-tokens", "16",
                              "--temperature", "0", "--stop", want_text[3:6]))
    assert s3["outputs"][0]["text"] == stopped[1] and s3["outputs"][0]["finish_reason"] == "stop"  # type: ignore[index]


def test_node_client_reports_invalid_argument(node: str, server: Server) -> None:
    proc = run_node(node, "--addr", server.addr, "--prompt", PROMPT, "--temperature", "-1")
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: 3 ") and "sampling_params.temperature" in proc.stderr
