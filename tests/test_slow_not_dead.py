"""Issue 19, slow is not dead: a live but slow engine loses no stream.

The worker is stopped (SIGSTOP) for longer than the frontend's health timeout
while 20 greedy and seeded streams run through the real four processes; it
is never restarted. Every stream must complete with the undisturbed run's
tokens, health must stay SERVING throughout (GetServerInfo answering, with
``degraded`` set while the step hangs), and every block must be free after.
Then the same workload beside a co-tenant that keeps every core busy."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest
from e2e_util import Server, serve, wait_all_free
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_chaos import BLOCK, N_REQ, Job, reference, run_streams, wait_for, workload

from models import make_tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Job], list[list[int]]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("slow"), "llama", seed=7, num_hidden_layers=2)
    jobs = workload()
    return model_dir, jobs, reference(model_dir, jobs)


def small_pool(jobs: list[Job]) -> str:
    need = sum(-(-(len(p) + s["max_tokens"]) // BLOCK) for p, s in jobs)
    return str(need // 3 + 1)  # about a third of the workload's KV: preemption happens


class HealthProbe:
    """Polls gRPC health and GetServerInfo once a second, as a load balancer would."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.statuses: list[int] = []
        self.times: list[float] = []
        self.degraded: list[tuple[float, bool]] = []  # (when, GetServerInfo.degraded)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        with grpc.insecure_channel(self.server.addr) as ch, self.server.client() as c:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self._stop.wait(1.0):
                try:
                    self.statuses.append(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)
                    self.times.append(time.monotonic())
                    self.degraded.append((time.monotonic(), c.server_info().degraded))
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code()}: {e.details()}")

    def stop(self) -> None:
        self._stop.set()
        self._t.join(10)


STOPS_S = (60, 120)


def _stopped_for(setup: tuple[str, list[Job], list[list[int]]], stop_s: int) -> str:
    """One server whose worker is stopped for ``stop_s`` once a fifth of the tokens streamed;
    asserts what acceptance 1 asks and returns the summary line."""
    model_dir, jobs, expected = setup
    env = {"PAGEDSERVE_HEALTH_TIMEOUT": "30", "PAGEDSERVE_STEP_TIMEOUT": str(stop_s + 60)}
    with serve("--model", model_dir, "--block-size", str(BLOCK), "--num-gpu-blocks", small_pool(jobs),
               "--max-num-seqs", "32", env=env) as server:
        streams, threads = run_streams(server, jobs, timeout_s=stop_s + 240)
        total = sum(s["max_tokens"] for _, s in jobs)
        wait_for(lambda: sum(len(s.tokens) for s in streams) >= total // 5, 60, "a fifth of the tokens")
        worker = server.pids["gpuworker"]
        probe = HealthProbe(server)
        os.kill(worker, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            time.sleep(stop_s)
            assert sum(len(s.tokens) for s in streams) < total, "the workload finished while the worker was stopped"
        finally:
            os.kill(worker, signal.SIGCONT)
            t_cont = time.monotonic()
        for t in threads:
            t.join(240)
        probe.stop()
        info = wait_all_free(server)
        assert info.num_preemptions > 0, "the pool was meant to be small enough to preempt"
        assert not info.degraded
        log = "".join(server.log)
    assert [s.error for s in streams] == [None] * N_REQ, log[-3000:]
    assert [s.reason for s in streams] == ["length"] * N_REQ
    assert [s.tokens for s in streams] == expected
    assert "restarted gpuworker" not in log and "recover" not in log
    serving = health_pb2.HealthCheckResponse.SERVING
    # A probe at least every 5 s all along (one a second when the machine keeps up).
    gaps = [b - a for a, b in zip(probe.times, probe.times[1:])]
    assert probe.errors == [] and len(probe.statuses) >= stop_s // 2 and max(gaps) < 5.0, \
        (probe.errors, len(probe.statuses), max(gaps, default=0.0))
    assert set(probe.statuses) == {serving}, probe.statuses
    # Past the 5 s threshold (and a probe interval) the hung step shows as degraded in every answer.
    stalled = [d for t, d in probe.degraded if t_stop + 8 < t < t_cont - 1]
    assert len(stalled) >= 5 and all(stalled), f"GetServerInfo.degraded while the worker was stopped: {stalled}"
    return (f"worker stopped {stop_s}s: {N_REQ} streams identical, health SERVING in {len(probe.statuses)} "
            f"probes, degraded in {sum(d for _, d in probe.degraded)}")


def test_a_stopped_worker_is_waited_for(setup: tuple[str, list[Job], list[list[int]]]) -> None:
    """60 s and 120 s, each on its own server, at the same time: a stopped worker takes no CPU, so
    the two stops overlap and the test takes about the longer one (not their sum)."""
    results: dict[int, str | BaseException] = {}

    def one(stop_s: int) -> None:
        try:
            results[stop_s] = _stopped_for(setup, stop_s)
        except BaseException as e:  # noqa: BLE001 - re-raised below, with the case that failed
            results[stop_s] = e

    runs = [threading.Thread(target=one, args=(s,)) for s in STOPS_S]
    for t in runs:
        t.start()
    for t in runs:
        t.join()
    for stop_s in STOPS_S:
        got = results.get(stop_s)
        if isinstance(got, BaseException):
            raise AssertionError(f"worker stopped {stop_s}s") from got
        assert got is not None, f"worker stopped {stop_s}s: no result"
        print("\n" + got)


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def test_streams_complete_beside_a_cpu_hog(setup: tuple[str, list[Job], list[list[int]]]) -> None:
    """Four busy-looping processes on this 2-core machine, started before the
    server so that its start-up, steps and control loop all run beside them;
    a short health timeout that the old watchdog would have taken as a lost
    scheduler under this load."""
    model_dir, jobs, expected = setup
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(2 * (os.cpu_count() or 2))]
    for h in hogs:
        h.start()
    try:
        env = {"PAGEDSERVE_HEALTH_TIMEOUT": "1", "PAGEDSERVE_HEALTH_INTERVAL": "0.2"}
        t0 = time.monotonic()
        with serve("--model", model_dir, "--block-size", str(BLOCK), "--num-gpu-blocks", small_pool(jobs),
                   "--max-num-seqs", "32", env=env) as server:
            streams, threads = run_streams(server, jobs, timeout_s=600)
            for t in threads:
                t.join(600)
            wait_all_free(server)
        took = time.monotonic() - t0
    finally:
        stop.set()
        for h in hogs:
            h.join(5)
    assert [s.error for s in streams] == [None] * N_REQ
    assert [s.tokens for s in streams] == expected
    print(f"\nbeside {len(hogs)} busy loops: {N_REQ} streams identical in {took:.1f}s (start-up included)")
