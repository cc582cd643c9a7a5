"""Issue 19, acceptance 4 without containers: a component stopped and started
again at a *new address* under the same host name, as a compose container
after ``podman stop`` + ``podman start`` (or a Kubernetes pod restart) is
found again. The four processes run as compose runs them, over tcp:// with
CurveZMQ keys and host names; each one sees one hosts file, bind-mounted over
/etc/hosts in a private mount namespace (``unshare -m``, root). The victim
is stopped (SIGTERM, as ``podman stop``), its name is moved to another
loopback address, and it starts again bound there only: the old address is
dead, so only a peer that resolves the name again reaches it. During 8
greedy and seeded streams; every stream finishes with the undisturbed run's
tokens and every block is free. (The same with real containers:
tests/test_container_newip.py, opt-in.)"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from e2e_util import Server, free_port, wait_all_free
from grpc_health.v1 import health_pb2
from test_chaos import BLOCK, Job, reference, run_streams, wait_for, workload
from test_chaos_compose import Compose

from models import make_tiny_model
from pagedserve.common import curve

NAMES = ("blockmgr", "gpuworker", "scheduler", "frontend")
HOSTS = {"scheduler": "pagedserve-scheduler", "blockmgr": "pagedserve-blockmgr", "gpuworker": "pagedserve-gpuworker"}
FIRST_IP = {"scheduler": "127.0.0.2", "blockmgr": "127.0.0.4", "gpuworker": "127.0.0.6"}
MOVED_IP = {"scheduler": "127.0.0.3", "blockmgr": "127.0.0.5", "gpuworker": "127.0.0.7"}


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m (a private /etc/hosts)")


class HostsCompose(Compose):
    """Compose whose processes resolve names through ``hosts`` (rewritten in
    place: a bind mount follows the file's inode, not its name)."""

    hosts: Path
    env: dict[str, str]

    def write_hosts(self, ips: dict[str, str]) -> None:
        with open(self.hosts, "r+") as f:
            f.truncate(0)
            f.write("127.0.0.1 localhost\n" + "".join(f"{ips[n]} {HOSTS[n]}\n" for n in HOSTS))

    def start(self, name: str) -> None:
        cmd = [sys.executable, "-m", "pagedserve", name, *self.argv[name]]
        shell = f"mount --bind {self.hosts} /etc/hosts && exec " + " ".join(f"'{a}'" for a in cmd)
        p = subprocess.Popen(["unshare", "-m", "sh", "-c", shell], text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = p
        threading.Thread(target=lambda: self.log.extend(p.stdout or []), daemon=True).start()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Job], list[list[int]]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("newip"), "llama", seed=7, num_hidden_layers=2)
    jobs = workload()[:8]
    return model_dir, jobs, reference(model_dir, jobs)


@pytest.mark.parametrize("victim", ["scheduler", "blockmgr", "gpuworker"])
def test_a_component_restarted_at_a_new_address_is_found(setup: tuple[str, list[Job], list[list[int]]],
                                                         victim: str, tmp_path: Path) -> None:
    model_dir, jobs, expected = setup
    keys = tmp_path / "keys"
    assert curve.main([str(keys)]) == 0
    ports = {n: free_port() for n in ("scheduler_in", "scheduler_out", "blockmgr", "gpuworker")}
    sched = HOSTS["scheduler"]
    need = sum(-(-(len(p) + s["max_tokens"]) // BLOCK) for p, s in jobs)
    common = ["--model", model_dir, "--block-size", str(BLOCK), "--num-gpu-blocks", str(need // 2 + 1),
              "--max-num-seqs", "16",
              "--scheduler-in", f"tcp://{sched}:{ports['scheduler_in']}",
              "--scheduler-out", f"tcp://{sched}:{ports['scheduler_out']}",
              "--blockmgr-addr", f"tcp://{HOSTS['blockmgr']}:{ports['blockmgr']}",
              "--worker-addr", f"tcp://{HOSTS['gpuworker']}:{ports['gpuworker']}"]
    grpc_port = free_port()
    argv = {n: list(common) for n in NAMES}
    argv["frontend"] += ["--port", str(grpc_port)]
    c = HostsCompose(argv, f"127.0.0.1:{grpc_port}")
    c.hosts = tmp_path / "hosts"
    c.hosts.write_text("")
    c.write_hosts(FIRST_IP)
    c.env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDSERVE_CURVE_KEYS": str(keys)}
    try:
        for name in NAMES:
            c.start(name)
        wait_for(lambda: c.health() == health_pb2.HealthCheckResponse.SERVING, 120, "SERVING")
        server = Server(None, c.addr, c.pids, c.log)  # type: ignore[arg-type]  # what the helpers read
        streams, threads = run_streams(server, jobs, timeout_s=180)
        total = sum(s["max_tokens"] for _, s in jobs)
        wait_for(lambda: sum(len(s.tokens) for s in streams) >= total // 5, 60, "a fifth of the tokens")
        c.procs[victim].send_signal(signal.SIGTERM)  # as podman stop does
        t_stop = time.monotonic()
        c.procs[victim].wait(15)
        assert sum(len(s.tokens) for s in streams) < total, "the workload finished before the stop"
        c.write_hosts({**FIRST_IP, victim: MOVED_IP[victim]})
        time.sleep(1.0)
        c.start(victim)
        for t in threads:
            t.join(180)
        took = max((t for s in streams for t in s.times), default=t_stop) - t_stop
        wait_for(lambda: c.health() == health_pb2.HealthCheckResponse.SERVING, 60, "SERVING again")
        wait_all_free(server)
        print(f"\n{victim} moved {FIRST_IP[victim]} -> {MOVED_IP[victim]}: streams done {took:.1f}s after the stop")
    finally:
        c.stop_all()
    log = "".join(c.log)
    assert [s.error for s in streams] == [None] * len(jobs), log[-4000:]
    assert [s.tokens for s in streams] == expected
