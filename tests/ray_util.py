"""The Ray Serve tests' shared part: they are opt-in (PAGEDSERVE_RAY_TESTS=1) and
run their script in an interpreter with Ray Serve (this one, or the Ray venv that
scripts/setup-ray.sh makes)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY_PY = Path(os.environ.get("PAGEDSERVE_RAY_VENV", ROOT / ".venv-ray")) / "bin" / "python"


def ray_python() -> str:
    if os.environ.get("PAGEDSERVE_RAY_TESTS") != "1":
        pytest.skip("Ray Serve tests are opt-in: PAGEDSERVE_RAY_TESTS=1 (minutes each)")
    if importlib.util.find_spec("ray") is not None:
        return sys.executable
    if RAY_PY.exists():
        return str(RAY_PY)
    pytest.skip(f"Ray Serve is not installed here nor in {RAY_PY}: scripts/setup-ray.sh")


def run_script(name: str, cwd: Path, timeout_s: float = 1200) -> dict[str, list[Any]]:
    """Runs tests/NAME in the Ray interpreter; its lines 'TAG {json}' by tag."""
    r = subprocess.run([ray_python(), str(ROOT / "tests" / name)], cwd=cwd, capture_output=True, text=True,
                       timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out: dict[str, list[Any]] = {}
    for line in r.stdout.splitlines():
        tag, _, rest = line.partition(" ")
        if tag.isupper() and rest.startswith("{"):
            out.setdefault(tag, []).append(json.loads(rest))
    return out
