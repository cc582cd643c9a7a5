"""The CPU image ships without Triton (docs/deployment.md: 1 GB of it): the CPU
serving path must not import it. The real four processes serve with ``triton``
made unimportable, with greedy tokens equal to transformers', and asking for
the triton backend there is a clear error, not a traceback from deep inside."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_util import serve, wait_all_free
from models import make_tiny_model
from test_e2e import hf_greedy, tokenize

# Loaded at start-up by every process given this PYTHONPATH: the path finder no longer sees triton,
# so it is absent as in the image (find_spec None, import ModuleNotFoundError), not merely broken.
SITECUSTOMIZE = """\
import sys
from importlib.machinery import PathFinder


class _NoTriton(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        return PathFinder.find_spec(name, path, target)


sys.meta_path[:] = [_NoTriton if f is PathFinder else f for f in sys.meta_path]
"""


@pytest.fixture(scope="module")
def no_triton(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    stub = tmp_path_factory.mktemp("no-triton")
    (stub / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # The interpreter flag would make the worker pick the Triton kernels on CPU: the image does not set it.
    return {"PYTHONPATH": path, "TRITON_INTERPRET": ""}


def test_the_stub_hides_triton(no_triton: dict[str, str]) -> None:
    code = "import importlib.util; assert importlib.util.find_spec('triton') is None; import triton"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **no_triton}, timeout=60)
    assert r.returncode == 1 and "ModuleNotFoundError: No module named 'triton'" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, "triton is installed here, so the stub is what hides it"


def test_cpu_serving_runs_without_triton(no_triton: dict[str, str], tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=0)
    prompts = ["The quick brown fox", "Once upon a time"]
    with serve("--model", model, "--num-gpu-blocks", "64", env=no_triton) as server:
        with server.client() as c:
            for p in prompts:
                ids, _, _ = c.generate(p, max_tokens=8, temperature=0.0)
                assert ids == hf_greedy(model, tokenize(model, p), 8), p
        wait_all_free(server)


def test_the_triton_backend_without_triton_is_a_clear_error(no_triton: dict[str, str]) -> None:
    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "from pagedserve.kernels import get_attention_backend, swap_blocks\n"
            "from pagedserve.kernels.backend import TritonMissing\n"
            "assert get_attention_backend('torch', 'cpu').name == 'torch'\n"
            "try:\n    get_attention_backend('triton', 'cpu')\n"
            "except TritonMissing as e:\n    print('refused:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, **no_triton}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused: the triton attention backend needs Triton" in r.stdout, r.stdout
