"""A model we cannot serve is refused up front: `pagedserve serve` (and
`pagedserve gpuworker`) print one stderr line naming what is missing and what
is supported, exit 1 within seconds, read no weights and start no component.
The check reads config.json, or a GGUF file's metadata."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from e2e_util import free_port
from models import make_tiny_model

PAGEDSERVE = str(Path(sys.executable).with_name("pagedserve"))
QUICK_S = 45.0  # torch's import alone takes 2-5 s on the busy 2-core test machine; a start takes minutes


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


def variant(src: str, dst: Path, **config: object) -> str:
    """A copy of ``src`` with config.json fields changed, and weights that are
    not safetensors at all: reading them would fail differently."""
    shutil.copytree(src, dst)
    path = dst / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    (dst / "model.safetensors").write_bytes(b"not weights")
    return str(dst)


def session_processes(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the command under test leads it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: the session; [0]: the state
                found.append(int(entry))
    return found


def run_refused(*argv: str) -> str:
    """Runs the real command; asserts the refusal's shape and returns its one line."""
    cmd = [PAGEDSERVE, *argv]
    if argv[0] == "serve":
        cmd += ["--port", str(free_port()), "--grpc-port", str(free_port())]
    t0, wall0 = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    left = session_processes(proc.pid)
    for pid in left:  # never leave them running, even when the test fails
        os.kill(pid, 9)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 1, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert out == ""
    assert elapsed < QUICK_S, f"{elapsed:.1f} s"
    assert not left, f"processes left behind: {left}"
    # made by this command: a folder of an earlier process with the same (reused) pid is older
    made = [d for d in Path(tempfile.gettempdir()).glob(f"pagedserve-run-{proc.pid}-*")
            if d.stat().st_mtime >= wall0 - 1]
    assert not made, f"a run directory was made: {made}"
    return lines[0]


def test_unknown_architecture_is_refused(llama_dir: str, tmp_path: Path) -> None:
    model = variant(llama_dir, tmp_path / "foo", architectures=["FooForCausalLM"], model_type="llama")
    line = run_refused("serve", model)
    assert line.startswith("pagedserve serve: error:")
    assert "FooForCausalLM" in line and "unsupported architecture" in line
    assert "LlamaForCausalLM" in line and "Qwen3ForCausalLM" in line  # what is supported


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "compressed-tensors"])
def test_quantized_checkpoint_is_refused(llama_dir: str, tmp_path: Path, method: str) -> None:
    quant = {"quant_method": method, "bits": 4, "group_size": 128}
    model = variant(llama_dir, tmp_path / method, quantization_config=quant)
    line = run_refused("serve", "--model", model)
    assert "quantization_config" in line and repr(method) in line and "not supported" in line
    assert "unquantized" in line and "GGUF" in line  # what is supported


def test_standalone_gpuworker_refuses_too(llama_dir: str, tmp_path: Path) -> None:
    """Before binding its socket, loading, or starting tensor-parallel ranks."""
    model = variant(llama_dir, tmp_path / "foo", architectures=["FooForCausalLM"])
    line = run_refused("gpuworker", "--model", model, "--tensor-parallel-size", "2",
                       "--worker-addr", f"ipc://{tmp_path}/w.sock")
    assert line.startswith("pagedserve gpuworker: error:") and "FooForCausalLM" in line
    assert not (tmp_path / "w.sock").exists()


def test_gguf_of_an_architecture_transformers_cannot_read(llama_dir: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from test_gguf_serve import write_llama_gguf

    path = write_llama_gguf(llama_dir, tmp_path / "odd.gguf", arch="foollama")
    env_cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(env_cache))  # inherited by the command
    line = run_refused("serve", str(path), "--quantization", "gguf")
    assert "foollama" in line and "transformers cannot read" in line and "llama" in line and "gemma3" in line
    assert not env_cache.exists(), "nothing was converted"


def test_servable_models_pass_the_check(llama_dir: str) -> None:
    from pagedserve.common.model_check import check_servable

    check_servable(llama_dir)
    check_servable(None)  # the embedded default
    check_servable("/no/such/folder")  # left to resolve_model, which says it is not there
