"""Tiny typed ZeroMQ queues: msgpack via msgspec, one message union per socket.

Internal sockets default to ``ipc://`` paths in a private folder (see
``config.default_addresses`` and ``rundir``) or CurveZMQ tcp; nothing here
ever unpickles.

A frame that does not decode as the socket's union (garbage, a wrong tag, a
wrong field, another channel's message, several parts) is *dropped*: counted
per socket (``dropped_frames()``, exported as
``pagedserve:dropped_frames_total{socket}``), logged at most every
``LOG_EVERY_S`` per socket, and skipped; a REP server answers it with its
channel's typed error so its state machine keeps going.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

from pagedserve.common import resolve
from pagedserve.common.ipc_base import (  # noqa: F401 - re-exported: callers import them from here
    HEARTBEAT_IVL_MS,
    HEARTBEAT_TIMEOUT_MS,
    LOG_EVERY_S,
    MAX_SKIP,
    POLL_MS,
    BadFrame,
    ChannelTimeout,
    Interrupted,
    PeerLost,
    WrongPeer,
    _cleanup_ipc,
    _encoder,
    _open,
    _socket_name,
    _Typed,
    dropped_frames,
    log,
    note_dropped,
)

T = TypeVar("T")
R = TypeVar("R")

STALLED_S = 1.0  # a poll slice this much longer than asked: the caller itself did not run


class ReqClient(_Typed[R]):
    """Blocking request/reply client with a timeout (REQ socket)."""

    def __init__(self, ctx: zmq.Context[Any], addr: str, reply_type: Any) -> None:
        self._ctx = ctx
        self._link = resolve.link(addr, watched=True)
        self._routing_id = b"req-" + os.urandom(12)
        self._pending: bytes | None = None  # the request awaiting its reply
        self._reached = False  # it may have reached a peer: never sent twice then
        super().__init__(self._new_socket(addr), reply_type, addr, bind=False)

    def _new_socket(self, addr: str) -> zmq.Socket[Any]:
        sock = _open(self._ctx, zmq.REQ, addr, False, self._link, self._routing_id)
        # A timed-out REQ socket may be reused: the next send starts a new round trip.
        sock.setsockopt(zmq.REQ_RELAXED, 1)
        sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED if self._link is None else
                                                resolve.WATCH_EVENTS)
        return sock

    def _peer_lost(self) -> bool:
        """True once per disconnect (drains the monitor); follows a peer that moved."""
        lost = False
        while self._monitor.poll(0):
            ev = recv_monitor_message(self._monitor)
            lost = lost or ev["event"] == zmq.EVENT_DISCONNECTED
            if self._link is not None:
                self._link.note(ev["event"], ev["endpoint"])
                self._reached = self._reached or self._link.up
        if self._link is not None and self._link.target() is not None:
            lost = self._move() or lost
        return lost

    def _move(self) -> bool:
        """A new socket (same routing id, keys and options) at the peer's new
        address, so that nothing of the old endpoint's session lingers (see
        resolve.follow). A request that never reached a peer is sent again;
        True if one may have (it is lost with that peer)."""
        assert self._link is not None
        to = self._link.target()
        assert to is not None
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._link.moved(to)
        self.sock = self._new_socket(self.addr)
        if self._pending is None or not self._reached:
            if self._pending is not None:
                self.sock.send(self._pending, copy=False)
            return False
        self._pending = None
        return True

    def call(self, msg: msgspec.Struct, timeout_s: float | None = None,
             stop: Callable[[], bool] | None = None) -> R:
        """One round trip. Waits in ``POLL_MS`` slices: raises ``Interrupted``
        once ``stop()`` is true, ``PeerLost`` if the peer disconnects (a dead
        process; a tcp peer silent past the heartbeat timeout),
        ``ChannelTimeout`` after ``timeout_s``, ``BadFrame`` for an undecodable reply."""
        self.send(msg)
        return self.reply(timeout_s, stop)

    def send(self, msg: msgspec.Struct) -> None:
        """The request half of ``call``; ``reply`` must follow."""
        self._peer_lost()  # forget disconnects from before this request
        data = _encoder.encode(msg)
        self.sock.send(data, copy=False)
        if self._link is not None:
            self._pending, self._reached = data, self._link.up

    def reply(self, timeout_s: float | None = None, stop: Callable[[], bool] | None = None) -> R:
        """The reply half of ``call`` (its errors)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                wait = POLL_MS if deadline is None else max(0, min(POLL_MS, int((deadline - time.monotonic()) * 1000)))
                t = time.monotonic()
                if self.sock.poll(wait):
                    break
                # A slice that ends far later than asked means this process did not run
                # (SIGSTOP, a paused VM, a starved CPU); its peer most likely did not
                # either, so that time is not held against the peer: once both run
                # again, it gets the rest of its time to answer.
                stalled = time.monotonic() - t - wait / 1000
                if deadline is not None and stalled > STALLED_S:
                    deadline += stalled
                if stop is not None and stop():
                    raise Interrupted(f"stopped while waiting for {self.addr}")
                if self._peer_lost():
                    raise PeerLost(f"{self.addr} disconnected while a reply was awaited")
                if deadline is not None and time.monotonic() >= deadline:
                    raise ChannelTimeout(f"no reply from {self.addr} within {timeout_s}s")
            return self._decode_parts(self.sock.recv_multipart(copy=False))
        finally:
            self._pending = None

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        if self._link is not None:
            self._link.close()
        super().close()


def _source_fd(frame: Any) -> int:
    """The connection a frame came on, as the socket monitor names it (-1: unknown,
    so the owner never counts as gone: a takeover is refused, never wrongly allowed)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, ValueError):
        return -1


class RepServer(_Typed[T]):
    """Answers one request at a time, like REP, but on a ROUTER socket so it
    knows who asks. The peer whose request is one of ``pin_on`` (the channel's
    Init) owns the session; while the owner's connection lasts, requests from
    any other peer raise ``WrongPeer`` (counted) and get the channel's typed
    error, so a stray peer cannot reset or drive the component. Once the
    owner's connection has closed, a new peer may take over with an Init (a
    restarted scheduler). After ``recv`` (also when it raises), ``send`` once."""

    def __init__(self, ctx: zmq.Context[Any], addr: str, request_type: Any, pin_on: tuple[type, ...] = ()) -> None:
        super().__init__(_open(ctx, zmq.ROUTER, addr, bind=True), request_type, addr, bind=True)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone peer fails instead of vanishing
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._pin_on = pin_on
        self.owner: bytes | None = None
        self._owner_fd = -1  # the owner's connection, as the monitor names it
        self._owner_gone = False
        self._reply_to: list[Any] | None = None

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def _owner_connected(self) -> bool:
        while self._monitor.poll(0):
            if int(recv_monitor_message(self._monitor)["value"]) == self._owner_fd:
                self._owner_gone = True
        return not self._owner_gone

    def recv(self) -> T:
        """The next request; ``BadFrame`` / ``WrongPeer`` (counted) when it
        does not decode or comes from another peer than the owner."""
        parts = self.sock.recv_multipart(copy=False)
        peer = parts[0].bytes
        cut = next((i for i, f in enumerate(parts[1:], 1) if not f.bytes), 0)  # the REQ envelope's delimiter
        self._reply_to = [parts[0], *parts[1:cut + 1]]
        msg = self._decode_parts(parts[cut + 1:])
        if peer != self.owner:
            pins = isinstance(msg, self._pin_on)
            if self.owner is not None and not (pins and not self._owner_connected()):
                err = WrongPeer("another peer owns this session; request refused")
                note_dropped(self.name, err)
                raise err
            if not pins:
                return msg
            self.owner = peer
        self._owner_connected()  # consume events of the connection this one replaces
        self._owner_fd, self._owner_gone = _source_fd(parts[-1]), False
        return msg

    def send(self, msg: msgspec.Struct) -> None:
        assert self._reply_to is not None, "send without a request"
        reply_to, self._reply_to = self._reply_to, None
        try:
            self.sock.send_multipart([*reply_to, _encoder.encode(msg)], copy=False)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            log.warning("%s: the peer left before its reply", self.name)

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        super().close()


class PushQueue(Generic[T]):
    """With ``stop``, a ``put`` blocked on a missing peer gives up (drops the
    message) once ``stop()`` is true: a stopping process must not hang there."""

    def __init__(self, ctx: zmq.Context[Any], addr: str, bind: bool, stop: Callable[[], bool] | None = None) -> None:
        self.addr = addr
        self._bound = bind
        self._stop = stop
        self._link = None if bind else resolve.link(addr, watched=False)
        self.sock = _open(ctx, zmq.PUSH, addr, bind, self._link)

    def put(self, msg: msgspec.Struct) -> None:
        if self._link is not None:
            resolve.follow(self.sock, self._link)
        data = _encoder.encode(msg)
        if self._stop is None:
            self.sock.send(data, copy=False)
            return
        while not self.sock.poll(POLL_MS, zmq.POLLOUT):
            if self._stop():
                log.warning("%s: stopping; a %s was not delivered", _socket_name(self.addr), type(msg).__name__)
                return
        self.sock.send(data, copy=False)

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        self.sock.close(linger=0)
        if self._bound:
            _cleanup_ipc(self.addr)


class PullQueue(_Typed[T]):
    def __init__(self, ctx: zmq.Context[Any], addr: str, msg_type: Any, bind: bool) -> None:
        self._link = None if bind else resolve.link(addr, watched=False)
        super().__init__(_open(ctx, zmq.PULL, addr, bind, self._link), msg_type, addr, bind)

    def _follow(self) -> None:
        if self._link is not None:
            resolve.follow(self.sock, self._link)

    def poll(self, timeout_ms: int) -> bool:
        self._follow()
        return bool(self.sock.poll(timeout_ms))

    def get(self) -> T:
        """The next message that decodes (bad frames are dropped)."""
        self._follow()
        while True:
            try:
                return self._decode_parts(self.sock.recv_multipart(copy=False))
            except BadFrame:
                continue

    def get_nowait(self) -> T | None:
        """The next message that decodes, or None when none is waiting."""
        self._follow()
        for _ in range(MAX_SKIP):
            try:
                return self._decode_parts(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return None
            except BadFrame:
                continue
    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        super().close()


class _AsyncFollow:
    """An asyncio socket that follows its host name to a new address, on its
    own event loop (resolve.py). A watched one (PUSH) reads its monitor to say
    whether it is connected; a PULL's monitor is its caller's (the frontend
    watches it for the scheduler's disconnects), so a PULL follows the address
    found for the host's watched sockets."""

    def __init__(self, sock: zmq.asyncio.Socket, link: resolve.Link) -> None:
        self.sock, self.link = sock, link
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = False
        self.start()

    def start(self) -> None:
        """Once, on the running loop (also called from put/get: a queue may be made before it runs)."""
        if self._started:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._started = True
        self.link.on_move = lambda: loop.call_soon_threadsafe(self.follow)
        if self.link.watched:
            self._monitor = self.sock.get_monitor_socket(resolve.WATCH_EVENTS)
            self._task = loop.create_task(self._watch())

    async def _watch(self) -> None:
        assert self._monitor is not None
        while True:
            ev = parse_monitor_message(await self._monitor.recv_multipart())
            self.link.note(int(ev["event"]), ev["endpoint"])
            self.follow()

    def follow(self) -> None:
        resolve.follow(self.sock, self.link)

    def close(self) -> None:
        self.link.on_move = None
        if self._task is not None:
            self._task.cancel()
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.link.close()


class AsyncPushQueue(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, bind: bool) -> None:
        self.addr = addr
        self._bound = bind
        link = None if bind else resolve.link(addr, watched=True)
        self.sock = _open(ctx, zmq.PUSH, addr, bind, link)
        self._follow = None if link is None else _AsyncFollow(self.sock, link)

    async def put(self, msg: msgspec.Struct) -> None:
        if self._follow is not None:
            self._follow.start()
        await self.sock.send(_encoder.encode(msg), copy=False)

    def close(self) -> None:
        if self._follow is not None:
            self._follow.close()
        self.sock.close(linger=0)
        if self._bound:
            _cleanup_ipc(self.addr)


class AsyncPullQueue(_Typed[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, msg_type: Any, bind: bool) -> None:
        link = None if bind else resolve.link(addr, watched=False)
        super().__init__(_open(ctx, zmq.PULL, addr, bind, link), msg_type, addr, bind)
        self._follow = None if link is None else _AsyncFollow(self.sock, link)

    async def get(self) -> T:
        """The next message that decodes (bad frames are dropped)."""
        if self._follow is not None:
            self._follow.start()
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            try:
                return self._decode_parts(parts)
            except BadFrame:
                continue

    def close(self) -> None:
        if self._follow is not None:
            self._follow.close()
        super().close()
