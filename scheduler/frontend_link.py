"""The scheduler's side of its frontend (issue 11): outputs are pushed
without ever blocking on a frontend that died, and a frontend's disconnect
is noticed so the engine aborts its requests (their clients are gone) and
frees their blocks; a restarted frontend connects again and serves."""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pagedserve.common import ipc
from pagedserve.common.messages import frontend as fe

NO_FRONTEND_GRACE_S = 2.0  # a frontend that just sent a query may not have its output pipe yet


class FrontendLink:
    """Wraps the output queue; build the queue with ``stop=link.give_up``."""

    def __init__(self, stop: Callable[[], bool]) -> None:
        self._stop = stop
        self.outbox: ipc.PushQueue[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self.connected = 0
        self._lost = False
        self._all_gone = False  # a disconnect left no peer connected (since the last lost())
        self._since = 0.0  # when the put in progress began
        self._epoch = int.from_bytes(os.urandom(7), "big") + 1  # this process's Outputs numbering
        self._seq = 0

    def attach(self, outbox: ipc.PushQueue[Any]) -> None:
        self.outbox = outbox
        self._monitor = outbox.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)

    def _events(self) -> None:
        while self._monitor is not None and self._monitor.poll(0):
            ev = recv_monitor_message(self._monitor)["event"]
            if ev == zmq.EVENT_ACCEPTED:
                self.connected += 1
            elif ev == zmq.EVENT_DISCONNECTED:
                self.connected = max(0, self.connected - 1)
                self._lost = True
                # No peer left at that moment: the frontend went away, even if a restarted
                # one (it starts in under a second) has connected again since.
                self._all_gone = self._all_gone or self.connected == 0

    def lost(self) -> bool:
        """Whether a frontend disconnected since the last call. A disconnect
        while a peer is still connected and writable is a stray connection
        (raw bytes that never finished the ZeroMQ handshake), not the frontend."""
        self._events()
        if not self._lost:
            return False
        all_gone, self._lost, self._all_gone = self._all_gone, False, False
        assert self.outbox is not None
        return all_gone or self.connected == 0 or not self.outbox.sock.poll(0, zmq.POLLOUT)

    def give_up(self) -> bool:
        """The queue's stop test while a put waits: on SIGTERM, or with no
        frontend connected for ``NO_FRONTEND_GRACE_S`` (its reader is gone)."""
        self._events()
        return self._stop() or (self.connected == 0 and time.monotonic() - self._since > NO_FRONTEND_GRACE_S)

    def put(self, msg: msgspec.Struct) -> None:
        assert self.outbox is not None
        if isinstance(msg, fe.Outputs):  # the one place Outputs leave: number them here
            msg.epoch, msg.seq = self._epoch, self._seq
            self._seq += 1
        elif isinstance(msg, fe.EngineStats):  # what was sent before it, on the same ordered pipe
            msg.epoch, msg.outputs_sent = self._epoch, self._seq
        self._since = time.monotonic()
        self.outbox.put(msg)

    def close(self) -> None:
        if self.outbox is not None and self._monitor is not None:
            self.outbox.sock.disable_monitor()
            self._monitor.close(linger=0)
