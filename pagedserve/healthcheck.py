"""``pagedserve healthcheck``: exit 0 when a component is ready, 1 when not.

For container health checks (the image's HEALTHCHECK, compose, Kubernetes exec
probes). Light on purpose: no torch import.

  pagedserve healthcheck                       the component this container runs (PID 1's command line)
  pagedserve healthcheck grpc [HOST:]PORT      gRPC health of the frontend is SERVING
  pagedserve healthcheck http URL              GET URL answers 200 (the gateway's /health, a /metrics)
  pagedserve healthcheck tcp [HOST:]PORT       something listens there
  pagedserve healthcheck ipc PATH              the ipc:// socket file exists

With no arguments it reads the role from ``/proc/1/cmdline`` (``pagedserve ROLE
FLAGS``; the environment is this process's, the same as PID 1's in a container)
and checks what readiness means for it: the frontend's gRPC health is SERVING
(NOT_SERVING while the scheduler recovers or is away); the scheduler's
``/metrics`` answers (served only once the engine is ready) when
``--metrics-port`` is set, else its input socket is bound; the blockmgr's and the
gpuworker's request socket is bound (the worker binds only once its model is
loaded and its KV pool allocated).
"""
from __future__ import annotations

import os
import socket
import sys
import urllib.request

from pagedserve.common.env import env

_FLAG_ADDR = {"blockmgr": ("--blockmgr-addr", "BLOCKMGR", "blockmgr.sock"),
              "gpuworker": ("--worker-addr", "WORKER", "worker.sock"),
              "scheduler": ("--scheduler-in", "SCHEDULER_IN", "scheduler_in.sock")}


def _hostport(target: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return (host.strip("[]") or default_host), int(port)


def check_grpc(target: str, timeout: float = 3.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host, port = _hostport(target)
    with grpc.insecure_channel(f"{host}:{port}") as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as e:
            print(f"grpc {host}:{port}: {e.code().name}", file=sys.stderr)
            return False
    ok = r.status == health_pb2.HealthCheckResponse.SERVING
    if not ok:
        print(f"grpc {host}:{port}: {health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)}", file=sys.stderr)
    return ok


def check_http(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - a local URL we were given
            return bool(r.status == 200)
    except OSError as e:
        print(f"http {url}: {e}", file=sys.stderr)
        return False


def check_tcp(target: str, timeout: float = 2.0) -> bool:
    host, port = _hostport(target)
    try:
        with socket.create_connection((host, port), timeout):
            return True
    except OSError as e:
        print(f"tcp {host}:{port}: {e}", file=sys.stderr)
        return False


def check_zmq_addr(addr: str) -> bool:
    if addr.startswith("tcp://"):
        host, port = _hostport(addr[len("tcp://"):])
        return check_tcp(f"{'127.0.0.1' if host in ('0.0.0.0', '*', '::') else host}:{port}")
    if addr.startswith("ipc://"):
        ok = os.path.exists(addr[len("ipc://"):])
        if not ok:
            print(f"{addr}: no socket", file=sys.stderr)
        return ok
    print(f"cannot check {addr}", file=sys.stderr)
    return False


def _flag(argv: list[str], *names: str) -> str | None:
    for i, a in enumerate(argv):
        for n in names:
            if a == n and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
    return None


def check_role(argv: list[str]) -> bool:
    """Readiness of ``pagedserve ROLE FLAGS`` given as ``argv`` (ROLE first)."""
    role, flags = argv[0], argv[1:]
    if role == "frontend":
        port = _flag(flags, "--grpc-port", "--port") or env("GRPC_PORT", "50051")
        return check_grpc(port)
    if role == "serve":
        port = _flag(flags, "--grpc-port") or env("GRPC_PORT", "50051")
        return check_grpc(port)
    if role in _FLAG_ADDR:
        if role == "scheduler":
            mport = _flag(flags, "--metrics-port") or env("SCHEDULER_METRICS_PORT")
            if mport:
                return check_http(f"http://127.0.0.1:{int(mport)}/metrics")
        flag, name, sock = _FLAG_ADDR[role]
        addr = _flag(flags, flag) or env(name) or f"ipc://{env('RUN_DIR', '')}/{sock}"
        return check_zmq_addr(addr)
    print(f"pagedserve healthcheck: nothing to check for {role!r}", file=sys.stderr)
    return True


def pid1_argv() -> list[str]:
    with open("/proc/1/cmdline", "rb") as f:
        parts = [p.decode() for p in f.read().split(b"\0") if p]
    for i, p in enumerate(parts):  # .../pagedserve ROLE ..., or python -m pagedserve ROLE ...
        if os.path.basename(p) == "pagedserve" and i + 1 < len(parts):
            return parts[i + 1:]
    raise ValueError(f"PID 1 is not pagedserve: {' '.join(parts)[:200]}")


def main(argv: list[str]) -> int:
    try:
        if not argv:
            ok = check_role(pid1_argv())
        elif argv[0] == "grpc" and len(argv) == 2:
            ok = check_grpc(argv[1])
        elif argv[0] == "http" and len(argv) == 2:
            ok = check_http(argv[1])
        elif argv[0] == "tcp" and len(argv) == 2:
            ok = check_tcp(argv[1])
        elif argv[0] == "ipc" and len(argv) == 2:
            ok = check_zmq_addr("ipc://" + argv[1])
        elif argv[0] in ("-h", "--help"):
            print(__doc__)
            return 0
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (OSError, ValueError) as e:
        print(f"pagedserve healthcheck: {e}", file=sys.stderr)
        return 1
    return 0 if ok else 1
