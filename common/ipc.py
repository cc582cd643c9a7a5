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

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from pagedserve.common import curve
from pagedserve.common.messages.types import RefusalKind
from pagedserve.common.rundir import ensure_private_dir

T = TypeVar("T")
R = TypeVar("R")

_encoder = msgspec.msgpack.Encoder()


log = logging.getLogger("pagedserve.ipc")
LOG_EVERY_S = 10.0
MAX_SKIP = 10_000  # bad frames skipped per get() before giving the caller control back
POLL_MS = 100  # a waiting call checks its stop flag and its peer this often
# ZMTP heartbeats (answered by the peer's ZeroMQ I/O thread, even mid-step):
# a silent tcp peer counts as disconnected after HEARTBEAT_TIMEOUT_MS.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000


class ChannelTimeout(TimeoutError):
    """The peer did not answer in time (it may be gone)."""


class PeerLost(ConnectionError):
    """The peer disconnected while a reply was awaited: it will never come."""


class Interrupted(InterruptedError):
    """The caller's stop flag was set while waiting for a reply."""


class BadFrame(ValueError):
    """A frame that does not decode as the socket's message union."""

    kind = RefusalKind.BAD_FRAME


class WrongPeer(BadFrame):
    """A well-formed request from a peer that does not own the session."""

    kind = RefusalKind.WRONG_PEER


_dropped: dict[str, int] = {}
_last_log: dict[str, float] = {}
_lock = threading.Lock()


def dropped_frames() -> dict[str, int]:
    """Frames dropped so far in this process, per socket name."""
    with _lock:
        return dict(_dropped)


def note_dropped(socket: str, err: BaseException) -> None:
    with _lock:
        n = _dropped[socket] = _dropped.get(socket, 0) + 1
        now = time.monotonic()
        if now - _last_log.get(socket, -LOG_EVERY_S) < LOG_EVERY_S:
            return
        _last_log[socket] = now
    log.warning("dropped a malformed frame on %s (%d so far): %s", socket, n, str(err)[:200])


def _socket_name(addr: str) -> str:
    """A metrics label: the ipc file's stem, or the tcp address."""
    if addr.startswith("ipc://"):
        return os.path.basename(addr).rsplit(".", 1)[0] or addr
    return addr


def _cleanup_ipc(addr: str) -> None:
    if addr.startswith("ipc://"):
        path = addr[len("ipc://"):]
        if os.path.exists(path):
            os.unlink(path)


def _open(ctx: zmq.Context[Any], kind: int, addr: str, bind: bool) -> zmq.Socket[Any]:
    if addr.startswith("ipc://"):
        # Raises UnsafeRunDir before anything is created in a foreign folder.
        ensure_private_dir(os.path.dirname(addr[len("ipc://"):]))
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.REQ:
        # A fixed routing id (set before connecting) survives reconnects, so a
        # server keeps this client as its session owner (RepServer).
        sock.setsockopt(zmq.ROUTING_ID, b"req-" + os.urandom(12))
    try:
        curve.secure(sock, addr, bind, curve.from_env())
    except BaseException:
        sock.close(linger=0)
        raise
    if addr.startswith("tcp://"):
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    if bind:
        if addr.startswith("ipc://"):
            _cleanup_ipc(addr)
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class _Typed(Generic[T]):
    def __init__(self, sock: zmq.Socket[Any], recv_type: Any, addr: str, bind: bool) -> None:
        self.sock = sock
        self.addr = addr
        self.name = _socket_name(addr)
        self._bound = bind
        self._decoder = msgspec.msgpack.Decoder(recv_type)

    def _decode_parts(self, parts: list[Any]) -> T:
        """Decodes a whole message (one part); raises ``BadFrame`` after counting it."""
        try:
            if len(parts) != 1:
                raise BadFrame(f"{len(parts)}-part message; expected one frame")
            return self._decoder.decode(parts[0].buffer)  # type: ignore[no-any-return]
        except (msgspec.DecodeError, BadFrame) as e:
            err = e if isinstance(e, BadFrame) else BadFrame(str(e))
            note_dropped(self.name, err)
            raise err from None

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._bound:
            _cleanup_ipc(self.addr)


class ReqClient(_Typed[R]):
    """Blocking request/reply client with a timeout (REQ socket)."""

    def __init__(self, ctx: zmq.Context[Any], addr: str, reply_type: Any) -> None:
        super().__init__(_open(ctx, zmq.REQ, addr, bind=False), reply_type, addr, bind=False)
        # A timed-out REQ socket may be reused: the next send starts a new round trip.
        self.sock.setsockopt(zmq.REQ_RELAXED, 1)
        self.sock.setsockopt(zmq.REQ_CORRELATE, 1)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def _peer_lost(self) -> bool:
        lost = False
        while self._monitor.poll(0):
            recv_monitor_message(self._monitor)
            lost = True
        return lost

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
        self.sock.send(_encoder.encode(msg), copy=False)

    def reply(self, timeout_s: float | None = None, stop: Callable[[], bool] | None = None) -> R:
        """The reply half of ``call`` (its errors)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = POLL_MS if deadline is None else max(0, min(POLL_MS, int((deadline - time.monotonic()) * 1000)))
            if self.sock.poll(wait):
                break
            if stop is not None and stop():
                raise Interrupted(f"stopped while waiting for {self.addr}")
            if self._peer_lost():
                raise PeerLost(f"{self.addr} disconnected while a reply was awaited")
            if deadline is not None and time.monotonic() >= deadline:
                raise ChannelTimeout(f"no reply from {self.addr} within {timeout_s}s")
        return self._decode_parts(self.sock.recv_multipart(copy=False))

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
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
        self.sock = _open(ctx, zmq.PUSH, addr, bind)

    def put(self, msg: msgspec.Struct) -> None:
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
        self.sock.close(linger=0)
        if self._bound:
            _cleanup_ipc(self.addr)


class PullQueue(_Typed[T]):
    def __init__(self, ctx: zmq.Context[Any], addr: str, msg_type: Any, bind: bool) -> None:
        super().__init__(_open(ctx, zmq.PULL, addr, bind), msg_type, addr, bind)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def get(self) -> T:
        """The next message that decodes (bad frames are dropped)."""
        while True:
            try:
                return self._decode_parts(self.sock.recv_multipart(copy=False))
            except BadFrame:
                continue

    def get_nowait(self) -> T | None:
        """The next message that decodes, or None when none is waiting."""
        for _ in range(MAX_SKIP):
            try:
                return self._decode_parts(self.sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                return None
            except BadFrame:
                continue
        return None


class AsyncPushQueue(Generic[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, bind: bool) -> None:
        self.addr = addr
        self._bound = bind
        self.sock = _open(ctx, zmq.PUSH, addr, bind)

    async def put(self, msg: msgspec.Struct) -> None:
        await self.sock.send(_encoder.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self._bound:
            _cleanup_ipc(self.addr)


class AsyncPullQueue(_Typed[T]):
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, msg_type: Any, bind: bool) -> None:
        super().__init__(_open(ctx, zmq.PULL, addr, bind), msg_type, addr, bind)

    async def get(self) -> T:
        """The next message that decodes (bad frames are dropped)."""
        while True:
            parts = await self.sock.recv_multipart(copy=False)
            try:
                return self._decode_parts(parts)
            except BadFrame:
                continue
