"""Tiny typed ZeroMQ queues: msgpack via msgspec, one message union per socket.

Internal sockets default to ``ipc://`` paths (see ``config.default_addresses``)
or loopback; nothing here ever unpickles.
"""
from __future__ import annotations

import os
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from pagedserve.common import curve

T = TypeVar("T")
R = TypeVar("R")

_encoder = msgspec.msgpack.Encoder()


class ChannelTimeout(TimeoutError):
    """The peer did not answer in time (it may be gone)."""


def _cleanup_ipc(addr: str) -> None:
    if addr.startswith("ipc://"):
        path = addr[len("ipc://"):]
        if os.path.exists(path):
            os.unlink(path)


def _open(ctx: zmq.Context[Any], kind: int, addr: str, bind: bool) -> zmq.Socket[Any]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    curve.secure(sock, addr, bind, curve.from_env())
    if bind:
        if addr.startswith("ipc://"):
            os.makedirs(os.path.dirname(addr[len("ipc://"):]) or ".", exist_ok=True)
            _cleanup_ipc(addr)
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class _Typed(Generic[T]):
    def __init__(self, sock: zmq.Socket[Any], recv_type: Any, addr: str, bind: bool) -> None:
        self.sock = sock
        self.addr = addr
        self._bound = bind
        self._decoder = msgspec.msgpack.Decoder(recv_type)

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

    def call(self, msg: msgspec.Struct, timeout_s: float | None = None) -> R:
        self.sock.send(_encoder.encode(msg), copy=False)
        if timeout_s is not None and not self.sock.poll(int(timeout_s * 1000)):
            raise ChannelTimeout(f"no reply from {self.addr} within {timeout_s}s")
        return self._decoder.decode(self.sock.recv(copy=False).buffer)


class RepServer(_Typed[T]):
    """Blocking reply server (REP socket): recv, then send exactly one reply."""

    def __init__(self, ctx: zmq.Context[Any], addr: str, request_type: Any) -> None:
        super().__init__(_open(ctx, zmq.REP, addr, bind=True), request_type, addr, bind=True)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def recv_raw(self) -> memoryview:
        return self.sock.recv(copy=False).buffer

    def decode(self, raw: memoryview) -> T:
        return self._decoder.decode(raw)

    def recv(self) -> T:
        return self.decode(self.recv_raw())

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(_encoder.encode(msg), copy=False)


class PushQueue(Generic[T]):
    def __init__(self, ctx: zmq.Context[Any], addr: str, bind: bool) -> None:
        self.addr = addr
        self._bound = bind
        self.sock = _open(ctx, zmq.PUSH, addr, bind)

    def put(self, msg: msgspec.Struct) -> None:
        self.sock.send(_encoder.encode(msg), copy=False)

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
        return self._decoder.decode(self.sock.recv(copy=False).buffer)

    def get_nowait(self) -> T | None:
        try:
            return self._decoder.decode(self.sock.recv(zmq.NOBLOCK, copy=False).buffer)
        except zmq.Again:
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
        frame = await self.sock.recv(copy=False)
        return self._decoder.decode(frame.buffer)
