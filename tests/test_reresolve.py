"""Issue 19: connecting sockets find their peer again at a new address.

A REQ client and the frontend's asyncio PUSH/PULL pair connect to the host
name ``pagedserve-test-peer`` (common/resolve.py's resolver patched: first
127.0.0.2); the peer is closed and comes back on 127.0.0.3, same port, while
the name now resolves there; the clients' next calls succeed within seconds.
Real sockets, plain (opted out) and with CurveZMQ keys."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from pagedserve.common import curve, ipc, resolve
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import frontend as fe

HOST = "pagedserve-test-peer"
OLD, NEW = "127.0.0.2", "127.0.0.3"  # loopback on Linux
WITHIN_S = 5.0


def free_port_on_both() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind((OLD, 0))
            port = int(a.getsockname()[1])
            try:
                b.bind((NEW, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on both addresses")


@pytest.fixture(params=["plain", "curve"])
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, str]]:
    """What the patched resolver answers for HOST (the test moves it)."""
    if request.param == "curve":
        assert curve.main([str(tmp_path / "keys")]) == 0
        monkeypatch.setenv(curve.ENV, str(tmp_path / "keys"))
        monkeypatch.delenv(curve.INSECURE_ENV, raising=False)
    else:
        monkeypatch.delenv(curve.ENV, raising=False)
        monkeypatch.setenv(curve.INSECURE_ENV, "1")
    answer = {"ip": OLD}
    asked: list[str] = []
    real = resolve.resolve_host

    def fake(host: str) -> list[str]:
        if host != HOST:
            return real(host)
        asked.append(host)
        return [answer["ip"]]

    monkeypatch.setattr(resolve, "resolve_host", fake)
    yield answer
    assert asked, "the resolver was never asked"
    assert HOST not in resolve._hosts, "a closed socket left its host behind"


class Server:
    """A RepServer on ip:port answering each request with its own address."""

    def __init__(self, ctx: zmq.Context, ip: str, port: int) -> None:
        self.rep: ipc.RepServer[bm.Request] = ipc.RepServer(ctx, f"tcp://{ip}:{port}", bm.Request,
                                                            pin_on=(bm.InitRequest,))
        self.ip = ip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.rep.poll(50):
                continue
            try:
                self.rep.recv()
            except ipc.BadFrame as e:
                self.rep.send(bm.ErrorReply(str(e), kind=e.kind))
                continue
            self.rep.send(bm.ErrorReply(f"served by {self.ip}"))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(5)
        self.rep.close()


def call_until_served(client: ipc.ReqClient[bm.Reply], msg: bm.Request, by: str) -> float:
    """Retries as the scheduler's recovery does; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        try:
            reply = client.call(msg, timeout_s=0.5)
            assert isinstance(reply, bm.ErrorReply)
            if reply.message == f"served by {by}":
                return time.monotonic() - t0
        except (ipc.PeerLost, ipc.ChannelTimeout):
            pass
        assert time.monotonic() - t0 < WITHIN_S, f"not served by {by} within {WITHIN_S} s"


def test_req_client_follows_its_peer_to_a_new_address(where: dict[str, str]) -> None:
    ctx: zmq.Context = zmq.Context()
    port = free_port_on_both()
    server = Server(ctx, OLD, port)
    client: ipc.ReqClient[bm.Reply] = ipc.ReqClient(ctx, f"tcp://{HOST}:{port}", bm.Reply)
    try:
        assert client._link is not None and client._link.endpoint == f"tcp://{OLD}:{port}"
        routing_id = client.sock.getsockopt(zmq.ROUTING_ID)
        call_until_served(client, bm.InitRequest(8, 0, 16, True), OLD)
        assert server.rep.owner == routing_id
        server.close()
        where["ip"] = NEW
        server = Server(ctx, NEW, port)
        took = call_until_served(client, bm.InitRequest(8, 0, 16, True), NEW)
        print(f"\nREQ served at the new address {took:.2f} s after the move")
        # A new socket, the same routing id: the server's session owner is still this client.
        assert client.sock.getsockopt(zmq.ROUTING_ID) == routing_id == server.rep.owner
        assert client._link.endpoint == f"tcp://{NEW}:{port}"
        # With keys, the new socket is a CURVE client again (served: it has the server's key).
        assert client.sock.getsockopt(zmq.MECHANISM) == (zmq.CURVE if curve.from_env() else zmq.NULL)
        # The peer-lost signal other code relies on still works at the new address.
        client._peer_lost()
        server.close()
        deadline = time.monotonic() + WITHIN_S
        while not client._peer_lost():
            assert time.monotonic() < deadline, "no disconnect reported"
            time.sleep(0.05)
    finally:
        server.close()
        client.close()
        ctx.term()


def test_a_request_that_reached_nobody_is_sent_to_the_new_address(where: dict[str, str]) -> None:
    """The peer is not there yet when the request is sent; it comes up elsewhere:
    the same call gets its answer, with no retry by the caller."""
    ctx: zmq.Context = zmq.Context()
    port = free_port_on_both()
    client: ipc.ReqClient[bm.Reply] = ipc.ReqClient(ctx, f"tcp://{HOST}:{port}", bm.Reply)
    server = None
    try:
        client.send(bm.StatsRequest())
        where["ip"] = NEW
        server = Server(ctx, NEW, port)
        reply = client.reply(WITHIN_S)
        assert isinstance(reply, bm.ErrorReply) and reply.message == f"served by {NEW}"
    finally:
        if server is not None:
            server.close()
        client.close()
        ctx.term()


async def _until(what: str, step: object) -> float:
    t0 = time.monotonic()
    while not await step():  # type: ignore[operator]
        assert time.monotonic() - t0 < WITHIN_S, f"{what}: not within {WITHIN_S} s"
    return time.monotonic() - t0


async def _push_pull(port_in: int, port_out: int, where: dict[str, str]) -> None:
    sctx: zmq.Context = zmq.Context()
    actx = zmq.asyncio.Context()

    def peer(ip: str) -> tuple[ipc.PullQueue[fe.Request], ipc.PushQueue[fe.Reply]]:
        # The scheduler's side: it binds both; a put gives up at once without a frontend.
        return (ipc.PullQueue(sctx, f"tcp://{ip}:{port_in}", fe.Request, bind=True),
                ipc.PushQueue(sctx, f"tcp://{ip}:{port_out}", bind=True, stop=lambda: True))

    inbox, outbox = peer(OLD)
    push: ipc.AsyncPushQueue[fe.Request] = ipc.AsyncPushQueue(actx, f"tcp://{HOST}:{port_in}", bind=False)
    pull: ipc.AsyncPullQueue[fe.Reply] = ipc.AsyncPullQueue(actx, f"tcp://{HOST}:{port_out}", fe.Reply, bind=False)
    monitor = pull.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # as the frontend does

    async def exchange(n: int) -> bool:
        await push.put(fe.StatsQuery(n))
        got_in = await asyncio.to_thread(inbox.poll, 200) and inbox.get() == fe.StatsQuery(n)
        outbox.put(fe.Outputs([fe.TokenDelta(f"r{n}", 0, [n])]))
        try:
            got_out = (await asyncio.wait_for(pull.get(), 0.2)) == fe.Outputs([fe.TokenDelta(f"r{n}", 0, [n])])
        except asyncio.TimeoutError:
            got_out = False
        return bool(got_in and got_out)

    try:
        await _until("the first exchange", lambda: exchange(1))
        inbox.close()
        outbox.close()
        await asyncio.wait_for(monitor.recv_multipart(), WITHIN_S)  # the frontend sees the loss
        where["ip"] = NEW
        inbox, outbox = peer(NEW)
        took = await _until("an exchange at the new address", lambda: exchange(2))
        print(f"\nPUSH/PULL exchanged at the new address {took:.2f} s after the move")
        assert push._follow is not None and push._follow.link.endpoint == f"tcp://{NEW}:{port_in}"
        # The frontend's own monitor is still the PULL's: the next loss shows there too.
        inbox.close()
        outbox.close()
        await asyncio.wait_for(monitor.recv_multipart(), WITHIN_S)
        # Back at the first address: nothing is lost there (a session left reconnecting to
        # it by the first move would take every other message and drop it).
        where["ip"] = OLD
        inbox, outbox = peer(OLD)
        await _until("an exchange back at the first address", lambda: exchange(3))
        await asyncio.sleep(0.5)  # time for a stray session to reconnect
        for n in range(10, 20):
            await push.put(fe.StatsQuery(n))
            outbox.put(fe.Outputs([fe.TokenDelta(f"r{n}", 0, [n])]))
        got_in = [inbox.get() for _ in range(10) if await asyncio.to_thread(inbox.poll, 2000)]
        got_out = []
        for _ in range(10):
            try:
                got_out.append(await asyncio.wait_for(pull.get(), 2.0))
            except asyncio.TimeoutError:
                break
        assert got_in == [fe.StatsQuery(n) for n in range(10, 20)]
        assert got_out == [fe.Outputs([fe.TokenDelta(f"r{n}", 0, [n])]) for n in range(10, 20)]
    finally:
        pull.sock.disable_monitor()
        monitor.close(linger=0)
        push.close()
        pull.close()
        inbox.close()
        outbox.close()
        actx.term()
        sctx.term()


def test_async_push_pull_follow_their_peer_to_a_new_address(where: dict[str, str]) -> None:
    asyncio.run(_push_pull(free_port_on_both(), free_port_on_both(), where))


def test_ip_literals_and_ipc_are_connected_as_given(tmp_path: Path) -> None:
    assert resolve.link(f"ipc://{tmp_path}/x.sock", watched=True) is None
    assert resolve.link("tcp://127.0.0.1:5555", watched=True) is None
    assert resolve.link("tcp://[::1]:5555", watched=True) is None
    assert resolve.link("tcp://eth0;10.0.0.1:5555", watched=True) is None
    assert resolve.resolve_host("localhost")[0] in ("127.0.0.1", "::1")
    assert resolve.resolve_host("no-such-host.invalid") == []
