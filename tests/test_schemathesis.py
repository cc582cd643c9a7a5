"""Issue 41, acceptance 6, the schema half: ``python -m benchmarks schemathesis``
(benchmarks/schemathesis.py) runs schemathesis, from a tool venv of its own, with vLLM
0.32's OpenAPI schema (tests/data/vllm-openapi-0.32.json) against ``pagedserve serve``
on the routes we serve: zero response-schema violations, zero 5xx, and the probes
(405 Allow, a NUL header answered 400 without a traceback, /tokenize's chat fields,
an integer error code) pass. Opt-in (PAGEDSERVE_SCHEMATHESIS=1: it installs
schemathesis into ~/.cache/pagedserve/tools-venv on first use and takes minutes);
figures in docs/api.md. With the peer venv present, the opt-in also checks the
checked-in schema is what vLLM's ``build_app`` gives (tests/data/vllm-openapi-dump.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks import schemathesis as bst

DATA = Path(__file__).parent / "data"
# The peer venv (scripts/setup-peers.sh; PAGEDSERVE_PEERS_VENV as there, relative to the repository root).
PEERS_PY = (Path(__file__).resolve().parents[1] / os.environ.get("PAGEDSERVE_PEERS_VENV", ".venv-peers")
            / "bin" / "python")
opt_in = pytest.mark.skipif(not os.environ.get("PAGEDSERVE_SCHEMATHESIS"),
                            reason="schemathesis against a real server, minutes (PAGEDSERVE_SCHEMATHESIS=1); "
                                   "figures in docs/api.md")


def test_the_schema_has_every_route_we_serve_and_vllms_error_shape() -> None:
    schema = json.loads(bst.SCHEMA.read_text())
    assert schema["info"]["x-vllm-version"].startswith("0.32")
    assert set(bst.ROUTES) <= set(schema["paths"])
    info = schema["components"]["schemas"]["ErrorInfo"]
    assert info["properties"]["code"]["type"] == "integer" and "code" in info["required"]


@opt_in
@pytest.mark.skipif(not PEERS_PY.exists(), reason="no .venv-peers (scripts/setup-peers.sh)")
def test_the_checked_in_schema_is_vllms(tmp_path: Path) -> None:
    out = subprocess.run([str(PEERS_PY), str(DATA / "vllm-openapi-dump.py")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    assert json.loads(out) == json.loads(bst.SCHEMA.read_text())


@opt_in
def test_schemathesis_with_vllms_schema(tmp_path: Path) -> None:
    out = tmp_path / "st.json"
    bst.main(["--max-examples", os.environ.get("PAGEDSERVE_SCHEMATHESIS_N", "10"), "--out", str(out)])
    res = json.loads(out.read_text())
    print(f"\n{res['requests']} requests, violations {res['violations']}, 5xx {res['five_xx'][:5]}")
    assert res["violations"]["response_schema_conformance"] == 0, res["failures_by_check"]
    assert res["five_xx"] == []
    assert {k: v for k, v in res["probes"].items() if not v["ok"]} == {}
    assert res["verdicts"]["every_route_tested"], res["per_route"]
    assert res["verdicts"]["schemathesis_completed"], res["st_output_tail"]
    assert res["requests"] >= 100
