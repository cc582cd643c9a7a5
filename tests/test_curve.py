"""Optional CurveZMQ on internal tcp:// sockets: encrypted, and a peer without
the server key gets nothing."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq

from pagedserve.common import curve, ipc
from pagedserve.common.messages import frontend as fe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_curve_push_pull(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert curve.main([str(tmp_path / "keys")]) == 0
    monkeypatch.setenv(curve.ENV, str(tmp_path / "keys"))
    addr = f"tcp://127.0.0.1:{free_port()}"
    ctx: zmq.Context = zmq.Context()
    try:
        push: ipc.PushQueue[fe.Request] = ipc.PushQueue(ctx, addr, bind=True)
        assert push.sock.curve_server
        pull: ipc.PullQueue[fe.Request] = ipc.PullQueue(ctx, addr, fe.Request, bind=False)
        push.put(fe.StatsQuery(7))
        assert pull.poll(5000) and pull.get() == fe.StatsQuery(7)
        # A peer that does not know the server key never completes the handshake.
        monkeypatch.delenv(curve.ENV)
        monkeypatch.setenv(curve.INSECURE_ENV, "1")  # the explicit opt-out lets it try
        stranger: ipc.PullQueue[fe.Request] = ipc.PullQueue(ctx, addr, fe.Request, bind=False)
        push.put(fe.StatsQuery(8))
        assert pull.poll(5000) and pull.get() == fe.StatsQuery(8)  # delivered to the keyed peer only
        assert not stranger.poll(500)
        for q in (push, pull, stranger):
            q.close()
    finally:
        ctx.term()


def test_ipc_sockets_stay_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    curve.main([str(tmp_path / "keys")])
    monkeypatch.setenv(curve.ENV, str(tmp_path / "keys"))
    ctx: zmq.Context = zmq.Context()
    try:
        q: ipc.PushQueue[fe.Request] = ipc.PushQueue(ctx, f"ipc://{tmp_path}/x.sock", bind=True)
        assert not q.sock.curve_server
        q.close()
    finally:
        ctx.term()


def test_tcp_without_keys_is_refused_unless_opted_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(curve.ENV, raising=False)
    monkeypatch.delenv(curve.INSECURE_ENV, raising=False)
    ctx: zmq.Context = zmq.Context()
    try:
        for bind in (True, False):  # loopback included: every local user reaches it
            with pytest.raises(curve.InsecureTransport, match="--insecure-internal-tcp"):
                ipc.PushQueue(ctx, f"tcp://127.0.0.1:{free_port()}", bind=bind)
        monkeypatch.setenv(curve.INSECURE_ENV, "1")
        q: ipc.PushQueue[fe.Request] = ipc.PushQueue(ctx, f"tcp://127.0.0.1:{free_port()}", bind=True)
        assert not q.sock.curve_server
        q.close()
    finally:
        ctx.term()


def test_component_refuses_plain_tcp_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    monkeypatch.delenv(curve.ENV, raising=False)
    monkeypatch.delenv(curve.INSECURE_ENV, raising=False)
    out = subprocess.run([sys.executable, "-m", "pagedserve", "blockmgr", "--blockmgr-addr",
                          f"tcp://127.0.0.1:{free_port()}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "pagedserve blockmgr: error:" in out.stderr and curve.ENV in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_keygen_if_missing_keeps_existing_keys(tmp_path: Path) -> None:
    assert curve.main([str(tmp_path / "k")]) == 0
    before = (tmp_path / "k" / "server.key_secret").read_bytes()
    assert curve.main(["--if-missing", str(tmp_path / "k")]) == 0
    assert (tmp_path / "k" / "server.key_secret").read_bytes() == before
