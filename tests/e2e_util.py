"""Starting the real four processes with `pagedserve serve` for end-to-end tests."""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.client import GenerationClient

_SERVING = re.compile(r"serving .* on (\S+) \(pids (.*)\)")
DRAIN_PATIENCE_S = 6.0  # the frontend stops in 1-3 s on a busy 2-core machine when nothing is in flight


def venv_tool(name: str) -> str | None:
    """An executable installed beside this Python (the venv's bin), else on PATH."""
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else shutil.which(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[str]
    addr: str  # gRPC host:port
    pids: dict[str, int]
    log: list[str] = field(default_factory=list)
    http: str = ""  # the OpenAI API's base URL, http://host:port

    def client(self) -> GenerationClient:
        return GenerationClient(self.addr)


def wait_all_free(server: Server, timeout_s: float = 20.0) -> Any:
    """Waits until nothing runs or waits and every KV block is free; returns ServerInfo."""
    with server.client() as c:
        deadline = time.monotonic() + timeout_s
        while True:
            info = c.server_info()
            if (info.num_free_gpu_blocks == info.num_gpu_blocks and info.num_running == 0
                    and info.num_waiting == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert info.num_running == 0 and info.num_waiting == 0 and info.num_swapped == 0, info
    assert info.num_free_gpu_blocks == info.num_gpu_blocks, info
    return info


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@contextmanager
def serve(*args: str, timeout_s: float = 300.0, env: dict[str, str] | None = None,
          session: bool = False) -> Iterator[Server]:
    """Runs `pagedserve serve ARGS`, yields once it prints its address, then
    stops it with SIGINT (as Ctrl-C does) and checks nothing is left behind.
    gRPC and HTTP get free ports (HTTP: PAGEDSERVE_HTTP_PORT from ``env`` if given).
    ``session``: the launcher leads its own process group, so a test can send
    a terminal's Ctrl-C to the whole group (``os.killpg(server.proc.pid, ...)``).
    A stream still open at the end would hold the stop for the drain
    (``--shutdown-timeout``, 30 s): after a moment a second Ctrl-C ends it."""
    port = free_port()
    http_port = int((env or {}).get("PAGEDSERVE_HTTP_PORT") or free_port())
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--grpc-port", str(port), "--port", str(http_port), *args]
    wall0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}, start_new_session=session)
    log: list[str] = []
    found: dict[str, str] = {}
    ready = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            m = _SERVING.search(line)
            if m:
                found["addr"], found["pids"] = m.group(1), m.group(2)
                ready.set()
        ready.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    if not ready.wait(timeout_s) or "addr" not in found:
        proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(log[-60:]))
    pids = {k: int(v) for k, v in (p.split("=") for p in found["pids"].split(", "))}
    scheme = "https" if (env or {}).get("PAGEDSERVE_TLS_CERT") else "http"
    server = Server(proc, found["addr"], pids, log, f"{scheme}://127.0.0.1:{http_port}")
    try:
        yield server
    finally:
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + DRAIN_PATIENCE_S
        while _pid_alive(pids["frontend"]) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_alive(pids["frontend"]) and proc.poll() is None:
            print(f"e2e_util.serve: the frontend still drains after {DRAIN_PATIENCE_S:g}s (a stream left "
                  "open?): a second Ctrl-C", file=sys.stderr)
            proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        t.join(5)
        deadline = time.monotonic() + 10
        while any(_pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [n for n, p in pids.items() if _pid_alive(p)]
        assert not left, f"processes left behind after Ctrl-C: {left}"
        stale = [d for d in glob.glob(os.path.join(tempfile.gettempdir(), f"pagedserve-run-{proc.pid}-*"))
                 if os.path.getmtime(d) >= wall0 - 1]  # an older one is a reused pid's
        assert not stale, f"ipc run directories left behind: {stale}"
        assert rc == 0, "serve exited with %d:\n%s" % (rc, "".join(log[-40:]))
