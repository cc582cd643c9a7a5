"""The frontend under hostile load, with the SIMULATED worker (tiny-Llama
tokenizer): 3,000 concurrent requests get answers or RESOURCE_EXHAUSTED
(never a bare CANCELLED) and are all counted; huge prompts do not stall other
streams; undecodable requests are INVALID_ARGUMENT; requests the client gives
up on are aborted in the engine."""
from __future__ import annotations

import asyncio
import collections
import re
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from e2e_util import Server, free_port, serve
from models import make_tiny_model
from pagedserve.client import AsyncGenerationClient
from pagedserve.v1 import generation_pb2 as pb

MAX_QUEUED = 100
BURST = 3000
MAX_MODEL_LEN = 65536  # the tiny tokenizer's longest entry is 13 characters: prompts up to ~850k are tokenized


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    metrics = free_port()
    env = {"PAGEDSERVE_MAX_QUEUED_REQUESTS": str(MAX_QUEUED), "PAGEDSERVE_FRONTEND_METRICS_PORT": str(metrics)}
    with serve("--model", model_dir, "--worker", "sim", "--num-gpu-blocks", "2048", "--max-model-len",
               str(MAX_MODEL_LEN), "--max-num-seqs", "4", env=env) as s:
        yield s, metrics


def counters(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = collections.defaultdict(float)
    for m in re.finditer(r'^pagedserve:(request_success_total|request_rejected_total)\{[^}]*?"([^"]+)"\} (\S+)$',
                         text, re.M):
        out[f"{m.group(1)}:{m.group(2)}"] += float(m.group(3))
    return out


def wait_idle(server: Server, timeout_s: float = 60.0) -> pb.ServerInfo:
    with server.client() as c:
        deadline = time.monotonic() + timeout_s
        while True:
            info = c.server_info()
            if (info.num_running == info.num_waiting == info.num_requests_in_flight == 0
                    and info.num_free_gpu_blocks == info.num_gpu_blocks) or time.monotonic() > deadline:
                return info
            time.sleep(0.05)


def test_burst_of_3000_gets_answers_or_resource_exhausted_all_counted(sim: tuple[Server, int]) -> None:
    server, port = sim
    before = counters(port)

    async def go() -> collections.Counter[str]:
        codes: collections.Counter[str] = collections.Counter()
        async with AsyncGenerationClient(server.addr) as client:
            await client.model_info()

            async def one(i: int) -> None:
                try:
                    await client.generate([5 + i % 200, 6, 7, 8] * 4, max_tokens=64, temperature=0.0,
                                          ignore_eos=True, timeout=120)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        assert f"max_queued_requests={MAX_QUEUED}" in e.details()

            await asyncio.gather(*(one(i) for i in range(BURST)))
        return codes

    t0 = time.monotonic()
    codes = asyncio.run(go())
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes  # no bare CANCELLED
    assert codes["RESOURCE_EXHAUSTED"] > 0 and codes["OK"] >= MAX_QUEUED, codes
    after = counters(port)
    assert after["request_rejected_total:queue_full"] - before["request_rejected_total:queue_full"] == \
        codes["RESOURCE_EXHAUSTED"]
    assert after["request_success_total:length"] - before["request_success_total:length"] == codes["OK"]
    assert time.monotonic() - t0 < 60
    info = wait_idle(server)
    assert info.num_running == 0 and info.num_free_gpu_blocks == info.num_gpu_blocks, info


@pytest.mark.parametrize("chars, tokenized", [(800_000, True), (1_000_000, False)])
def test_huge_prompt_does_not_stall_other_streams(sim: tuple[Server, int], chars: int, tokenized: bool) -> None:
    server = sim[0]
    text = ("The quick brown fox jumps over the lazy dog. café 東京 " * (chars // 40 + 1))[:chars]

    async def go() -> tuple[list[float], grpc.StatusCode, str, float]:
        gaps: list[float] = []
        done = asyncio.Event()
        async with AsyncGenerationClient(server.addr) as client:
            await client.model_info()

            async def streams() -> None:
                while not done.is_set():
                    last = None
                    async for _ in client.stream([5, 6, 7, 8], max_tokens=300, temperature=0.0, ignore_eos=True,
                                                 timeout=60):
                        now = time.monotonic()
                        if last is not None and not done.is_set():
                            gaps.append(now - last)
                        last = now

            bg = asyncio.create_task(streams())
            await asyncio.sleep(0.3)
            gaps.clear()
            t0 = time.monotonic()
            try:
                await client.generate(text, max_tokens=4, timeout=60)
                code, details = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details()
            took = time.monotonic() - t0
            done.set()
            await bg
        return gaps, code, details, took

    gaps, code, details, took = asyncio.run(go())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    if tokenized:  # tokenized (off the event loop), then too many tokens
        assert details.startswith("prompt: ") and "tokens leaves no room" in details, details
        assert took > 0.1, took  # a real tokenization, long enough to stall a loop it ran on
        assert len(gaps) >= 10, (len(gaps), took)  # streams flowed while it was tokenized
    else:  # refused by its length before tokenizing: at once
        assert "characters are more than max_model_len" in details, details
        assert took < 1.0, took
    print(f"\nhuge prompt ({chars} chars): longest gap of the other stream {max(gaps, default=0.0) * 1000:.0f} ms, took {took:.2f} s")
    # Tokenized on the loop, the gap would be the whole tokenization (``took``); off it, a loaded
    # machine still shows a scheduling hiccup (111 ms once, beside a 1.3 s tokenization).
    assert max(gaps, default=0.0) < max(0.1, took / 4), (max(gaps), took)


def test_undecodable_requests_are_invalid_argument(sim: tuple[Server, int]) -> None:
    server = sim[0]
    with grpc.insecure_channel(server.addr) as ch:
        for method, stream in (("Generate", True), ("Tokenize", False), ("GetServerInfo", False)):
            path = f"/pagedserve.v1.Generation/{method}"
            call = ch.unary_stream(path) if stream else ch.unary_unary(path)
            for raw in (b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\xff"):  # bad varint, truncated, bad length
                with pytest.raises(grpc.RpcError) as err:
                    result = call(raw, timeout=10)
                    if stream:
                        list(result)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, err.value)
                assert err.value.details().startswith("request: ") and "pagedserve.v1." in err.value.details()
                assert "Error" not in err.value.details()  # no Python class name
        # A valid request on the same channel still works.
        ok = ch.unary_unary("/pagedserve.v1.Generation/Tokenize", request_serializer=pb.TokenizeRequest.SerializeToString,
                            response_deserializer=pb.TokenizeResponse.FromString)(pb.TokenizeRequest(text="Hello"))
        assert len(ok.token_ids) > 0


def test_requests_given_up_on_are_aborted_in_the_engine(sim: tuple[Server, int]) -> None:
    server = sim[0]
    assert wait_idle(server).num_running == 0

    async def go() -> None:
        async with AsyncGenerationClient(server.addr) as client:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.generate([5, 6, 7], max_tokens=60000, ignore_eos=True, timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            call = client.stream([9, 6, 7], max_tokens=60000, ignore_eos=True, timeout=60)
            async for _ in call:
                call.cancel()
                break

    asyncio.run(go())
    info = wait_idle(server, timeout_s=10)  # far sooner than 60,000 steps would take
    assert info.num_running == 0 and info.num_waiting == 0 and info.num_requests_in_flight == 0, info
    assert info.num_free_gpu_blocks == info.num_gpu_blocks, info


def test_sigterm_past_the_shutdown_timeout_ends_streams_with_a_clear_error(tmp_path_factory: pytest.TempPathFactory
                                                                          ) -> None:
    import signal

    model_dir = make_tiny_model(tmp_path_factory.mktemp("drain"), "llama", seed=0)
    with serve("--model", model_dir, "--worker", "sim", "--num-gpu-blocks", "2048", "--max-model-len", "65536",
               "--shutdown-timeout", "1") as s, s.client() as c:
        stream = c.stream([5, 6, 7], max_tokens=60000, ignore_eos=True, timeout=60)
        next(stream)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with s.client() as other:  # admission has stopped while the open stream drains
            with pytest.raises(grpc.RpcError) as refused:
                other.generate("Hello", max_tokens=2, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "shutting down" in err.value.details() and "shutdown timeout of 1 s" in err.value.details()
        assert 0.8 < time.monotonic() - t0 < 10
        assert s.proc.wait(30) == 0
