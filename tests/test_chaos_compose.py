"""Issue 11, acceptance 2: the components started separately, as compose
runs them; one is killed with SIGKILL mid-stream and started again by hand
(as ``restart: unless-stopped`` would). Every stream finishes without an
error and with exactly the tokens of an undisturbed run; every block is free
afterwards; health is SERVING again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
import pytest
from e2e_util import Server, free_port, wait_all_free
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_chaos import BLOCK, N_REQ, Job, kill_midway, longest_stall, run_streams, setup, wait_for  # noqa: F401

from pagedserve.client import GenerationClient
from pagedserve.common.config import default_addresses

NAMES = ("blockmgr", "gpuworker", "scheduler", "frontend")


@dataclass
class Compose:
    argv: dict[str, list[str]]
    addr: str
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    @property
    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def client(self) -> GenerationClient:
        return GenerationClient(self.addr)

    def start(self, name: str) -> None:
        p = subprocess.Popen([sys.executable, "-m", "pagedserve", name, *self.argv[name]], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                     "PYTHONUNBUFFERED": "1"})
        self.procs[name] = p
        threading.Thread(target=lambda: self.log.extend(p.stdout or []), daemon=True).start()

    def restart_exited(self, name: str) -> bool:
        """As ``restart: unless-stopped``: a component that exited is started again (a restarted
        scheduler gives up if its killed predecessor still holds the others past its start-up
        window). Says so in the output; True, so it can lead a condition."""
        code = self.procs[name].poll()
        if code is not None:
            print(f"\n{name} exited with {code}: started again, as compose restarts it")
            self.start(name)
        return True

    def stop_all(self) -> None:
        """SIGTERM to each process still running, SIGKILL after 15 s."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def health(self) -> int:
        with grpc.insecure_channel(self.addr) as ch:
            try:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                return -1


@contextmanager
def compose(model_dir: str, extra: list[str], run_dir: str) -> Iterator[Compose]:
    a = default_addresses(run_dir)
    common = ["--model", model_dir, *extra, "--scheduler-in", a.scheduler_in, "--scheduler-out", a.scheduler_out,
              "--blockmgr-addr", a.blockmgr, "--worker-addr", a.worker]
    port = free_port()
    argv = {n: list(common) for n in NAMES}
    argv["frontend"] += ["--port", str(port)]
    c = Compose(argv, f"127.0.0.1:{port}")
    try:
        for name in NAMES:
            c.start(name)
        wait_for(lambda: c.health() == health_pb2.HealthCheckResponse.SERVING, 120, "SERVING")
        yield c
    finally:
        c.stop_all()


@pytest.mark.parametrize("victim", ["gpuworker", "blockmgr", "scheduler"])
def test_restarted_by_hand_loses_nothing(setup: tuple[str, list[Job], list[list[int]]], victim: str,
                                         tmp_path: os.PathLike[str]) -> None:
    model_dir, jobs, expected = setup
    need = sum(-(-(len(p) + s["max_tokens"]) // BLOCK) for p, s in jobs)
    extra = ["--block-size", str(BLOCK), "--num-gpu-blocks", str(need // 3 + 1), "--max-num-seqs", "32"]
    with compose(model_dir, extra, str(tmp_path / "run")) as c:
        server = Server(None, c.addr, c.pids, c.log)  # type: ignore[arg-type]  # what the helpers read
        streams, threads = run_streams(server, jobs)
        t_kill = kill_midway(server, victim, streams, sum(s["max_tokens"] for _, s in jobs))
        c.procs[victim].wait(10)
        time.sleep(1.0)  # compose's restart delay; the survivors meanwhile wait
        c.start(victim)
        for t in threads:
            t.join(120)
        print(f"\n{victim} kill -9, restarted by hand after 1 s: longest stream stall "
              f"{longest_stall(streams, t_kill):.2f}s")
        try:
            wait_for(lambda: c.restart_exited(victim) and c.health() == health_pb2.HealthCheckResponse.SERVING, 90,
                     "SERVING again")
        except AssertionError:  # the components' last lines say which one did not come back
            print("".join(c.log[-120:]))
            raise
        wait_all_free(server)
    assert [s.error for s in streams] == [None] * N_REQ
    assert [s.tokens for s in streams] == expected
