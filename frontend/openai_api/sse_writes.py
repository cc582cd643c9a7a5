"""Coalesced server-sent events: every event one stream has ready after a
step goes out in one write (one ``send`` and one chunk of the chunked body,
instead of one per event), with no waiting for more: a batch is flushed as
soon as the stream's waiting chunks are formatted, so no event is later
than it would be alone.

The bytes are those of ``http_response.sse`` (``data: <json.dumps>\\n\\n``), so
a client reads the same events either way; only the TCP segmentation
changes. Used by the SSE loops: ``batch.add(payload)`` where they called
``await sse(resp, payload)``, then ``await batch.flush(resp)`` once the
chunks of one ``RequestStream.next()`` (or every item waiting on a
completions fan-in queue) are done.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def sse_bytes(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class SseBatch:
    """The events of one step for one response."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def add(self, payload: dict[str, Any]) -> None:
        self._parts.append(sse_bytes(payload))

    def add_raw(self, data: bytes) -> None:
        """Bytes already formatted (``data: [DONE]\\n\\n``)."""
        self._parts.append(data)

    def __len__(self) -> int:
        return len(self._parts)

    async def flush(self, resp: web.StreamResponse) -> None:
        """One write of everything added since the last flush (nothing if empty)."""
        if not self._parts:
            return
        data = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        self._parts.clear()
        await resp.write(data)
