"""Issue 11, graceful drain with the default ``--shutdown-timeout`` (30 s):
Ctrl-C (sent to the launcher's whole process group, as a terminal does)
stops admission and lets the request in flight finish, and the server stops
as soon as nothing is in flight; after a SIGTERM, a Ctrl-C stops at once,
ending the open stream with UNAVAILABLE and a message that says why. (Past the timeout:
tests/test_frontend_hardening.py, with a 1 s timeout.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from e2e_util import serve
from grpc_health.v1 import health_pb2, health_pb2_grpc
from models import make_tiny_model

from pagedserve.serve_args import parse_serve_args

SIM = ("--worker", "sim", "--num-gpu-blocks", "2048", "--max-model-len", "65536")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("drain"), "llama", seed=0)


def test_shutdown_timeout_defaults_to_30_s_and_its_help_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_SHUTDOWN_TIMEOUT", raising=False)
    assert parse_serve_args([]).cfg.shutdown_timeout == 30.0
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_SHUTDOWN_TIMEOUT"}
    for component in ("serve", "frontend"):  # compose runs the frontend alone
        out = subprocess.run([sys.executable, "-m", "pagedserve", component, "--help"], env=env, text=True,
                             capture_output=True, check=True, timeout=60).stdout
        text = " ".join(out.split("--shutdown-timeout SHUTDOWN_TIMEOUT")[-1].split())
        assert text.startswith("seconds SIGTERM waits for in-flight requests") and "(default: 30.0" in text, out
    monkeypatch.setenv("PAGEDSERVE_SHUTDOWN_TIMEOUT", "7")
    assert parse_serve_args([]).cfg.shutdown_timeout == 7.0


def not_serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError as e:  # the server already refuses new calls
            return e.code() == grpc.StatusCode.UNAVAILABLE
        return r.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_components_lead_their_own_process_groups_in_the_launchers_session(tiny: str) -> None:
    """Own process groups: a terminal's Ctrl-C reaches only the launcher, which drains.
    The launcher's session: one autogroup, not one per component (launcher.py says why)."""
    from benchmarks.peer_engines import process_tree

    with serve(tiny, *SIM, session=True) as s:
        children = process_tree(s.proc.pid)[1:]
        assert len(children) == 4, children
        assert [os.getsid(p) for p in children] == [os.getsid(s.proc.pid)] * 4
        assert [os.getpgid(p) for p in children] == children


def test_ctrl_c_lets_the_request_in_flight_finish_and_stops_once_none_is(tiny: str) -> None:
    with serve(tiny, *SIM, session=True) as s, s.client() as c:
        # The SIMULATED worker: about 4000 tokens take seconds on 2 cores, well inside 30 s.
        stream = c.stream([5, 6, 7], max_tokens=4000, temperature=0.0, ignore_eos=True, timeout=60)
        got = sum(len(o.token_ids) for o in next(stream).outputs)
        os.killpg(s.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher's whole process group
        t0 = time.monotonic()
        time.sleep(0.3)
        assert not_serving(s.addr)
        with s.client() as other:  # admission has stopped
            with pytest.raises(grpc.RpcError) as refused:
                other.generate([5, 6], max_tokens=2, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        finish, late = [], 0
        for resp in stream:
            got += sum(len(o.token_ids) for o in resp.outputs)
            late += sum(len(o.token_ids) for o in resp.outputs) if time.monotonic() > t0 + 0.5 else 0
            finish += [o.finish_reason for o in resp.outputs if o.finish_reason]
        t_end = time.monotonic()
        assert got == 4000 and finish == ["length"]  # ran to its end under the default 30 s
        assert late > 0, "the request was not in flight during the drain"
        assert s.proc.wait(20) == 0
        print(f"\ndrained for {t_end - t0:.2f}s; stopped {time.monotonic() - t_end:.2f}s after the last token")
        assert t_end - t0 < 30
        assert time.monotonic() - t_end < 15, "the drain waited on with nothing in flight"


def test_a_second_signal_stops_at_once(tiny: str) -> None:
    with serve(tiny, *SIM, session=True) as s, s.client() as c:
        stream = c.stream([5, 6, 7], max_tokens=60000, ignore_eos=True, timeout=60)
        next(stream)
        s.proc.send_signal(signal.SIGTERM)  # as `docker stop` does: the launcher only
        time.sleep(1.0)
        assert next(stream).outputs, "the stream must go on while draining"
        t0 = time.monotonic()
        os.killpg(s.proc.pid, signal.SIGINT)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        ended = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "shutting down (a second stop signal)" in err.value.details(), err.value.details()
        assert s.proc.wait(20) == 0
        print(f"\nsecond Ctrl-C: stream ended after {ended:.2f}s, stopped after {time.monotonic() - t0:.2f}s")
        assert ended < 3.0
