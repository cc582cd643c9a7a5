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
    grpc_stop = asyncio.create_task(server.stop(grace=max(timeout_s, 1.0)))
    deadline = time.monotonic() + timeout_s
    while engine.num_streams and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_streams:  # time is up: cut the rest
        await server.stop(grace=0.0)
    await grpc_stop
    if gateway is not None:
        await gateway.cleanup()
