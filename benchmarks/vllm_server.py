"""``vllm serve`` from ``.venv-peers`` as a peer OpenAI-compatible server for
``bench serving --peer vllm``: started on a free loopback port with the CPU
settings of ``peer_engines.vllm_cpu_env``, ready once ``/health`` answers 200."""
from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.peer_engines import PEERS_VENV, vllm_cpu_env
from pagedserve.bench.serve_proc import free_port


@dataclass
class VllmServer:
    proc: subprocess.Popen[str]
    url: str
    log: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start_vllm_serve(model_dir: str, served_name: str, max_model_len: int, max_num_seqs: int,
                     python: Path = PEERS_VENV / "bin" / "python", timeout_s: float = 900.0,
                     extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
                     own_session: bool = False) -> VllmServer:
    """``own_session``: a new session, as a service manager starts a server."""
    import os

    if not python.is_file():
        raise FileNotFoundError(f"{python} not found: run scripts/setup-peers.sh")
    port = free_port()
    # Not the `vllm serve` script: vllm-cpu's CLI looks up the version of a
    # distribution named "vllm" and exits (PackageNotFoundError). Same server.
    # -I and a neutral cwd: this repository's top-level folders (kernels/, ...)
    # would otherwise shadow vLLM's imports of packages with the same names.
    cmd = [str(python), "-I", "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--served-model-name", served_name,
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--seed", "0", *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **vllm_cpu_env(), **(extra_env or {})}, cwd=tempfile.gettempdir(),
                            start_new_session=own_session)
    srv = VllmServer(proc, f"http://127.0.0.1:{port}")

    def reader() -> None:  # keeps draining, or the server blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            srv.log.append(line)

    threading.Thread(target=reader, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if _healthy(srv.url):
            return srv
        time.sleep(1.0)
    srv.stop()
    sys.stderr.write("".join(srv.log[-40:]))
    raise RuntimeError("vllm serve did not become healthy")
