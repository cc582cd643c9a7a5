"""Graceful stop of the frontend: no new work, in-flight requests finish."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from pagedserve.frontend.engine_client import EngineClient


async def drain(server: Any, gateway: web.AppRunner | None, engine: EngineClient, timeout_s: float) -> None:
    """Stop accepting requests on both APIs, wait up to ``timeout_s`` for the
    open streams to end (0: do not wait), then close both servers."""
    if gateway is not None:
        for site in list(gateway.sites):
            await site.stop()  # closes the listener only; open requests go on
    # grpc's stop refuses new RPCs at once and lets running ones finish within the grace.
    # Its grace outlasts ours, so the streams still open at our deadline get our error, not grpc's GOAWAY.
    grpc_stop = asyncio.create_task(server.stop(grace=timeout_s + 2.0))
    deadline = time.monotonic() + timeout_s
    while engine.num_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_streams:  # time is up: end the rest with a clear error (UNAVAILABLE), then cut
        engine.fail_all(f"unavailable: the server is shutting down (shutdown timeout of {timeout_s:g} s passed)")
        for _ in range(20):  # bounded: let the handlers send it
            if not engine.num_streams:
                break
            await asyncio.sleep(0.05)
        await server.stop(grace=0.0)
    await grpc_stop
    if gateway is not None:
        await gateway.cleanup()
