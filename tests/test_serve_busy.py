"""A second `serve` on busy ports (issue 20, acceptance 5): one error line, exit
status 1, no "serving" line and no child started, whether a plain listener or
a first real serve holds the port; a frontend that loses the race for its port
says so in one line; and "serving" needs our own frontend's answer, checked by
the run's token (another health server on the address never counts)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from e2e_util import free_port, serve
from models import make_tiny_model
from pagedserve.common.config import EXIT_PORT_IN_USE, RUN_HEALTH_PREFIX
from pagedserve.launcher import wait_healthy


@contextmanager
def listener(port: int) -> Iterator[socket.socket]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        yield s


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedserve", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env={k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")})


def _assert_one_line_exit_1(r: subprocess.CompletedProcess[str], port: int, flag: str) -> None:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) == 1, r.stderr
    assert flag in lines[0] and str(port) in lines[0] and "in use" in lines[0], lines[0]
    assert "serving" not in r.stdout + r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


@pytest.mark.parametrize("which", ["http", "grpc"])
def test_a_plain_listener_on_a_port(which: str, model: str) -> None:
    http, grpc_port = free_port(), free_port()
    busy = http if which == "http" else grpc_port
    with listener(busy):
        t0 = time.monotonic()
        r = _serve(model, "--port", str(http), "--grpc-port", str(grpc_port), "--kv-cache-memory", "4MiB")
    _assert_one_line_exit_1(r, busy, "--port" if which == "http" else "--grpc-port")
    assert time.monotonic() - t0 < 30  # before any child loads a model


def test_a_second_serve_on_the_ports_of_a_first(model: str) -> None:
    http = free_port()
    with serve(model, "--kv-cache-memory", "4MiB", env={"PAGEDSERVE_HTTP_PORT": str(http)}) as first:
        grpc_port = int(first.addr.rsplit(":", 1)[1])
        r = _serve(model, "--port", str(http), "--grpc-port", str(grpc_port), "--kv-cache-memory", "4MiB")
        _assert_one_line_exit_1(r, http, "--port")
        r = _serve(model, "--port", str(free_port()), "--grpc-port", str(grpc_port), "--kv-cache-memory", "4MiB")
        _assert_one_line_exit_1(r, grpc_port, "--grpc-port")
        with first.client() as c:  # the first one still serves
            assert c.model_info().max_model_len > 0


def test_a_frontend_that_loses_the_race_for_its_port(model: str, tmp_path: Path) -> None:
    """The frontend checks again right before binding: one line, its own exit status, which serve
    turns into exit 1 without a restart."""
    port = free_port()
    with listener(port):
        r = subprocess.run([sys.executable, "-m", "pagedserve", "frontend", "--model", model, "--port", str(port),
                            "--http-port", str(free_port())], capture_output=True, text=True, timeout=120,
                           env={**{k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")},
                                "PAGEDSERVE_RUN_DIR": str(tmp_path)})
    assert r.returncode == EXIT_PORT_IN_USE, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and "--grpc-port" in errors[0] and str(port) in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_serving_needs_our_frontends_run_token() -> None:
    """A health server that says SERVING for "" (another server on the address) is not ours."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        addr = f"127.0.0.1:{port}"
        assert wait_healthy(addr, 5.0, lambda: True)  # the old check: fooled
        t0 = time.monotonic()
        assert not wait_healthy(addr, 2.0, lambda: True, RUN_HEALTH_PREFIX + "ours")
        assert time.monotonic() - t0 >= 1.9
        servicer.set(RUN_HEALTH_PREFIX + "ours", health_pb2.HealthCheckResponse.SERVING)
        assert wait_healthy(addr, 5.0, lambda: True, RUN_HEALTH_PREFIX + "ours")
    finally:
        server.stop(None)


def test_ctrl_c_is_quiet(model: str) -> None:
    """Ctrl-C after a constrained request (xgrammar loaded in the frontend and the worker): no
    nanobind "leaked" report, no traceback, exit 0 (e2e_util.serve checks the exit and the leftovers)."""
    with serve(model, "--kv-cache-memory", "4MiB") as s:
        import json
        import urllib.request

        body = {"model": model, "prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_object"}}
        req = urllib.request.Request(s.http + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
    log = "".join(s.log)
    assert "leaked" not in log and "Traceback" not in log, log[-3000:]
