"""The engine a replica runs: ``pagedserve serve`` (its four processes) as a
child of the replica's process, on free ports of the node's address (the
ingress forwards to its HTTP API, and scrapes its /metrics, from any node),
with its KV events published on IPC sockets in a folder of its own. The
engine gets SIGTERM when the replica's process dies (Ray kills it with
SIGKILL), and ``stop`` removes the folder (a killed replica's goes when the
next replica starts on that node: it is named after its process).""" 
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 600.0
KEEP_LINES = 200
PREFIX = "pagedserve-ray-"


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Engine:
    proc: subprocess.Popen[str]
    host: str
    http_port: int
    grpc_port: int
    run_dir: str
    log: list[str] = field(default_factory=list)

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def kv_pub(self) -> str:
        return f"ipc://{self.run_dir}/kv.pub"

    @property
    def kv_replay(self) -> str:
        return f"ipc://{self.run_dir}/kv.replay"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM (the launcher stops its children, the frontend first), then SIGKILL; the folder goes."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def sweep_orphans() -> None:
    """Removes the folders of replicas that were killed (no ``stop``): each is named after its process."""
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        pid = d.name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


def start_engine(model: str | None, serve_args: list[str], host: str,
                 timeout_s: float = START_TIMEOUT_S) -> Engine:
    sweep_orphans()
    run_dir = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    http_port, grpc_port = free_port(host), free_port(host)
    eng = Engine(None, host, http_port, grpc_port, run_dir)  # type: ignore[arg-type]
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": eng.kv_pub, "replay_endpoint": eng.kv_replay})
    # The replica's own flags last (argparse keeps the last), so that SERVE_ARGS cannot move the engine
    # or its KV events away from where the ingress and the router look for them.
    cmd = [sys.executable, "-m", "pagedserve", "serve", *serve_args, "--kv-events-config", events,
           "--host", host, "--port", str(http_port), "--grpc-port", str(grpc_port)]
    if model:
        cmd += ["--model", model]
    try:
        eng.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    ready, serving = threading.Event(), threading.Event()

    def reader() -> None:  # keeps draining, or the engine blocks on a full pipe
        assert eng.proc.stdout is not None
        for line in eng.proc.stdout:
            eng.log.append(line)
            del eng.log[:-KEEP_LINES]
            if "pagedserve: serving" in line:
                serving.set()
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True, name="engine-log").start()
    if not ready.wait(timeout_s) or not serving.is_set() or eng.proc.poll() is not None:
        eng.stop()
        raise RuntimeError("pagedserve serve did not start:\n" + "".join(eng.log[-40:]))
    return eng
