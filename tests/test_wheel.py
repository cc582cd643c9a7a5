"""Issue 39, acceptance 3: the wheel is the engine without its benchmarks. Built from this
tree (`pip wheel . --no-deps --no-build-isolation`) and installed with pip into a folder of
its own, it holds no peer harness and no benchmarks/: in a fresh interpreter that sees only
that install (not this checkout), `import pagedserve.bench.peers` fails, while
`pagedserve bench throughput` still runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What benchmarks/ holds, once under pagedserve/bench: modules that start or import another engine.
PEER_MODULE = re.compile(r"^pagedserve/bench/(peers|peer_engines|vllm_\w+|guidellm\w*|kv_fp8|ray_\w+)\.py$")
PEER_IMPORT = re.compile(r"^\s*(import|from)\s+(vllm|guidellm|llama_cpp|benchmarks)\b", re.M)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("pagedserve-*.whl")
    return whl


def test_the_wheel_holds_no_peer_harness(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "pagedserve/bench/throughput.py" in names and "pagedserve/cli.py" in names  # the engine is there
    assert "pagedserve/bench/serving.py" in names and "pagedserve/bench/kernel.py" in names
    assert not [n for n in names if n.startswith("benchmarks/") or PEER_MODULE.search(n)]
    with zipfile.ZipFile(wheel) as z:
        importing = [n for n in names if n.endswith(".py") and PEER_IMPORT.search(z.read(n).decode())]
    assert not importing, f"modules of the wheel that import another engine or benchmarks/: {importing}"


_CHILD = r"""
import importlib, sys
target = sys.argv[1]
import pagedserve, pagedserve.bench.throughput
assert pagedserve.__file__.startswith(target), pagedserve.__file__  # the installed copy, not this checkout
for name in ("pagedserve.bench.peers", "pagedserve.bench.vllm_diff", "pagedserve.bench.peer_engines", "benchmarks"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        print("MISSING", name, e.name)
    else:
        print("IMPORTED", name)
"""


def test_installed_wheel_runs_bench_throughput_but_has_no_peers(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # PYTHONPATH puts the install ahead of the editable one of this checkout (a finder at the
    # end of sys.meta_path), and cwd is not the checkout, so benchmarks/ is not on sys.path.
    env = {**os.environ, "PYTHONPATH": str(target)}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(target)], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path, env=env)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert child.stdout.split("\n")[:4] == [
        "MISSING pagedserve.bench.peers pagedserve.bench.peers",
        "MISSING pagedserve.bench.vllm_diff pagedserve.bench.vllm_diff",
        "MISSING pagedserve.bench.peer_engines pagedserve.bench.peer_engines",
        "MISSING benchmarks benchmarks"], child.stdout
    # The console script pip installed, as an operator runs it.
    cmd = [str(target / "bin" / "pagedserve"), "bench"]
    ok = subprocess.run([*cmd, "throughput", "--help"], capture_output=True, text=True, timeout=120,
                        cwd=tmp_path, env=env)
    assert ok.returncode == 0 and "pagedserve bench throughput" in ok.stdout, ok.stdout[-2000:] + ok.stderr[-2000:]
    gone = subprocess.run([*cmd, "peers", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=env)
    assert gone.returncode == 2 and "python -m benchmarks peers" in gone.stderr, gone.stderr[-2000:]
