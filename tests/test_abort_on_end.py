"""Issue 19, nothing runs for nobody: every stream that ends before its
request does (a gRPC cancel or deadline, an HTTP client that disconnects
mid-stream or before its answer) aborts the request in the scheduler, and
its blocks are free at once. Real processes; the scheduler's own counts
(GetServerInfo) show what still runs."""
from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any, Iterator
from urllib.parse import urlparse

import grpc
import pytest
from e2e_util import Server, serve
from models import make_tiny_model

# Twelve requests of 500 tokens, two at a time, take seconds to finish on
# their own: far longer than an abort may take (``assert_nothing_runs``).
# The model is wide enough that one 500-token request takes over a second
# here (1.6 s on 2026-12-06); the 2-layer tiny one took 0.37 s, so on a
# quiet CI machine four of twelve beat a 1 s deadline.
N = 12
MAX_TOKENS = 500
WIDE = dict(num_hidden_layers=4, hidden_size=768, head_dim=128, intermediate_size=2048)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("abort"), "llama", seed=5, **WIDE)
    # Two running at a time: the others wait, and must leave the queue too.
    with serve("--model", model_dir, "--block-size", "8", "--num-gpu-blocks", "400", "--max-num-seqs", "2") as s:
        yield s


def busy(server: Server) -> Any:
    with server.client() as c:
        return c.server_info()


def wait_busy(server: Server) -> None:
    deadline = time.monotonic() + 30
    while (i := busy(server)).num_running + i.num_waiting < N:
        assert time.monotonic() < deadline, f"the requests never all reached the engine: {i}" + "".join(server.log[-30:])
        time.sleep(0.02)


def assert_nothing_runs(server: Server, within_s: float = 1.5) -> float:
    """Until nothing runs or waits and every block is free; then no step advances."""
    t0 = time.monotonic()
    while True:
        i = busy(server)
        if i.num_running == i.num_waiting == 0 and i.num_free_gpu_blocks == i.num_gpu_blocks:
            break
        assert time.monotonic() - t0 < within_s, f"still running for nobody after {within_s}s: {i}"
        time.sleep(0.02)
    took = time.monotonic() - t0
    time.sleep(0.5)
    assert busy(server).num_running == 0
    return took


def prompt(i: int) -> list[int]:
    return [3 + i, 17, 29]


def read_all(call: Any, tokens: list[int]) -> None:
    try:
        for resp in call:
            for o in resp.outputs:
                tokens += o.token_ids
    except grpc.RpcError:
        pass


def test_grpc_cancel_aborts(server: Server) -> None:
    with server.client() as c:
        calls = [c.stream(prompt(i), max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) for i in range(N)]
        got: list[list[int]] = [[] for _ in calls]
        readers = [threading.Thread(target=read_all, args=(call, g), daemon=True) for call, g in zip(calls, got)]
        for r in readers:
            r.start()
        wait_busy(server)
        deadline = time.monotonic() + 30
        while not (got[0] or got[1]):  # mid-stream
            assert time.monotonic() < deadline, "nothing streamed"
            time.sleep(0.01)
        for call in calls:
            call.cancel()
        for r in readers:
            r.join(10)
    print(f"\ngRPC cancel: nothing runs after {assert_nothing_runs(server):.2f}s")


def test_grpc_deadline_aborts(server: Server) -> None:
    errors: list[Any] = []

    def one(i: int) -> None:
        with server.client() as c:
            try:
                for _ in c.stream(prompt(i), timeout=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0):
                    pass
            except grpc.RpcError as e:
                errors.append(e.code())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
    for t in threads:
        t.start()
    wait_busy(server)
    for t in threads:
        t.join(30)
    # The two running may finish in time on a much faster machine; the waiting ones cannot.
    assert errors.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= N - 2, [str(e) for e in errors]
    print(f"\ngRPC deadline: nothing runs after {assert_nothing_runs(server):.2f}s")


def http_request(server: Server, body: dict[str, Any]) -> socket.socket:
    u = urlparse(server.http)
    data = json.dumps(body).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


@pytest.mark.parametrize("streaming", [True, False])
def test_http_disconnect_aborts(server: Server, streaming: bool) -> None:
    socks = [http_request(server, {"prompt": prompt(i), "max_tokens": MAX_TOKENS, "ignore_eos": True,
                                   "temperature": 0.0, "stream": streaming}) for i in range(N)]
    if streaming:
        socks[0].settimeout(30)
        head = b""
        while b"data:" not in head:  # it streams
            head += socks[0].recv(4096)
    wait_busy(server)
    for s in socks:  # a load tester cutting its requests at a time limit
        s.close()
    print(f"\nHTTP disconnect (stream={streaming}): nothing runs after {assert_nothing_runs(server):.2f}s")
