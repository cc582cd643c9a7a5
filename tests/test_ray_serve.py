"""Issue 22, acceptance 2: pagedserve replicas on Ray Serve, routed by where
the KV cache is. Opt-in (PAGEDSERVE_RAY_TESTS=1; about 3 minutes): it runs
`python -m benchmarks ray-affinity` in the Ray venv (scripts/setup-ray.sh, or an
interpreter with ray installed): 3 replicas of the SIMULATED worker in real
time on a 3-node local Ray cluster, 30 users with growing conversations, the
KV-affinity router against round-robin, then a replica killed mid-run."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY_PY = Path(os.environ.get("PAGEDSERVE_RAY_VENV", ROOT / ".venv-ray")) / "bin" / "python"


def _python() -> str:
    if os.environ.get("PAGEDSERVE_RAY_TESTS") != "1":
        pytest.skip("Ray Serve tests are opt-in: PAGEDSERVE_RAY_TESTS=1 (about 3 minutes)")
    if importlib.util.find_spec("ray") is not None:
        return sys.executable
    if RAY_PY.exists():
        return str(RAY_PY)
    pytest.skip(f"Ray Serve is not installed here nor in {RAY_PY}: scripts/setup-ray.sh")


def test_kv_affinity_beats_round_robin_and_a_killed_replica_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ray.json"
    r = subprocess.run([_python(), "-m", "benchmarks", "ray-affinity", "--users", "30", "--turns", "4",
                        "--kill", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    runs = {x["router"]: x for x in res["runs"]}
    rr, kv, killed = runs["round-robin"], runs["kv"], runs["kv-kill"]
    for run in (rr, kv, killed):
        assert run["lost"] == [] and run["requests"] == 30 * 4, run
    assert kv["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert kv["ttft_p50_s"] < rr["ttft_p50_s"] and kv["ttft_p99_s"] < rr["ttft_p99_s"]
    assert kv["throughput_tok_s"] > rr["throughput_tok_s"]
    assert killed["resumed_requests"] > 0, "the kill hit requests in flight, which finished elsewhere"
    assert killed["replica_replaced"], "Serve's controller started a replica in the killed one's place"


def test_ingress_refuses_what_the_engine_refuses_and_keeps_serving(tmp_path: Path) -> None:
    """A prompt past max-model-len is a 400 from the engine, streaming or not (not a 500 or a 200
    stream with an error); the ingress's own bounds are 400s; the replica serves on."""
    r = subprocess.run([_python(), str(ROOT / "tests" / "ray_refusals.py")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RAY_REFUSALS "))
    assert json.loads(line.split(" ", 1)[1]) == {"ok": 200, "ok_stream": 200, "too_long": 400,
                                                 "too_long_stream": 400, "max_tokens_0": 400, "bad_ids": 400,
                                                 "after": 200}
