"""common/ipc.py under bad input: bad frames are dropped and counted, a REP
server answers them and keeps its session owner, and a waiting call ends at
once on its stop flag or when its peer disconnects."""
from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from pagedserve.common import ipc
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import frontend as fe


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c: zmq.Context = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_pull_queue_drops_bad_frames_and_keeps_order(ctx: zmq.Context, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/scheduler_in.sock"
    pull: ipc.PullQueue[fe.Request] = ipc.PullQueue(ctx, addr, fe.Request, bind=True)
    raw = ctx.socket(zmq.PUSH)
    raw.connect(addr)
    before = ipc.dropped_frames().get("scheduler_in", 0)
    raw.send(msgspec.msgpack.encode(fe.StatsQuery(1)))
    for bad in ([b"\xc1"], [msgspec.msgpack.encode(fe.Outputs([]))], [b"x", b"y"], [msgspec.msgpack.encode([53])]):
        raw.send_multipart(bad)
    raw.send(msgspec.msgpack.encode(fe.StatsQuery(2)))
    assert pull.poll(5000)
    assert pull.get() == fe.StatsQuery(1)
    deadline = time.monotonic() + 5
    got = None
    while got is None and time.monotonic() < deadline:
        got = pull.get_nowait()
    assert got == fe.StatsQuery(2)
    assert ipc.dropped_frames()["scheduler_in"] - before == 4
    raw.close(linger=0)
    pull.close()


def test_rep_server_answers_bad_frames_and_keeps_its_owner(ctx: zmq.Context, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/blockmgr.sock"
    server: ipc.RepServer[bm.Request] = ipc.RepServer(ctx, addr, bm.Request, pin_on=(bm.InitRequest,))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not server.poll(50):
                continue
            try:
                msg = server.recv()
            except ipc.BadFrame as e:
                server.send(bm.ErrorReply(str(e), kind=e.kind))
                continue
            server.send(bm.Ack() if isinstance(msg, bm.InitRequest) else bm.ErrorReply("served: stats"))

    t = threading.Thread(target=serve)
    t.start()
    try:
        owner: ipc.ReqClient[bm.Reply] = ipc.ReqClient(ctx, addr, bm.Reply)
        stranger: ipc.ReqClient[bm.Reply] = ipc.ReqClient(ctx, addr, bm.Reply)
        init = bm.InitRequest(8, 0, 16, True)
        assert owner.call(init, 5) == bm.Ack()
        # The owner is known by the client's own fixed routing id, which a reconnect keeps.
        assert server.owner == owner.sock.getsockopt(zmq.ROUTING_ID) and server.owner.startswith(b"req-")
        # A stranger's garbage and its commands are refused, with the kind saying why.
        stranger.sock.send(b"\xc1")
        assert stranger.sock.poll(5000)
        assert msgspec.msgpack.decode(stranger.sock.recv(), type=bm.Reply).kind == "bad_frame"
        for cmd in (init, bm.StatsRequest()):
            reply = stranger.call(cmd, 5)
            assert isinstance(reply, bm.ErrorReply) and reply.kind == "wrong_peer"
        assert owner.call(bm.StatsRequest(), 5) == bm.ErrorReply("served: stats")
        # Once the owner's connection is gone, a new peer may take over with an Init.
        owner.close()
        deadline = time.monotonic() + 5
        while (reply := stranger.call(init, 5)) != bm.Ack():
            assert time.monotonic() < deadline, reply
            time.sleep(0.05)
        assert stranger.call(bm.StatsRequest(), 5) == bm.ErrorReply("served: stats")
        stranger.close()
    finally:
        stop.set()
        t.join(5)
        server.close()


def test_waiting_call_ends_on_stop_and_on_a_lost_peer(ctx: zmq.Context, tmp_path: Path) -> None:
    addr = f"ipc://{tmp_path}/worker.sock"
    peer = ctx.socket(zmq.ROUTER)
    peer.bind(addr)
    client: ipc.ReqClient[bm.Reply] = ipc.ReqClient(ctx, addr, bm.Reply)
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    t0 = time.monotonic()
    with pytest.raises(ipc.Interrupted):
        client.call(bm.StatsRequest(), 5, stop=flag.is_set)
    assert time.monotonic() - t0 < 2.0
    # The peer takes the request, then dies without answering.
    threading.Timer(0.3, lambda: peer.close(linger=0)).start()
    t0 = time.monotonic()
    with pytest.raises(ipc.PeerLost):
        client.call(bm.StatsRequest(), 5)  # ChannelTimeout (a fail) if the loss went unnoticed
    assert time.monotonic() - t0 < 3.0
    client.close()


def test_a_put_blocked_on_a_missing_peer_gives_up_on_stop(ctx: zmq.Context, tmp_path: Path) -> None:
    flag = threading.Event()
    push: ipc.PushQueue[fe.Reply] = ipc.PushQueue(ctx, f"ipc://{tmp_path}/out.sock", bind=True, stop=flag.is_set)
    threading.Timer(0.3, flag.set).start()
    t0 = time.monotonic()
    push.put(fe.Outputs([]))  # nobody pulls: without the stop flag this blocks for ever
    assert 0.2 < time.monotonic() - t0 < 2.0
    push.close()


def test_raw_bytes_on_a_push_socket_take_no_frame(ctx: zmq.Context, tmp_path: Path) -> None:
    """A greeting that is not ZMTP 3 (random bytes) must not become a peer the
    PUSH round-robins to: libzmq would take it as ZMTP 1.0 and lose the frames
    it hands that peer when it hangs up (the fuzz test's one lost Outputs)."""
    path = tmp_path / "out.sock"
    push: ipc.PushQueue[fe.Request] = ipc.PushQueue(ctx, f"ipc://{path}", bind=True)
    pull: ipc.PullQueue[fe.Request] = ipc.PullQueue(ctx, f"ipc://{path}", fe.Request, bind=False)
    rng = random.Random(1)
    sent = 400
    for i in range(sent):
        if i % 10 == 0:
            with socket.socket(socket.AF_UNIX) as u:
                u.connect(str(path))
                u.sendall(bytes([rng.randrange(0xFF)]) + rng.randbytes(63))  # never 0xff first: "ZMTP 1.0"
                time.sleep(0.005)  # let libzmq read the greeting while the peer is still there
        push.put(fe.StatsQuery(i))
    got = []
    while pull.poll(1000):
        got.append(pull.get())
    assert got == [fe.StatsQuery(i) for i in range(sent)]
    pull.close()
    push.close()
