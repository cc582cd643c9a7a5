"""Starting ``pagedserve serve`` (and stopping it) for the benchmarks that
drive the real server: its gRPC address and, where this version of the
launcher serves it, the URL of its OpenAI-compatible HTTP API."""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@functools.lru_cache(maxsize=1)
def _has_grpc_port_flag() -> bool:
    # The launcher whose --port is the HTTP API has a separate --grpc-port; an
    # older one had --port for gRPC and no HTTP API.
    out = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    return "--grpc-port" in out.stdout


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 60.0) -> None:
    """SIGINT (as Ctrl-C: a launcher stops its children), then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class ServeProc:
    proc: subprocess.Popen[str]
    grpc_addr: str
    http_url: str | None
    log: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 60.0) -> None:
        stop_process(self.proc, timeout_s)


def start_serve(serve_args: list[str], model: str | None = None, timeout_s: float = 1800.0,
                echo: bool = False, preexec_fn: Callable[[], None] | None = None,
                keep_lines: int | None = None, own_session: bool = False) -> ServeProc:
    """Runs ``pagedserve serve`` on free loopback ports until it prints that it serves.
    ``preexec_fn`` runs in the child before exec; ``keep_lines`` bounds the kept log
    (a long-lived server's, e.g. a Ray Serve replica's); ``own_session``: a new
    session, as a service manager starts a server (see ``benchmarks/guidellm_peers.py``)."""
    grpc_port = free_port()
    if _has_grpc_port_flag():
        http_port = free_port()
        ports = ["--port", str(http_port), "--grpc-port", str(grpc_port)]
        http_url: str | None = f"http://127.0.0.1:{http_port}"
    else:
        ports, http_url = ["--port", str(grpc_port)], None
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--host", "127.0.0.1", *ports, *serve_args]
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=preexec_fn,
                            start_new_session=own_session)
    sp = ServeProc(proc, f"127.0.0.1:{grpc_port}", http_url)
    ready, serving = threading.Event(), threading.Event()  # ready: serving, or the output ended

    def reader() -> None:  # keeps draining, or the server blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            sp.log.append(line)
            if keep_lines is not None:
                del sp.log[:-keep_lines]
            if echo and not ready.is_set():
                sys.stderr.write(line)
            if "pagedserve: serving" in line:
                serving.set()
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    if not ready.wait(timeout_s) or not serving.is_set() or proc.poll() is not None:
        sp.stop()
        raise RuntimeError("pagedserve serve did not start:\n" + "".join(sp.log[-40:]))
    return sp
