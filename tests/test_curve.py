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
