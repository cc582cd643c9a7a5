"""Issue 42, acceptance 2 and 3: pagedserve replicas on Ray Serve, routed by
where the KV cache is. Opt-in (PAGEDSERVE_RAY_TESTS=1; tens of minutes on a
2-core machine): benchmarks/ray_multiturn.py with the embedded model, 3 replicas
on a 3-node local Ray cluster, users with distinct system prompts and growing
conversations, the KV-affinity router against round-robin, then a replica
killed mid-run. And the engine's refusals through the ingress."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ray_util import ROOT, ray_python, run_script


def test_kv_affinity_beats_round_robin_and_a_killed_replica_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ray.json"
    rounds = os.environ.get("PAGEDSERVE_RAY_ROUNDS", "1")
    r = subprocess.run([ray_python(), str(ROOT / "benchmarks" / "ray_multiturn.py"), "--rounds", rounds, "--kill",
                        "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=5400,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for run in res["runs"]:
        assert run["lost"] == [] and run["requests"] == 12 * 4, run
    kv, rr = res["median"]["kv"], res["median"]["round-robin"]
    assert kv["prefix_hit_rate"] > rr["prefix_hit_rate"]
    assert kv["ttft_p50_s"] < rr["ttft_p50_s"] and kv["ttft_p99_s"] < rr["ttft_p99_s"]
    assert kv["output_tok_s"] > rr["output_tok_s"]
    assert res["kill"]["lost"] == 0 and res["kill"]["ttft_p50_vs_undisturbed"] <= 2.0, res["kill"]


def test_ingress_refuses_what_the_engine_refuses_and_keeps_serving(tmp_path: Path) -> None:
    """A prompt past max-model-len is the engine's 400, streaming or not (not a 500 or a 200 stream
    with an error), and so are its other bounds; the replica serves on."""
    [codes] = run_script("ray_refusals.py", tmp_path, timeout_s=900)["RAY_REFUSALS"]
    assert codes == {"ok": 200, "ok_stream": 200, "too_long": 400, "too_long_stream": 400, "max_tokens_0": 400,
                     "bad_ids": 400, "after": 200}
