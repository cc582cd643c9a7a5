"""Issue 42, acceptance 5: Ctrl-C (SIGINT) or SIGTERM on `pagedserve ray-serve`
stops the application and its engines: the command exits 0, nothing answers on
the ingress's port nor on the engine's, no engine process is left, and no
replica folder (pagedserve-ray-*) is left in TMPDIR. Opt-in
(PAGEDSERVE_RAY_TESTS=1; about a minute per signal)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from e2e_util import free_port
from ray_util import ROOT, ray_python


def _answers(host_port: str) -> bool:
    host, port = host_port.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((host, int(port))) == 0


def _engine_pids(grpc_port: str) -> list[int]:
    """Processes whose command line has this engine's --grpc-port (the launcher and its children)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            args = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--grpc-port" in args and grpc_port.encode() in args:
            out.append(int(d.name))
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_application_its_engines_and_leaves_no_folder(sig: signal.Signals) -> None:
    py = ray_python()
    tmp = tempfile.mkdtemp(prefix="psr", dir="/tmp")  # short: Ray's sockets live under it too
    port = free_port()
    cmd = [py, "-m", "pagedserve", "ray-serve", "--address", "local", "--num-replicas", "1", "--http-port", str(port),
           "--", "--max-model-len", "512", "--num-gpu-blocks", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": tmp,
                                 "RAY_memory_monitor_refresh_ms": "0"})
    log: list[str] = []
    serving = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            if "pagedserve ray-serve: serving at" in line:
                serving.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert serving.wait(600), "".join(log[-40:])
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
            assert json.load(r)["data"][0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        req = urllib.request.Request(url + "/pagedserve/route", data=b'{"prompt": "Hi"}',
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            rep = json.load(r)
        engine_http = rep["http"].removeprefix("http://")
        grpc_port = rep["grpc"].rsplit(":", 1)[1]
        assert _answers(engine_http) and _engine_pids(grpc_port)
        assert list(Path(tmp).glob("pagedserve-ray-*")), "the replica's folder is where the test looks"
        proc.send_signal(sig)
        assert proc.wait(180) == 0, "".join(log[-40:])
        assert "pagedserve ray-serve: stopped" in "".join(log)
        assert not _answers(f"127.0.0.1:{port}"), "the ingress still answers"
        assert not _answers(engine_http), "the engine still answers"
        deadline = time.monotonic() + 10  # the launcher's children exit just after it
        while _engine_pids(grpc_port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _engine_pids(grpc_port) == []
        assert list(Path(tmp).glob("pagedserve-ray-*")) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
