"""The frontend's side of the scheduler queues: one reader task fans the
scheduler's per-step output batches out to per-request asyncio queues."""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import zmq.asyncio

from pagedserve.common import ipc
from pagedserve.common.config import Addresses
from pagedserve.common.messages import frontend as fe

log = logging.getLogger("pagedserve.frontend")


class DuplicateRequestId(ValueError):
    pass


class EngineClient:
    def __init__(self, addrs: Addresses) -> None:
        self._ctx = zmq.asyncio.Context()
        self._push: ipc.AsyncPushQueue[fe.Request] = ipc.AsyncPushQueue(self._ctx, addrs.scheduler_in, bind=False)
        self._pull: ipc.AsyncPullQueue[fe.Reply] = ipc.AsyncPullQueue(self._ctx, addrs.scheduler_out, fe.Reply,
                                                                      bind=False)
        self._streams: dict[str, asyncio.Queue[fe.TokenDelta]] = {}
        self._queries: dict[int, asyncio.Future[Any]] = {}
        self._query_ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[None]] = set()
        self.info: fe.EngineInfo | None = None

    async def start(self, timeout_s: float) -> fe.EngineInfo:
        self._reader = asyncio.create_task(self._read_loop())
        info = await self._query(lambda q: fe.InfoQuery(q), timeout_s)
        assert isinstance(info, fe.EngineInfo)
        self.info = info
        return info

    async def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self._push.close()
        self._pull.close()
        self._ctx.term()

    async def _read_loop(self) -> None:
        while True:
            msg = await self._pull.get()
            if isinstance(msg, fe.Outputs):
                for d in msg.deltas:
                    q = self._streams.get(d.request_id)
                    if q is not None:
                        q.put_nowait(d)
            else:
                fut = self._queries.pop(msg.query_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _query(self, make: Any, timeout_s: float) -> Any:
        qid = next(self._query_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut
        try:
            await self._push.put(make(qid))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._queries.pop(qid, None)

    async def stats(self, timeout_s: float = 10.0) -> fe.EngineStats:
        return await self._query(lambda q: fe.StatsQuery(q), timeout_s)

    async def add_request(self, req: fe.AddRequest) -> asyncio.Queue[fe.TokenDelta]:
        if req.request_id in self._streams:
            raise DuplicateRequestId(req.request_id)
        q: asyncio.Queue[fe.TokenDelta] = asyncio.Queue()
        self._streams[req.request_id] = q
        await self._push.put(req)
        return q

    def release(self, request_id: str, abort: bool) -> None:
        """Forget a stream; tell the engine to abort it if it did not finish.
        Safe to call from a cancelled handler: the abort is sent by a task."""
        self._streams.pop(request_id, None)
        if abort:
            task = asyncio.get_running_loop().create_task(self._push.put(fe.AbortRequest([request_id])))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def abort(self, request_ids: list[str]) -> int:
        known = [r for r in request_ids if r in self._streams]
        await self._push.put(fe.AbortRequest(request_ids))
        return len(known)
