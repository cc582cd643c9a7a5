"""``pagedserve serve``: starts the four components locally over ipc:// sockets
in a private run directory, waits until the frontend reports SERVING, prints
the address, and on Ctrl-C / SIGTERM stops every child and removes the
sockets. Children also die with the launcher (PR_SET_PDEATHSIG), so none is
orphaned even if the launcher is killed."""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from pagedserve.common.lifecycle import StopFlag
from pagedserve.common.config import add_engine_args, config_from_args, default_addresses, engine_argv
from pagedserve.common.default_model import resolve_model

COMPONENTS = ("blockmgr", "gpuworker", "scheduler", "frontend")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _health_channel(addr: str) -> Any:  # a grpc.Channel (grpc is imported lazily)
    """Plaintext, or TLS when the frontend will serve TLS (PAGEDSERVE_TLS_CERT,
    which it reads too); the certificate itself, or PAGEDSERVE_TLS_CA, is the root."""
    import grpc

    cert = os.environ.get("PAGEDSERVE_TLS_CERT")
    if not cert:
        return grpc.insecure_channel(addr)
    with open(os.environ.get("PAGEDSERVE_TLS_CA") or cert, "rb") as f:
        return grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=f.read()))


def wait_healthy(addr: str, timeout_s: float, alive: "callable[[], bool]") -> bool:  # type: ignore[valid-type]
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with _health_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline and alive():
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve serve", description="Start all four components locally.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--start-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    cfg = config_from_args(args)
    resolve_model(cfg.model)  # converts the embedded model once, with progress
    run_dir = tempfile.mkdtemp(prefix=f"pagedserve-run-{os.getpid()}-")
    addrs = default_addresses(run_dir)
    # engine_argv carries --model only when one was given: with none, every
    # component resolves the embedded model from the cache converted above.
    common = [*engine_argv(cfg), "--scheduler-in", addrs.scheduler_in,
              "--scheduler-out", addrs.scheduler_out, "--blockmgr-addr", addrs.blockmgr,
              "--worker-addr", addrs.worker]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stopping = StopFlag()
    try:
        for name in COMPONENTS:
            extra = ["--host", args.host, "--port", str(args.port)] if name == "frontend" else []
            procs[name] = subprocess.Popen([sys.executable, "-m", "pagedserve", name, *common, *extra],
                                           env=env, preexec_fn=_die_with_parent)
        addr = f"{args.host}:{args.port}"
        if not wait_healthy(addr, args.start_timeout, lambda: not stopping and all(
                pr.poll() is None for pr in procs.values())):
            if stopping:
                return 0
            dead = [n for n, pr in procs.items() if pr.poll() is not None]
            print(f"pagedserve: failed to start ({', '.join(dead) or 'timeout'})", file=sys.stderr)
            return 1
        print(f"pagedserve: serving {cfg.model or 'SmolLM2-135M-Instruct'} on {addr} "
              f"(pids {', '.join(f'{n}={pr.pid}' for n, pr in procs.items())})", flush=True)
        while not stopping:
            dead = [n for n, pr in procs.items() if pr.poll() is not None]
            if dead:
                print(f"pagedserve: {', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_all(procs)
        shutil.rmtree(run_dir, ignore_errors=True)
        print("pagedserve: stopped", file=sys.stderr, flush=True)


def _stop_all(procs: dict[str, subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    # Frontend first so no new work arrives, then the rest.
    for name in reversed(COMPONENTS):
        pr = procs.get(name)
        if pr is not None and pr.poll() is None:
            pr.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for pr in procs.values():
        try:
            pr.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pr.kill()
            pr.wait()
