"""What the typed ZeroMQ queues of ``ipc`` share: their errors, the count of
dropped frames, opening a socket (CurveZMQ keys, heartbeats, the address a
host name resolves to) and decoding one message. Import these from ``ipc``.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Generic, TypeVar

import msgspec
import zmq

from pagedserve.common import curve, resolve
from pagedserve.common.messages.types import RefusalKind
from pagedserve.common.rundir import ensure_private_dir

T = TypeVar("T")

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


def _open(ctx: zmq.Context[Any], kind: int, addr: str, bind: bool, link: resolve.Link | None = None,
          routing_id: bytes | None = None) -> zmq.Socket[Any]:
    """``link``: connect where it says (a host name's address), not to ``addr``."""
    if addr.startswith("ipc://"):
        # Raises UnsafeRunDir before anything is created in a foreign folder.
        ensure_private_dir(os.path.dirname(addr[len("ipc://"):]))
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # libzmq takes any greeting that does not start with 0xff as a ZMTP 1.0 peer
    # and gives it a pipe: a PUSH then hands it every n-th frame, lost when it
    # hangs up. A ZAP domain makes libzmq refuse ZMTP 1.0/2.0 peers (ours all
    # speak 3.x); with no ZAP handler running, NULL-mechanism peers still pass.
    sock.setsockopt(zmq.ZAP_DOMAIN, b"pagedserve")
    if kind == zmq.REQ:
        # A fixed routing id (set before connecting) survives reconnects, so a
        # server keeps this client as its session owner (RepServer).
        sock.setsockopt(zmq.ROUTING_ID, routing_id or b"req-" + os.urandom(12))
    try:
        curve.secure(sock, addr, bind, curve.from_env())
        if addr.startswith("tcp://"):
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if bind:
            if addr.startswith("ipc://"):
                _cleanup_ipc(addr)
            sock.bind(addr)
        else:
            resolve.connect(sock, addr if link is None else link.endpoint)
    except BaseException:
        sock.close(linger=0)
        if link is not None:
            link.close()  # else its host would be resolved again for ever
        raise
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
