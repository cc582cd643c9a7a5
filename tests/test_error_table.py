"""One error vocabulary (issue 21): the same engine error reaches a gRPC client
and an HTTP client as the same class of error, for every ``ErrorKind``. The
real frontend (EngineClient, GenerationService, the gRPC servicer and the HTTP
gateway, both listening on loopback) runs against a scheduler socket that
fails each request with the kind under test, as the scheduler does."""
from __future__ import annotations

import asyncio
import json
import os
import socket
from typing import Any

import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import ClientSession
from grpc_health.v1 import health

from pagedserve.common.messages import frontend as fe
from pagedserve.common.metrics import FrontendMetrics
from pagedserve.frontend.openai_api import http_gateway
from pagedserve.frontend.core.auth import ApiKeys
from pagedserve.frontend.core.engine_client import EngineClient
from pagedserve.frontend.core.error_table import ENGINE_ERRORS, REJECTIONS, RejectReason
from pagedserve.frontend.core.generation import FrontendConfig, GenerationService
from pagedserve.frontend.grpc_api.server import serve
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from models import train_tokenizer
from test_engine_client_health import FakeScheduler

# gRPC's own code <-> HTTP status mapping (google.rpc.Code's documented HTTP equivalents).
GRPC_TO_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.DATA_LOSS: 500}
# vLLM 0.32's create_error_response: the type each status gets (an engine failure is a
# GenerationError: InternalServerError, or ServiceUnavailableError when retryable; 429 is
# a GracefulHTTPError, whose type is the status phrase).
VLLM_TYPES = {400: "BadRequestError", 429: "Too Many Requests", 500: "InternalServerError",
              503: "ServiceUnavailableError"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_table_covers_every_kind_and_reason_consistently() -> None:
    assert set(ENGINE_ERRORS) == set(fe.ErrorKind)
    assert set(REJECTIONS) == set(RejectReason)
    for cls in [*ENGINE_ERRORS.values(), *REJECTIONS.values()]:
        assert GRPC_TO_HTTP[cls.grpc_code] == cls.http_status, cls
    assert fe.TokenDelta("a", 0, [], fe.FinishReason.STOP) == msgspec.msgpack.decode(
        msgspec.msgpack.encode(fe.TokenDelta("a", 0, [], "stop")), type=fe.TokenDelta)  # an enum on the wire


async def _scheduler(fake: FakeScheduler) -> None:
    """Answers queries; fails each AddRequest with the kind its prompt names."""
    from test_engine_client_health import INFO, stats

    seq = 0
    while True:
        msg = await fake.recv()
        if isinstance(msg, fe.InfoQuery):
            await fake.send(msgspec.structs.replace(INFO, query_id=msg.query_id))
        elif isinstance(msg, fe.StatsQuery):
            await fake.send(stats(msg.query_id, False))
        elif isinstance(msg, fe.AddRequest):
            kind = fe.ErrorKind(msg.prompt_token_ids[0])
            await fake.send(fe.Outputs([fe.TokenDelta(msg.request_id, 0, [], fe.FinishReason.ERROR,
                                                      len(msg.prompt_token_ids), f"failed: {kind.name}",
                                                      error_kind=kind)], seq=seq))
            seq += 1


async def _both(tmp: str) -> dict[fe.ErrorKind, tuple[grpc.StatusCode, int, dict[str, Any], dict[str, Any]]]:
    ctx = zmq.asyncio.Context()
    fake = FakeScheduler(ctx, os.path.join(tmp, "run"))
    sched = asyncio.create_task(_scheduler(fake))
    engine = EngineClient(fake.addrs, resume_timeout_s=5)
    metrics = FrontendMetrics(lambda: engine.last_stats, lambda: engine.num_streams)
    svc = GenerationService(engine, train_tokenizer(100), FrontendConfig(), metrics)
    grpc_port, http_port = _free_port(), _free_port()
    server = await serve(svc, "127.0.0.1", grpc_port, health.aio.HealthServicer())
    runner = await http_gateway.start(http_gateway.Gateway(svc, ApiKeys([]), metrics.registry, lambda: True),
                                      "127.0.0.1", http_port)
    out = {}
    try:
        await engine.start(10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch, ClientSession() as http:
            stub = pb_grpc.GenerationStub(ch)
            for kind in fe.ErrorKind:
                ids = [int(kind), 5, 6]
                call = stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                                        sampling_params=pb.SamplingParams(max_tokens=2)))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                url = f"http://127.0.0.1:{http_port}/v1/completions"
                async with http.post(url, json={"prompt": ids, "max_tokens": 2}) as r:
                    plain = (r.status, await r.json())
                async with http.post(url, json={"prompt": ids, "max_tokens": 2, "stream": True}) as r:
                    events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                              if line.startswith("data: {")]
                out[kind] = (err.value.code(), plain[0], plain[1], events[-1])
    finally:
        sched.cancel()
        await runner.cleanup()
        await server.stop(0)
        await engine.close()
        fake.close()
        ctx.term()
    return out


def test_the_same_engine_error_is_the_same_error_over_grpc_and_http(tmp_path: os.PathLike[str]) -> None:
    seen = asyncio.run(asyncio.wait_for(_both(str(tmp_path)), 60))
    for kind, (code, status, body, event) in seen.items():
        cls = ENGINE_ERRORS[kind]
        assert code is cls.grpc_code, kind
        assert GRPC_TO_HTTP[code] == status == cls.http_status, kind
        assert body["error"]["type"] == event["error"]["type"] == VLLM_TYPES[status], kind
        # vLLM's ErrorInfo.code is an integer: the HTTP status.
        assert body["error"]["code"] == event["error"]["code"] == status, kind
        assert f"failed: {kind.name}" in body["error"]["message"], kind
