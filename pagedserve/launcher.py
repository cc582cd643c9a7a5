"""``pagedserve serve``: starts the four components locally over ipc:// sockets
in a private run directory, waits until the frontend reports SERVING, prints
the addresses, restarts a child that dies (with backoff; the others recover
it, see docs/fault-tolerance.md), and on Ctrl-C / SIGTERM stops every child (the frontend first,
draining in-flight requests up to --shutdown-timeout, 30 s; a second Ctrl-C stops at once) and
removes the sockets. Children run in their own session, so a terminal's Ctrl-C reaches only the
launcher (the engine must outlive the drain), and die with it (PR_SET_PDEATHSIG), so none is
orphaned even if the launcher is killed."""
from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from pagedserve.common.config import EXIT_PORT_IN_USE, RUN_HEALTH_PREFIX, bind_error, default_addresses, engine_argv
from pagedserve.common.default_model import is_gguf, resolve_model
from pagedserve.common.env import env as read_env
from pagedserve.common.hub_cache import ModelNotFound
from pagedserve.common.lifecycle import StopFlag, die_with_parent
from pagedserve.common.model_check import engine_refusal
from pagedserve.frontend.openai_api.server_flags import server_flags_argv
from pagedserve.serve_args import ServeArgs, parse_serve_args

COMPONENTS = ("blockmgr", "gpuworker", "scheduler", "frontend")


def _health_channel(addr: str, cert: str | None = None) -> Any:  # a grpc.Channel (grpc is imported lazily)
    """Plaintext, or TLS when the frontend will serve TLS (--ssl-certfile, else
    PAGEDSERVE_TLS_CERT, which it reads too); the certificate itself, or PAGEDSERVE_TLS_CA, is the root."""
    import grpc

    cert = cert or read_env("TLS_CERT")
    if not cert:
        return grpc.insecure_channel(addr)
    with open(read_env("TLS_CA") or cert, "rb") as f:
        return grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=f.read()))


def wait_healthy(addr: str, timeout_s: float, alive: Callable[[], bool], service: str = "",
                 cert: str | None = None) -> bool:
    """Until the frontend at ``addr`` reports SERVING for ``service`` (NOT_FOUND
    from a server that does not know the name: keep waiting)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with _health_channel(addr, cert) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline and alive():
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


def _frontend_args(sa: ServeArgs) -> list[str]:
    out = ["--host", sa.host, "--port", str(sa.grpc_port), "--http-port", str(sa.http_port),
           "--served-model-name", *sa.served_model_names, *sa.frontend_flags,
           *(server_flags_argv(sa.openai) if sa.openai is not None else ())]
    if sa.api_key_file:
        out += ["--api-key-file", sa.api_key_file]
    if sa.tls_cert and sa.tls_key:
        out += ["--tls-cert", sa.tls_cert, "--tls-key", sa.tls_key]
    return out


def ports_taken(sa: ServeArgs) -> str | None:
    """Before any child starts: a port already listened on is one clear line, not a crash loop."""
    for flag, what, port in (("--port", "HTTP", sa.http_port), ("--grpc-port", "gRPC", sa.grpc_port)):
        why = bind_error(sa.host, port)
        if why is not None:
            return f"{flag} {port} ({what}) on {sa.host}: {why} (another server there? pick a free port)"
    return None


def main(argv: list[str]) -> int:
    sa = parse_serve_args(argv)
    if sa.download_dir:  # vLLM's --download-dir: hub ids are looked up there (resolve_model)
        os.environ["HF_HUB_CACHE"] = sa.download_dir
    refused = engine_refusal(sa.cfg, sa.revision)
    if refused:
        print(f"pagedserve serve: error: {refused}", file=sys.stderr, flush=True)
        return 1
    taken = ports_taken(sa)
    if taken:
        print(f"pagedserve serve: error: {taken}", file=sys.stderr, flush=True)
        return 1
    for note in sa.notes:  # the device it serves on, and each vLLM flag that has no effect here (after refusals: one line)
        print(f"pagedserve: {note}", file=sys.stderr, flush=True)
    if sa.cfg.model is not None and is_gguf(sa.cfg.model):
        print(f"pagedserve: {os.path.basename(sa.cfg.model)}: GGUF weights are served as the file's blocks "
              f"(quantized tensors stay quantized; activations in {sa.cfg.torch_dtype_name})", file=sys.stderr, flush=True)
    try:
        # A hub id, a GGUF file or the embedded model becomes a folder here,
        # once (a GGUF file is converted with progress); children get the folder.
        model_dir = resolve_model(sa.cfg.model, sa.revision)
        tokenizer_dir = resolve_model(sa.cfg.tokenizer) if sa.cfg.tokenizer is not None else None
    except ModelNotFound as e:
        print(f"pagedserve serve: error: {e}", file=sys.stderr)
        return 2
    # With no model, children resolve the embedded one from the cache converted
    # above (and name it as before); a given model reaches them as its folder.
    cfg = dataclasses.replace(sa.cfg, model=model_dir) if sa.cfg.model is not None else sa.cfg
    if sa.cfg.model is not None and is_gguf(sa.cfg.model) and cfg.load_format == "auto":
        cfg = dataclasses.replace(cfg, load_format="gguf")  # the folder's worker keeps the file's blocks
    cfg = dataclasses.replace(cfg, tokenizer=tokenizer_dir)
    run_dir = tempfile.mkdtemp(prefix=f"pagedserve-run-{os.getpid()}-")
    addrs = default_addresses(run_dir)
    common = [*engine_argv(cfg), "--scheduler-in", addrs.scheduler_in,
              "--scheduler-out", addrs.scheduler_out, "--blockmgr-addr", addrs.blockmgr,
              "--worker-addr", addrs.worker]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PAGEDSERVE_API_KEY", None)
    token = secrets.token_hex(16)
    # The keys travel in the frontend's environment: a command line is world-readable in ps.
    fe_env = dict(env, PAGEDSERVE_RUN_TOKEN=token, **({"PAGEDSERVE_API_KEY": " ".join(sa.api_keys)}
                                                      if sa.api_keys else {}))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping = StopFlag()  # the first signal drains, a second hurries the drain

    def start(name: str) -> subprocess.Popen[bytes]:
        extra = _frontend_args(sa) if name == "frontend" else []
        # A process group of its own: a terminal's Ctrl-C goes to its foreground process group;
        # the children must not get it, or the engine would stop under the frontend's drain.
        # Not a session of its own: with the kernel's autogroups each session is one scheduling
        # group, and on the 2-core VM a component alone in its group, idle, then woken while a
        # load client spawns its processes, waited up to 0.9 s for a core (docs/benchmarks.md,
        # "guidellm's first request"); in the launcher's session it did not.
        return subprocess.Popen([sys.executable, "-m", "pagedserve", name, *common, *extra],
                                env=fe_env if name == "frontend" else env, preexec_fn=die_with_parent,
                                process_group=0)

    try:
        for name in COMPONENTS:
            procs[name] = start(name)
        addr = f"{sa.host}:{sa.grpc_port}"
        if not wait_healthy(addr, sa.start_timeout, lambda: not stopping and all(
                pr.poll() is None for pr in procs.values()), RUN_HEALTH_PREFIX + token, sa.tls_cert):
            if stopping:
                return 0
            if procs["frontend"].poll() == EXIT_PORT_IN_USE:
                return 1  # the frontend lost a race for a port and said so in one line
            dead = [n for n, pr in procs.items() if pr.poll() is not None]
            print(f"pagedserve: failed to start ({', '.join(dead) or 'timeout'})", file=sys.stderr)
            return 1
        scheme = "https" if sa.tls_cert else "http"
        print(f"pagedserve: serving {sa.served_model_names[0]}: OpenAI API at {scheme}://{sa.host}:{sa.http_port}/v1, "
              f"gRPC on {addr} (pids {', '.join(f'{n}={pr.pid}' for n, pr in procs.items())})", flush=True)
        supervise(procs, start, lambda: bool(stopping))
        return 0
    finally:
        _stop_all(procs, cfg.shutdown_timeout, hurried=lambda: stopping.count > 1)
        shutil.rmtree(run_dir, ignore_errors=True)
        print("pagedserve: stopped", file=sys.stderr, flush=True)


RESTART_BACKOFF_S = (0.2, 10.0)  # first delay, cap; doubles per quick crash
STABLE_S = 30.0  # a child that ran this long restarts with the first delay again


def supervise(procs: dict[str, subprocess.Popen[bytes]], start: Callable[[str], subprocess.Popen[bytes]],
              stopping: Callable[[], bool], poll_s: float = 0.05) -> None:
    """Until ``stopping()``: restarts a child that exited, after a delay that
    doubles while it keeps crashing (as compose's ``restart: unless-stopped``
    would); the survivors re-initialise it and resume their requests."""
    delay = dict.fromkeys(procs, RESTART_BACKOFF_S[0])
    started = dict.fromkeys(procs, time.monotonic())
    due: dict[str, float] = {}
    while not stopping():
        now = time.monotonic()
        for name, pr in procs.items():
            if name not in due and pr.poll() is not None:
                if now - started[name] > STABLE_S:
                    delay[name] = RESTART_BACKOFF_S[0]
                due[name] = now + delay[name]
                print(f"pagedserve: {name} exited ({pr.returncode}); restarting in {delay[name]:.1f}s",
                      file=sys.stderr, flush=True)
                delay[name] = min(RESTART_BACKOFF_S[1], delay[name] * 2)
        for name, at in list(due.items()):
            if now >= at and not stopping():
                del due[name]
                procs[name] = start(name)
                started[name] = time.monotonic()
                print(f"pagedserve: restarted {name} (pid {procs[name].pid})", file=sys.stderr, flush=True)
        time.sleep(poll_s)


def _stop_all(procs: dict[str, subprocess.Popen[bytes]], drain_s: float = 0.0, grace_s: float = 10.0,
              hurried: Callable[[], bool] = lambda: False) -> None:
    # The frontend first, alone: it drains in-flight requests (up to drain_s, or
    # until ``hurried()``: a second Ctrl-C, passed on as a second SIGTERM) while
    # the engine behind it still runs; then the rest.
    for group in (["frontend"], [n for n in reversed(COMPONENTS) if n != "frontend"]):
        live = [procs[n] for n in group if n in procs and procs[n].poll() is None]
        for pr in live:
            pr.send_signal(signal.SIGTERM)
        draining = group == ["frontend"]
        deadline = time.monotonic() + grace_s + (drain_s if draining else 0.0)
        for pr in live:
            while pr.poll() is None and time.monotonic() < deadline:
                if draining and hurried():
                    pr.send_signal(signal.SIGTERM)  # the frontend's second signal: it stops at once
                    draining = False
                    deadline = min(deadline, time.monotonic() + grace_s)
                time.sleep(0.02)
            if pr.poll() is None:
                pr.kill()
                pr.wait()
