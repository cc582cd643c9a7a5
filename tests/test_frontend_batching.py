"""Issue 23's batching on the way out of the engine: one frame (one msgpack
decode) per scheduler step reaches every stream it names; deltas already
waiting for a stream go out as one gRPC response; the SSE events of one step
go out in one write, with the bytes of separate ``sse()`` writes."""
from __future__ import annotations

import asyncio
import json
import tempfile
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from models import make_tiny_model
from pagedserve.common.config import default_addresses
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages.types import ModelInfo
from pagedserve.frontend.core.engine_client import EngineClient
from pagedserve.frontend.core.generation import FrontendConfig, GenerationService
from pagedserve.frontend.openai_api.http_response import sse
from pagedserve.frontend.openai_api.sse_writes import SseBatch
from pagedserve.v1 import generation_pb2 as pb


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from pagedserve.frontend.core.tokenizer import load

    return load(make_tiny_model(tmp_path_factory.mktemp("m"), "llama"))


def test_one_frame_per_step_and_waiting_deltas_are_one_response(tok: Any) -> None:
    ids = tok("The quick brown fox: café, 東京 and 🙂.", add_special_tokens=False).input_ids

    async def go() -> None:
        engine = EngineClient(default_addresses(tempfile.mkdtemp(prefix="pagedserve-test-")), send_timeout_s=1.0)
        engine.info = fe.EngineInfo(0, ModelInfo("t", len(tok), 512, (), 1, 1, 1, "none", "cpu"), 16, 64, 0, 8, 256)
        engine.healthy = True
        svc = GenerationService(engine, tok, FrontendConfig())
        streams = [await svc.open(svc.prepare(pb.GenerateRequest(request_id=f"r{i}", prompt="Hi",
                                                                  sampling_params=pb.SamplingParams(max_tokens=64))))
                   for i in range(2)]
        frames = [msgspec.msgpack.encode(fe.Outputs([fe.TokenDelta(f"r{i}", 0, [t], fe.FinishReason.LENGTH
                                                                   if k == len(ids) - 1 else None)
                                                     for i in range(2)])) for k, t in enumerate(ids)]
        dec = msgspec.msgpack.Decoder(fe.Reply)
        # Three steps arrive before the streams run: each stream gets them as one chunk.
        for f in frames[:3]:
            engine.dispatch(dec.decode(f))
        first = [await s.next() for s in streams]
        assert all(c is not None and len(c) == 1 and c[0].token_ids == ids[:3] for c in first)
        # Then one step at a time: one chunk (one gRPC response) per step.
        for f in frames[3:]:
            engine.dispatch(dec.decode(f))
            for s in streams:
                got = await s.next()
                assert got is not None and len(got) == 1 and len(got[0].token_ids) == 1
        assert all(s.done for s in streams)
        for s in streams:
            s.close()
        await engine.close()

    asyncio.run(go())


class _Counting(web.StreamResponse):
    writes = 0

    async def write(self, data: bytes) -> None:  # type: ignore[override]
        type(self).writes += 1
        await super().write(data)


def test_sse_batch_is_one_write_of_the_same_bytes() -> None:
    payloads = [{"choices": [{"index": i, "text": t}]} for i, t in enumerate(["東京", "🙂", " ok"])]

    async def one_by_one(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for p in payloads:
            await sse(resp, p)
        await resp.write_eof()
        return resp

    async def batched(request: web.Request) -> web.StreamResponse:
        resp = _Counting()
        await resp.prepare(request)
        batch = SseBatch()
        for p in payloads:
            batch.add(p)
        await batch.flush(resp)
        await batch.flush(resp)  # nothing left: no write
        await resp.write_eof()
        return resp

    async def go() -> None:
        app = web.Application()
        app.router.add_get("/a", one_by_one)
        app.router.add_get("/b", batched)
        async with TestClient(TestServer(app)) as client:
            a = await (await client.get("/a")).read()
            b = await (await client.get("/b")).read()
        assert a == b and [json.loads(x[6:]) for x in a.split(b"\n\n") if x] == payloads
        assert _Counting.writes == 1

    asyncio.run(go())
