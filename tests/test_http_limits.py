"""The HTTP gateway's bounds against the real four processes (tiny Llama): hostile
bodies are 400s naming the problem (never 500), token ids outside the vocabulary
are 400 (INVALID_ARGUMENT over gRPC), and half-sent, idle or surplus connections
are closed within the timeouts (shortened here through PAGEDSERVE_HTTP_*)."""
from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from e2e_util import Server, free_port, serve
from models import make_tiny_model
from pagedserve.frontend.openai_api.http_json import MAX_JSON_DEPTH

HEADER_TIMEOUT_S = 4.0
BODY_TIMEOUT_S = 3.0
MAX_CONNECTIONS = 8
SLACK_S = 3.0  # a loaded 2-core machine answers late, but far from aiohttp's default hour


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int, int]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    port = free_port()
    env = {"PAGEDSERVE_HTTP_PORT": str(port), "PAGEDSERVE_HTTP_HEADER_TIMEOUT": str(HEADER_TIMEOUT_S),
           "PAGEDSERVE_HTTP_BODY_TIMEOUT": str(BODY_TIMEOUT_S), "PAGEDSERVE_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS)}
    with serve("--model", model_dir, "--num-gpu-blocks", "32", env=env) as s:
        with s.client() as c:
            vocab = c.model_info().vocab_size
        yield s, port, vocab


def post(port: int, path: str, body: bytes) -> tuple[int, Any]:
    """Raw bytes, so NaN and deep nesting reach the server as written."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
    finally:
        c.close()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, data


def refused(status: int, reply: Any, param: str, words: str) -> bool:
    err = reply.get("error", {}) if isinstance(reply, dict) else {}
    return (status == 400 and err.get("type") == "BadRequestError" and err.get("code") == 400 and err.get("param") == param
            and words in err.get("message", ""))


def test_hostile_bodies_are_400_naming_the_problem(gw: tuple[Server, int, int]) -> None:
    _, port, vocab = gw
    deep = b"[" * 5000 + b"]" * 5000
    cases: list[tuple[str, bytes, str, str]] = [
        ("/v1/completions", deep, "body", "5000 levels deep"),
        ("/v1/chat/completions", deep, "body", "5000 levels deep"),
        ("/v1/completions", b'{"prompt": "hi", "x": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001, "body", "levels deep"),
        # Just past the bound, and an unbalanced body that only opens.
        ("/v1/completions", b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "body", "levels deep"),
        ("/v1/completions", b"{" * 100_000, "body", "levels deep"),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1, "logit_bias": {"5": NaN}}', "body", "NaN"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": Infinity}}',
         "body", "Infinity"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": -Infinity}', "body", "-Infinity"),
        ("/v1/completions", b'{"prompt": "hi", "top_p": 1e999}', "body", "1e999"),
        ("/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "body", "out of range"),
        ("/v1/completions", b'{"prompt": [%d], "max_tokens": 1}' % 2**40, "prompt", "outside the vocabulary"),
        ("/v1/completions", b'{"prompt": [[1, 2], [%d]], "max_tokens": 1}' % vocab, "prompt", "outside the vocabulary"),
        ("/v1/completions", b'{"prompt": [-1], "max_tokens": 1}', "prompt", "outside the vocabulary"),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"%d": 1}}' % 2**40, "logit_bias", "outside the vocabulary"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"%d": 1}}' % vocab,
         "logit_bias", "outside the vocabulary"),
        ("/v1/completions", b'{"prompt": "hi", "logit_bias": {"five": 1}}', "logit_bias", "token ids"),
        ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": [%d]}' % 2**40, "stop_token_ids", "outside"),
        ("/v1/completions", b'{"prompt": "hi", "stop_token_ids": "7"}', "stop_token_ids", "list of token ids"),
        ("/detokenize", b'{"tokens": [%d]}' % 2**40, "tokens", "outside the vocabulary"),
        # A JSON schema sent as text is bounded like the body.
        ("/v1/completions", json.dumps({"prompt": "hi", "guided_json": '{"items": ' * 1000 + "{}" + "}" * 1000}).encode(),
         "guided_json", "1001 levels deep"),
        ("/v1/completions", b"\xff\xfe{}", "body", "utf-8"),
        ("/v1/completions", b'{"prompt": "hi",', "body", "not valid JSON"),
    ]
    for path, body, param, words in cases:
        status, reply = post(port, path, body)
        assert refused(status, reply, param, words), (body[:80], status, reply)
    # Inside the bounds all is well: the last id of the vocabulary, a finite bias, a nested field at the bound.
    ok = {"prompt": [vocab - 1, 0], "max_tokens": 1, "logit_bias": {str(vocab - 1): -100, "0": 2.5},
          "stop_token_ids": [vocab - 1]}
    status, reply = post(port, "/v1/completions", json.dumps(ok).encode())
    assert status == 200 and reply["usage"]["completion_tokens"] == 1, reply
    at_bound = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH  # parses; refused only as not an object
    assert refused(*post(port, "/v1/completions", at_bound), "body", "must be a JSON object")


def test_grpc_refuses_the_same_ids_and_non_finite_bias(gw: tuple[Server, int, int]) -> None:
    server, _, vocab = gw
    with server.client() as c:
        for prompt, sampling in (([vocab], {}), ("hi", {"logit_bias": {vocab: 1.0}}),
                                 ("hi", {"logit_bias": {5: float("nan")}}), ("hi", {"stop_token_ids": [vocab]})):
            with pytest.raises(grpc.RpcError) as e:
                c.generate(prompt, max_tokens=1, **sampling)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (prompt, sampling, e.value.details())


def closed_within(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closed ``sock`` (reading what it sent); fails past ``limit_s``."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except socket.timeout:
        pytest.fail(f"the server kept the connection open past {limit_s:g} s (got {data[:120]!r})")
    return time.monotonic() - start, data


def test_half_sent_headers_are_closed(gw: tuple[Server, int, int]) -> None:
    _, port, _ = gw
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        waited, data = closed_within(s, HEADER_TIMEOUT_S + SLACK_S)
        assert data == b"" and waited > HEADER_TIMEOUT_S / 2
    # Trickling the head byte by byte does not extend the deadline.
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.monotonic()
        try:
            for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                s.sendall(bytes([b]))
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass
        closed_within(s, SLACK_S)
        assert time.monotonic() - start < HEADER_TIMEOUT_S + SLACK_S
    # An idle keep-alive connection, after a full answer, gets the same deadline.
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        _, data = closed_within(s, HEADER_TIMEOUT_S + SLACK_S)
        assert data.startswith(b"HTTP/1.1 200")


def test_short_body_is_408_and_closed(gw: tuple[Server, int, int]) -> None:
    _, port, _ = gw
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        waited, data = closed_within(s, BODY_TIMEOUT_S + SLACK_S)
    assert data.startswith(b"HTTP/1.1 408") and b'"param": "body"' in data, data
    assert waited > BODY_TIMEOUT_S / 2


def _open_sockets(socks: list[socket.socket]) -> list[bool]:
    """Which sockets the server has not closed (without blocking)."""
    out = []
    for s in socks:
        s.setblocking(False)
        try:
            out.append(s.recv(1, socket.MSG_PEEK) != b"")
        except BlockingIOError:
            out.append(True)
        except ConnectionResetError:
            out.append(False)
    return out


def _normal_request_works(port: int) -> None:
    status, reply = post(port, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}')
    assert status == 200 and reply["usage"]["completion_tokens"] == 1, reply


def test_past_the_connection_bound_the_oldest_idle_ones_close(gw: tuple[Server, int, int]) -> None:
    _, port, _ = gw
    extra = 4
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + extra)]
    try:
        time.sleep(0.5)  # well within the header timeout: only the bound closes any
        assert _open_sockets(socks) == [False] * extra + [True] * MAX_CONNECTIONS
        _normal_request_works(port)  # makes room by closing one more idle connection
        assert _open_sockets(socks) == [False] * (extra + 1) + [True] * (MAX_CONNECTIONS - 1)
    finally:
        for s in socks:
            s.close()


def test_past_the_connection_bound_with_all_busy_newcomers_get_503(gw: tuple[Server, int, int]) -> None:
    _, port, _ = gw
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"
    busy = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
    try:
        for s in busy:  # each holds a handler, waiting for the rest of its body
            s.sendall(head)
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", port)) as s:
            _, data = closed_within(s, SLACK_S)
        assert data.startswith(b"HTTP/1.1 503") and b"too many open connections" in data, data
        assert all(_open_sockets(busy))
        for s in busy:  # then the body timeout frees them
            s.setblocking(True)
            _, data = closed_within(s, BODY_TIMEOUT_S + SLACK_S)
            assert data.startswith(b"HTTP/1.1 408"), data
    finally:
        for s in busy:
            s.close()
    _normal_request_works(port)
