"""Helpers of the container tests (tests/test_container*.py): podman,
podman-compose, gRPC health and HTTP calls; the fixtures that build the image
are in conftest.py, so both modules share one build."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from e2e_util import venv_tool
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
OPT_IN = "PAGEDSERVE_CONTAINER_TESTS"
IMAGE = os.environ.get("PAGEDSERVE_IMAGE", "localhost/pagedserve:latest")
COMPONENTS = ("blockmgr", "gpuworker", "scheduler", "frontend")
BLOCK = 8

# ---------------------------------------------------------------- podman helpers
def _skip_reason() -> str | None:
    if os.environ.get(OPT_IN) != "1":
        return (f"container tests are opt-in: {OPT_IN}=1 (builds the image with podman and starts the "
                "compose services and the Kubernetes manifests; about 5 min)")
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/build-image.sh installs it with apt-get)"
    if os.geteuid() != 0:
        return "the container tests run podman as root (rootless podman is not set up here)"
    return None


def podman(env: dict[str, str], *args: str, check: bool = True, timeout: float = 120) -> str:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def compose_binary() -> str:
    found = venv_tool("podman-compose")
    if found is None:
        pytest.skip("podman-compose is not installed (pip install podman-compose)")
    return found


def grpc_health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        try:
            return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status)
        except grpc.RpcError:
            return -1


def wait_serving(addr: str, timeout_s: float, logs: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while grpc_health(addr) != health_pb2.HealthCheckResponse.SERVING:
        if time.monotonic() > deadline:
            raise AssertionError(f"{addr} not SERVING after {timeout_s:.0f} s\n{logs() if logs else ''}")
        time.sleep(1.0)


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - our own server
        raw = r.read()
        return r.status, (json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode())


# ---------------------------------------------------------------- the image
@dataclass
class Built:
    image: str
    build_s: float
    size_bytes: int
