"""The frontend's EngineClient against a fake scheduler (two real ZeroMQ
sockets): health follows the scheduler's recovery messages, a watchdog
answer older than the latest of them never overrides it, and a scheduler
that disconnects gets every open stream re-sent with its streamed tokens."""
from __future__ import annotations

import asyncio
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from pagedserve.common.config import default_addresses
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages.types import ModelInfo, SamplingParams
from pagedserve.frontend.core.engine_client import EngineClient

INFO = fe.EngineInfo(0, ModelInfo("fake", 100, 512, (0,), 1, 1, 1, "float32", "cpu"), 8, 10, 0, 4, 64)
enc = msgspec.msgpack.Encoder()
dec = msgspec.msgpack.Decoder(fe.Request)


def stats(qid: int, recovering: bool) -> fe.EngineStats:
    return fe.EngineStats(qid, 0, 0, 0, 10, 10, 0, 0, 0, 0, 0, 0, recovering=recovering)


class FakeScheduler:
    def __init__(self, ctx: zmq.asyncio.Context, run_dir: str) -> None:
        os.makedirs(run_dir, mode=0o700, exist_ok=True)
        a = default_addresses(run_dir)
        self.inbox = ctx.socket(zmq.PULL)
        self.inbox.bind(a.scheduler_in)
        self.outbox = ctx.socket(zmq.PUSH)
        self.outbox.bind(a.scheduler_out)
        self.addrs = a

    async def recv(self) -> Any:
        return dec.decode(await self.inbox.recv())

    async def send(self, msg: msgspec.Struct) -> None:
        await self.outbox.send(enc.encode(msg))

    async def answer_info(self) -> None:
        while not isinstance(q := await self.recv(), fe.InfoQuery):
            pass
        await self.send(msgspec.structs.replace(INFO, query_id=q.query_id))

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.outbox.close(linger=0)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


@dataclass
class Rig:
    """An EngineClient serving one request "a", connected to a fake scheduler
    that a test may replace (``restart``) as a restarted one would."""

    ctx: zmq.asyncio.Context
    run_dir: str
    fake: FakeScheduler
    engine: EngineClient

    def restart(self) -> FakeScheduler:
        self.fake = FakeScheduler(self.ctx, self.run_dir)  # binds the same sockets
        return self.fake


@asynccontextmanager
async def serving_one(tmp_path: os.PathLike[str], params: SamplingParams
                      ) -> AsyncIterator[tuple[Rig, asyncio.Queue[Any]]]:
    ctx = zmq.asyncio.Context()
    run_dir = os.path.join(tmp_path, "run")
    fake = FakeScheduler(ctx, run_dir)
    rig = Rig(ctx, run_dir, fake, EngineClient(fake.addrs, resume_timeout_s=10))
    try:
        await asyncio.gather(rig.engine.start(5), fake.answer_info())
        rig.engine.watch(10.0, 5.0, lambda ok: None)
        q = await rig.engine.add_request(fe.AddRequest("a", [1, 2, 3], params, 1.0))
        assert isinstance(await fake.recv(), fe.AddRequest)
        yield rig, q
    finally:
        await rig.engine.close()
        rig.fake.close()
        ctx.term()


def test_a_stale_watchdog_answer_does_not_undo_the_end_of_recovery(tmp_path: os.PathLike[str]) -> None:
    async def go() -> list[bool]:
        ctx = zmq.asyncio.Context()
        fake = FakeScheduler(ctx, os.path.join(tmp_path, "run"))
        engine = EngineClient(fake.addrs)
        changes: list[bool] = []
        try:
            await asyncio.gather(engine.start(5), fake.answer_info())
            engine.watch(0.05, 5.0, changes.append)
            await fake.send(stats(0, True))  # recovery starts
            while not isinstance(q := await fake.recv(), fe.StatsQuery):
                pass
            # Answered during recovery, then recovery ends: the answer is older news.
            await fake.send(stats(q.query_id, True))
            await fake.send(stats(0, False))
            await asyncio.sleep(0.02)  # the watchdog's next query stays unanswered (5 s)
            assert engine.healthy
            return changes
        finally:
            await engine.close()
            fake.close()
            ctx.term()

    assert run(go()) == [False, True]


def test_a_lost_scheduler_gets_the_streams_back_with_their_tokens(tmp_path: os.PathLike[str]) -> None:
    async def go() -> tuple[fe.AddRequest, list[int]]:
        async with serving_one(tmp_path, SamplingParams(max_tokens=9, seed=5)) as (rig, q):
            engine = rig.engine
            await rig.fake.send(fe.Outputs([fe.TokenDelta("a", 0, [7], None, 3), fe.TokenDelta("a", 0, [8], None, 3)]))
            rig.fake.close()  # the scheduler dies...
            await asyncio.sleep(0.3)
            assert not engine.healthy
            fake = rig.restart()  # ...and a new one binds the same sockets
            await fake.answer_info()
            while not isinstance(again := await fake.recv(), fe.AddRequest):
                pass
            for _ in range(100):
                if engine.healthy:
                    break
                await asyncio.sleep(0.01)
            assert engine.healthy
            got = [q.get_nowait()[1].token_ids[0] for _ in range(q.qsize())]
            return again, got

    again, got = run(go())
    assert got == [7, 8]  # the stream saw each token once
    assert again.prompt_token_ids == [1, 2, 3, 7, 8] and again.num_output_tokens == 2 and again.resume
    assert again.params.max_tokens == 9 and again.params.seed == 5 and again.arrival_time == 1.0


def test_a_request_sent_while_the_scheduler_restarts_waits_for_it(tmp_path: os.PathLike[str]) -> None:
    """No request lost: one that arrives while the frontend waits for a
    restarted scheduler is not refused; it goes to the new scheduler, once,
    after the resumed ones."""
    async def go() -> list[fe.AddRequest]:
        async with serving_one(tmp_path, SamplingParams(max_tokens=9)) as (rig, _):
            engine = rig.engine
            rig.fake.close()
            for _ in range(100):
                if engine.resuming:
                    break
                await asyncio.sleep(0.01)
            assert engine.resuming and not engine.healthy
            late = asyncio.create_task(engine.add_request(fe.AddRequest("b", [4, 5], SamplingParams(max_tokens=3), 2.0)))
            await asyncio.sleep(0.2)
            assert not late.done()  # waiting, not refused
            fake = rig.restart()
            await fake.answer_info()
            got: list[fe.AddRequest] = []
            while len(got) < 2:
                if isinstance(m := await fake.recv(), fe.AddRequest):
                    got.append(m)
            await late
            await asyncio.sleep(0.1)
            assert await fake.inbox.poll(0) == 0  # nothing sent twice
            assert engine.healthy
            return got

    got = run(go())
    assert [(r.request_id, r.resume) for r in got] == [("a", True), ("b", False)]


def test_a_request_sent_while_a_component_recovers_waits_for_it_or_is_refused(tmp_path: os.PathLike[str]) -> None:
    """Issue 41: during a gpuworker/blockmgr recovery (the scheduler's unsolicited
    recovering=True) a new request is held, and sent once recovery ends; past
    ``recovery_wait_s`` it is refused (EngineUnavailable: 503 / UNAVAILABLE)."""
    from pagedserve.frontend.core.engine_client import EngineUnavailable

    async def go() -> tuple[str, bool, str]:
        ctx = zmq.asyncio.Context()
        fake = FakeScheduler(ctx, os.path.join(tmp_path, "run"))
        engine = EngineClient(fake.addrs, recovery_wait_s=0.5)
        try:
            await asyncio.gather(engine.start(5), fake.answer_info())
            await fake.send(stats(0, True))  # recovery starts
            while engine.healthy:
                await asyncio.sleep(0.01)
            assert engine.accepting  # taken, to wait
            waiting = asyncio.create_task(engine.add_request(fe.AddRequest("w", [1, 2], SamplingParams(), 1.0)))
            await asyncio.sleep(0.2)
            held = not waiting.done()
            await fake.send(stats(0, False))  # recovery ends: the held request goes to the scheduler
            await waiting
            sent = await fake.recv()
            await fake.send(stats(0, True))  # a recovery longer than recovery_wait_s
            while engine.healthy:
                await asyncio.sleep(0.01)
            try:
                await engine.add_request(fe.AddRequest("late", [1, 2], SamplingParams(), 1.0))
                refused = "sent"
            except EngineUnavailable as e:
                refused = str(e)
            return sent.request_id, held, refused
        finally:
            await engine.close()
            fake.close()
            ctx.term()

    rid, held, refused = run(go())
    assert rid == "w" and held and refused == "the engine is recovering a component"
