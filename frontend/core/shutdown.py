"""Graceful stop of the frontend: no new work, in-flight requests finish.

The first SIGTERM/SIGINT stops admission and waits for the open streams,
up to ``--shutdown-timeout`` (default 30 s); the wait ends as soon as none
is open. A second signal (vLLM's second Ctrl-C) stops at once: the streams
still open end with UNAVAILABLE and a message that says why."""
from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

from aiohttp import web

from pagedserve.frontend.core.engine_client import EngineClient


class StopSignals:
    """``first`` is set by the first SIGTERM/SIGINT, ``again`` by a later one."""

    def __init__(self) -> None:
        self.first = asyncio.Event()
        self.again = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        (self.again if self.first.is_set() else self.first).set()


async def drain(server: Any, gateway: web.AppRunner | None, engine: EngineClient, timeout_s: float,
                hurry: asyncio.Event | None = None) -> None:
    """Stop accepting requests on both APIs, wait up to ``timeout_s`` for the
    open streams to end (0: do not wait; ``hurry`` set: stop waiting), then
    close both servers."""
    if gateway is not None:
        for site in list(gateway.sites):
            await site.stop()  # closes the listener only; open requests go on
    # grpc's stop refuses new RPCs at once and lets running ones finish within the grace.
    # Its grace outlasts ours, so the streams still open at our deadline get our error, not grpc's GOAWAY.
    grpc_stop = asyncio.create_task(server.stop(grace=timeout_s + 2.0))
    deadline = time.monotonic() + timeout_s
    while engine.num_streams and time.monotonic() < deadline and not (hurry and hurry.is_set()):
        await asyncio.sleep(0.05)
    if engine.num_streams:  # time is up: end the rest with a clear error (UNAVAILABLE), then cut
        why = "a second stop signal" if hurry and hurry.is_set() else f"shutdown timeout of {timeout_s:g} s passed"
        engine.fail_all(f"unavailable: the server is shutting down ({why})")
        for _ in range(20):  # bounded: let the handlers send it
            if not engine.num_streams:
                break
            await asyncio.sleep(0.05)
        await server.stop(grace=0.0)
    await grpc_stop
    if gateway is not None:
        await gateway.cleanup()
