"""The frontend's side of the scheduler queues: one reader task fans the
scheduler's per-step output batches out to per-request asyncio queues, and a
watchdog asks the scheduler for stats at a fixed interval. The scheduler
answers even while a step runs (scheduler/control.py), so a slow engine is
only *degraded* (its stats say how long the step has run); no answer within
the timeout means the scheduler itself is stuck: health goes NOT_SERVING
until it answers again, and open streams are kept, since a live process may
still finish them (issue 19: slow is not dead). A scheduler that
disconnects (killed, restarted) is waited for: its in-flight requests are
re-sent to the new one with the tokens already streamed (see resume.py).
While the scheduler recovers a killed gpuworker or blockmgr, new requests wait
for it too, up to ``recovery_wait_s`` (then they are refused: 503 with
Retry-After, UNAVAILABLE with retry metadata)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Callable

import zmq.asyncio

from pagedserve.common import ipc
from pagedserve.common.config import Addresses
from pagedserve.common.metrics import DEGRADED_AFTER_S
from pagedserve.common.messages import frontend as fe
from pagedserve.frontend.core.resume import ResumeBook

log = logging.getLogger("pagedserve.frontend")

Item = tuple[float, fe.TokenDelta]  # (time the batch arrived, delta)


class DuplicateRequestId(ValueError):
    pass


class EngineUnavailable(RuntimeError):
    pass


class FrameCheck:
    """Checks the numbering of the scheduler's Outputs (epoch, seq)."""

    def __init__(self) -> None:
        self._epoch: int | None = None
        self._next = 0

    def missing(self, out: fe.Outputs | fe.EngineStats) -> int:
        """How many Outputs were skipped before this message (0: none): an
        Outputs is number ``seq``; an EngineStats follows ``outputs_sent`` of
        them, so a lost last frame shows by the next watchdog answer. The first
        message of a frontend that started beside a running scheduler sets the
        count; a new scheduler (another epoch) must start from 0."""
        if not out.epoch:  # an unnumbered message (an in-process engine, an older peer)
            return 0
        first = self._epoch is None
        if out.epoch != self._epoch:
            self._epoch, self._next = out.epoch, 0
        upto = out.seq if isinstance(out, fe.Outputs) else out.outputs_sent
        gap = 0 if first else max(0, upto - self._next)
        self._next = max(self._next, upto + isinstance(out, fe.Outputs))
        return gap


# A component's recovery takes ~4 s on an idle server (restart, weights, KV pool); a new
# request waits this long for it before it is refused.
RECOVERY_WAIT_S = 15.0


class EngineClient:
    def __init__(self, addrs: Addresses, send_timeout_s: float = 5.0, resume_timeout_s: float = 60.0,
                 recovery_wait_s: float = RECOVERY_WAIT_S) -> None:
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
        self._unanswered = False  # the watchdog's last query got no answer (a stuck or slow scheduler)
        self._on_change: Callable[[bool], Any] | None = None
        self._book = ResumeBook()
        self._resume_timeout_s = resume_timeout_s  # a scheduler not back by then: streams end with an error
        self._resuming = False
        self._resumed = asyncio.Event()  # clear while resuming: new requests wait for it
        self._resumed.set()
        self._recovery_wait_s = recovery_wait_s
        self._recovering = False  # the scheduler said it recovers a component: new requests wait
        self._serving = asyncio.Event()  # set while healthy
        self._health_news = 0  # unsolicited health messages so far: a watchdog answer older than one is stale
        self._link: asyncio.Task[None] | None = None
        self._monitor: Any = None
        self._frames = FrameCheck()
        self.on_outputs: Callable[[list[fe.TokenDelta]], None] | None = None  # each step's batch (metrics)

    async def start(self, timeout_s: float) -> fe.EngineInfo:
        self._reader = asyncio.create_task(self._read_loop())
        self._monitor = self._pull.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._link = asyncio.create_task(self._watch_link())
        info = await self._query(lambda q: fe.InfoQuery(q), timeout_s)
        assert isinstance(info, fe.EngineInfo)
        self.info = info
        self.healthy = True
        self._serving.set()
        return info

    def watch(self, interval_s: float, timeout_s: float, on_change: Callable[[bool], Any]) -> None:
        """Start the watchdog; ``on_change(healthy)`` runs on every change."""
        self._on_change = on_change
        self._watchdog = asyncio.create_task(self._watch(interval_s, timeout_s))

    async def _watch(self, interval_s: float, timeout_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if self._resuming:
                continue
            news = self._health_news
            try:
                s = await self._query(lambda q: fe.StatsQuery(q), timeout_s)
                ok, lost = not s.recovering, False
                if news == self._health_news:
                    self._recovering = s.recovering
            except (asyncio.TimeoutError, EngineUnavailable):
                ok, lost = False, True
            if news == self._health_news:  # else the scheduler said something newer meanwhile
                await self._set_healthy(ok, lost)

    async def _set_healthy(self, ok: bool, lost: bool = False) -> None:
        """``lost``: the scheduler does not answer (its streams are kept: only a
        disconnect, seen by ``_watch_link``, ends them after the resume timeout)."""
        self._unanswered = lost
        if ok:
            self._recovering = False
            self._serving.set()
        else:
            self._serving.clear()
        if ok == self.healthy:
            return
        self.healthy = ok
        if lost:
            log.error("scheduler did not answer: NOT_SERVING (%d open streams kept)", len(self._streams))
        else:
            log.info("engine %s: %s", "ready" if ok else "recovering", "SERVING" if ok else "NOT_SERVING")
        if self._on_change is not None:
            res = self._on_change(ok)
            if asyncio.iscoroutine(res):
                await res

    async def _watch_link(self) -> None:
        while True:
            await self._monitor.recv_multipart()
            if not self._resuming:
                log.warning("the scheduler disconnected: waiting for it to resume %d requests", len(self._book))
                await self._resume()

    async def _resume(self) -> None:
        """NOT_SERVING until a scheduler answers again; then every open stream
        is re-sent with what it already streamed and continues."""
        self._resuming = True
        self._resumed.clear()
        self._health_news += 1  # a watchdog query the old scheduler took with it is stale
        loop = asyncio.get_running_loop()
        try:
            await self._set_healthy(False)
            deadline = loop.time() + self._resume_timeout_s
            # What the old scheduler sent before it died is read first (it is all
            # in our pipe by the time its disconnect shows): those tokens count.
            while self._pull.sock.get(zmq.EVENTS) & zmq.POLLIN and loop.time() < deadline:
                await asyncio.sleep(0.005)
            while True:
                try:
                    await self._query(lambda q: fe.InfoQuery(q), 0.5)
                    break
                except asyncio.TimeoutError:
                    if loop.time() > deadline:
                        log.error("no scheduler within %.0fs: open streams end", self._resume_timeout_s)
                        self.fail_all("the engine is unavailable (scheduler lost)")
                        return
            again = self._book.resumed()
            for req in again:
                await self._send(req)
            log.info("scheduler back: %d requests resumed (%d sent)", len(self._book), len(again))
            await self._set_healthy(True)
        except EngineUnavailable:
            self.fail_all("the engine is unavailable (scheduler lost)")
        finally:
            self._resuming = False
            self._resumed.set()
            self._health_news += 1

    async def close(self) -> None:
        for task in (self._reader, self._watchdog, self._link):
            if task:
                task.cancel()
        if self._monitor is not None:
            self._pull.sock.disable_monitor()
            self._monitor.close(linger=0)
        self._push.close()
        self._pull.close()
        self._ctx.term()

    async def _read_loop(self) -> None:
        while True:
            msg = await self._pull.get()
            if isinstance(msg, (fe.Outputs, fe.EngineStats)):
                self._check_frames(msg)
            if isinstance(msg, fe.Outputs):
                self.dispatch(msg)
            else:
                if isinstance(msg, fe.EngineStats):
                    if msg.query_id == 0:  # unsolicited: recovery started or ended
                        self._health_news += 1
                        self._recovering = msg.recovering
                        await self._set_healthy(not msg.recovering)
                        continue
                    self.last_stats = msg
                fut = self._queries.pop(msg.query_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def dispatch(self, msg: fe.Outputs) -> None:
        """One step's batch (one frame, decoded once) to the streams it names."""
        now = time.monotonic()
        if self.on_outputs is not None:
            self.on_outputs(msg.deltas)
        route, streams = self._book.route, self._streams
        for d in msg.deltas:
            routed = route(d)  # a resumed sample's delta, renamed to its request
            if routed is not None and (q := streams.get(routed.request_id)) is not None:
                q.put_nowait((now, routed))

    def _check_frames(self, msg: fe.Outputs | fe.EngineStats) -> None:
        """Which streams a lost frame held is unknown: every open one ends."""
        missing = self._frames.missing(msg)
        if missing:
            log.error("%d output frames from the scheduler were lost or taken by another reader: "
                      "%d open streams end with DATA_LOSS", missing, len(self._streams))
            self.fail_all(f"{missing} output frames were lost on the way from the scheduler", fe.ErrorKind.DATA_LOSS)

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
        """Raises EngineUnavailable at once while the engine is unavailable or recovering."""
        if not self.healthy:
            raise EngineUnavailable("the engine is unavailable")
        s = await self._query(lambda q: fe.StatsQuery(q), timeout_s)
        if s.recovering:
            raise EngineUnavailable("the engine is recovering a component")
        return s

    @property
    def degraded(self) -> bool:
        """Live but slow: the step now running has taken longer than DEGRADED_AFTER_S."""
        return self.last_stats is not None and self.last_stats.step_running_s > DEGRADED_AFTER_S

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    @property
    def accepting(self) -> bool:
        """New requests are taken while healthy, while a restarted scheduler is
        awaited (they wait for it), while a component recovers (they wait for
        it, up to ``recovery_wait_s``) and while the scheduler is only slow to
        answer (they queue in its inbox)."""
        return self.healthy or self._resuming or self._unanswered or self._recovering

    @property
    def resuming(self) -> bool:
        """A restarted scheduler is being waited for: new requests wait too."""
        return self._resuming

    async def add_request(self, req: fe.AddRequest) -> asyncio.Queue[Item]:
        if req.request_id in self._streams:
            raise DuplicateRequestId(req.request_id)
        if not self.accepting:
            raise EngineUnavailable("the engine is unavailable")
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._streams[req.request_id] = q
        try:
            if self._resuming:
                # Sent once the new scheduler has the resumed requests (not into
                # the book before: the resume would send it a second time).
                try:
                    await asyncio.wait_for(self._resumed.wait(), self._resume_timeout_s)
                except asyncio.TimeoutError:
                    raise EngineUnavailable("the engine is unavailable (scheduler lost)") from None
                if not self.healthy:
                    raise EngineUnavailable("the engine is unavailable (scheduler lost)")
            if self._recovering and not self.healthy:
                try:
                    await asyncio.wait_for(self._serving.wait(), self._recovery_wait_s)
                except asyncio.TimeoutError:
                    raise EngineUnavailable("the engine is recovering a component") from None
            self._book.sent(req)
            await self._send(req)
        except BaseException:
            self._streams.pop(req.request_id, None)
            self._book.forget(req.request_id)
            raise
        return q

    def release(self, request_id: str, abort: bool) -> None:
        """Forget a stream; tell the engine to abort it if it did not finish.
        Safe to call from a cancelled handler: the abort is sent by a task."""
        self._streams.pop(request_id, None)
        ids = self._book.engine_ids(request_id)
        self._book.forget(request_id)
        if abort:
            task = asyncio.get_running_loop().create_task(self._send_quietly(fe.AbortRequest(ids)))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)

    async def _send_quietly(self, msg: Any) -> None:
        try:
            await self._send(msg)
        except EngineUnavailable:
            log.warning("could not send %s: scheduler unavailable", type(msg).__name__)

    async def abort(self, request_ids: list[str]) -> int:
        known = [r for r in request_ids if r in self._streams]
        await self._send(fe.AbortRequest([e for r in request_ids for e in self._book.engine_ids(r)]))
        return len(known)

    def fail_all(self, error: str, kind: fe.ErrorKind = fe.ErrorKind.UNAVAILABLE) -> None:
        """End every open stream with an error delta (the engine is gone)."""
        now = time.monotonic()
        for rid, q in list(self._streams.items()):
            q.put_nowait((now, fe.TokenDelta(rid, 0, [], fe.FinishReason.ERROR, 0, error, error_kind=kind)))
