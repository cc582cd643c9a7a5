"""The frontend's side of the scheduler queues: one reader task fans the
scheduler's per-step output batches out to per-request asyncio queues, and a
watchdog asks the scheduler for stats at a fixed interval: no answer within
the timeout marks the engine lost (health goes NOT_SERVING and every open
stream ends with an error) until it answers again."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Callable

import zmq.asyncio

from pagedserve.common import ipc
from pagedserve.common.config import Addresses
from pagedserve.common.messages import frontend as fe

log = logging.getLogger("pagedserve.frontend")

Item = tuple[float, fe.TokenDelta]  # (time the batch arrived, delta)


class DuplicateRequestId(ValueError):
    pass


class EngineUnavailable(RuntimeError):
    pass


class EngineClient:
    def __init__(self, addrs: Addresses, send_timeout_s: float = 5.0) -> None:
        self._ctx = zmq.asyncio.Context()
        self._push: ipc.AsyncPushQueue[fe.Request] = ipc.AsyncPushQueue(self._ctx, addrs.scheduler_in, bind=False)
        self._pull: ipc.AsyncPullQueue[fe.Reply] = ipc.AsyncPullQueue(self._ctx, addrs.scheduler_out, fe.Reply,
                                                                      bind=False)
        self._send_timeout_s = send_timeout_s
        self._streams: dict[str, asyncio.Queue[Item]] = {}
        self._queries: dict[int, asyncio.Future[Any]] = {}
        self._query_ids = itertools.count(1)
        self._reader: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        self.info: fe.EngineInfo | None = None
        self.last_stats: fe.EngineStats | None = None
        self.healthy = False

    async def start(self, timeout_s: float) -> fe.EngineInfo:
        self._reader = asyncio.create_task(self._read_loop())
        info = await self._query(lambda q: fe.InfoQuery(q), timeout_s)
        assert isinstance(info, fe.EngineInfo)
        self.info = info
        self.healthy = True
        return info

    def watch(self, interval_s: float, timeout_s: float, on_change: Callable[[bool], Any]) -> None:
        """Start the watchdog; ``on_change(healthy)`` runs on every change."""
        self._watchdog = asyncio.create_task(self._watch(interval_s, timeout_s, on_change))

    async def _watch(self, interval_s: float, timeout_s: float, on_change: Callable[[bool], Any]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.stats(timeout_s)
                ok = True
            except (asyncio.TimeoutError, EngineUnavailable):
                ok = False
            if ok != self.healthy:
                self.healthy = ok
                if not ok:
                    log.error("scheduler did not answer within %.1fs: NOT_SERVING", timeout_s)
                    self.fail_all("the engine is unavailable (scheduler not answering)")
                else:
                    log.info("scheduler answers again: SERVING")
                res = on_change(ok)
                if asyncio.iscoroutine(res):
                    await res

    async def close(self) -> None:
        for task in (self._reader, self._watchdog):
            if task:
                task.cancel()
        self._push.close()
        self._pull.close()
        self._ctx.term()

    async def _read_loop(self) -> None:
        while True:
            msg = await self._pull.get()
            if isinstance(msg, fe.Outputs):
                now = time.monotonic()
                for d in msg.deltas:
                    q = self._streams.get(d.request_id)
                    if q is not None:
                        q.put_nowait((now, d))
            else:
                if isinstance(msg, fe.EngineStats):
                    self.last_stats = msg
                fut = self._queries.pop(msg.query_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _send(self, msg: Any) -> None:
        # A PUSH socket with no connected peer blocks: a lost scheduler must not hang callers.
        try:
            await asyncio.wait_for(self._push.put(msg), self._send_timeout_s)
        except asyncio.TimeoutError as e:
            raise EngineUnavailable("the scheduler is not accepting requests") from e

    async def _query(self, make: Any, timeout_s: float) -> Any:
        qid = next(self._query_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queries[qid] = fut

        async def round_trip() -> Any:
            await self._push.put(make(qid))
            return await fut

        try:
            return await asyncio.wait_for(round_trip(), timeout_s)
        finally:
            self._queries.pop(qid, None)

    async def stats(self, timeout_s: float = 10.0) -> fe.EngineStats:
        return await self._query(lambda q: fe.StatsQuery(q), timeout_s)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    async def add_request(self, req: fe.AddRequest) -> asyncio.Queue[Item]:
        if req.request_id in self._streams:
            raise DuplicateRequestId(req.request_id)
        if not self.healthy:
            raise EngineUnavailable("the engine is unavailable")
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._streams[req.request_id] = q
        try:
            await self._send(req)
        except BaseException:
            self._streams.pop(req.request_id, None)
            raise
        return q

    def release(self, request_id: str, abort: bool) -> None:
        """Forget a stream; tell the engine to abort it if it did not finish.
        Safe to call from a cancelled handler: the abort is sent by a task."""
        self._streams.pop(request_id, None)
        if abort:
            task = asyncio.get_running_loop().create_task(self._send_quietly(fe.AbortRequest([request_id])))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def _send_quietly(self, msg: Any) -> None:
        try:
            await self._send(msg)
        except EngineUnavailable:
            log.warning("could not send %s: scheduler unavailable", type(msg).__name__)

    async def abort(self, request_ids: list[str]) -> int:
        known = [r for r in request_ids if r in self._streams]
        await self._send(fe.AbortRequest(request_ids))
        return len(known)

    def fail_all(self, error: str) -> None:
        """End every open stream with an error delta (the engine is gone)."""
        now = time.monotonic()
        for rid, q in list(self._streams.items()):
            q.put_nowait((now, fe.TokenDelta(rid, 0, [], "error", 0, error)))
