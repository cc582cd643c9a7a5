"""Connection-level bounds of the HTTP gateway, so that slow or idle clients
cannot hold the server's sockets forever.

* **Headers** (and idle keep-alive): aiohttp's keep-alive timer starts when a
  connection opens and again after each response, and closes the connection if
  no complete request head has arrived by then; a client that sends its headers
  byte by byte is closed after ``header_timeout_s`` all the same.
* **Body**: once the head is in, the whole body must arrive within
  ``body_timeout_s``, else 408 and the connection is closed at once.
* **Connections**: past ``max_connections`` open connections a new one makes
  the oldest idle one (no request in a handler: between requests, or still
  sending its head) close; when every one is busy, the newcomer gets a 503 and
  is closed.

Each reads a ``PAGEDSERVE_HTTP_*`` environment variable (tests shorten them).

A request aiohttp cannot parse (a header with a NUL byte, a bad request line) is
answered 400 by aiohttp and logged here as one WARNING line, without a traceback:
it is the client's fault, not the server's.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from pagedserve.common.env import env
from pagedserve.frontend.core.errors import ApiError

HEADER_TIMEOUT_S = 15.0  # a request head must be complete this long after connect / the last response
BODY_TIMEOUT_S = 30.0  # the whole body (at most 4 MiB) after its head: >= 140 kB/s
MAX_CONNECTIONS = 1024  # open HTTP connections, idle ones included
LINGER_S = 2.0  # after an answer sent before the body was read (e.g. 413), discard the rest this long

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _ClientFaultFilter(logging.Filter):
    """aiohttp logs a request it could not parse with ``logger.exception`` (an ERROR and a
    traceback); this turns such a record into one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 400) < 500:
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg, record.args = "bad HTTP request from %s answered %d: %.200r", (remote, exc.code or 400,
                                                                                   exc.message)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info, record.exc_text = None, None
        return True


logging.getLogger("aiohttp.server").addFilter(_ClientFaultFilter())


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    @classmethod
    def from_env(cls) -> "HttpLimits":
        def get(name: str, default: float, kind: type) -> Any:
            raw = env(f"HTTP_{name}")
            try:
                value = kind(raw) if raw else default
            except ValueError:
                raise SystemExit(f"pagedserve frontend: PAGEDSERVE_HTTP_{name}={raw!r} is not a number") from None
            if not 0 < value < float("inf"):
                raise SystemExit(f"pagedserve frontend: PAGEDSERVE_HTTP_{name} must be positive and finite")
            return value

        return cls(get("HEADER_TIMEOUT", HEADER_TIMEOUT_S, float), get("BODY_TIMEOUT", BODY_TIMEOUT_S, float),
                   get("MAX_CONNECTIONS", MAX_CONNECTIONS, int))

    def runner_kwargs(self) -> dict[str, Any]:
        """aiohttp RequestHandler options."""
        return {"keepalive_timeout": self.header_timeout_s, "lingering_time": LINGER_S}


class ClosingError(ApiError):
    """An ApiError after which the connection is closed (its body was not read in time)."""


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise ClosingError(408, f"body: not received within {timeout_s:g} s", param="body",
                           code="request_timeout") from None


async def send_and_close(request: web.Request, err: ClosingError) -> web.StreamResponse:
    """Answers ``err`` and closes the connection, without waiting for the rest of the body."""
    resp = err.response()
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    request.protocol.force_close()  # the write is flushed before the socket closes
    return resp


def _refusal(max_connections: int) -> bytes:
    body = json.dumps(ApiError(503, f"too many open connections (at most {max_connections})").body())
    return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\nRetry-After: 1\r\n\r\n{body}").encode()


class ConnectionGuard:
    """Bounds the open connections of one aiohttp ``web.Server``; knows which are busy
    through ``middleware`` (a connection is busy while one of its requests is in a handler)."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._busy: set[RequestHandler] = set()  # aiohttp runs one request per connection at a time

    def attach(self, server: web.Server) -> None:
        made = server.connection_made

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            self._admit(server, handler, transport)

        server.connection_made = connection_made  # type: ignore[method-assign]

    def _admit(self, server: web.Server, handler: RequestHandler, transport: asyncio.Transport) -> None:
        # Connections whose socket closed may linger in the list until their task ends.
        open_ = [h for h in server.connections if h.transport is not None]
        if len(open_) <= self.max_connections:
            return
        idle = next((h for h in open_ if h is not handler and h not in self._busy), None)  # oldest first
        if idle is not None:
            idle.force_close()
            return
        transport.write(_refusal(self.max_connections))
        handler.force_close()  # before its request loop starts: it reads nothing

    @web.middleware
    async def middleware(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        self._busy.add(request.protocol)
        try:
            return await handler(request)
        finally:
            self._busy.discard(request.protocol)
