"""Fuzzes the OpenAI-compatible HTTP gateway of ONE running server (the real
four processes, tiny Llama, a small KV pool) with 1,000 generated bodies on
/v1/completions and /v1/chat/completions: deep nesting, non-finite numbers
written as raw text (NaN, Infinity, 1e999), huge and negative token ids, wrong
types, unknown field names, truncated and garbled bytes. Not one answer may be
a 5xx (nor a stream that ends in a server error), and afterwards the server
answers a normal request and every KV block is free again."""
from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e_util import Server, free_port, serve, wait_all_free
from models import make_tiny_model

VOCAB = 509  # make_tiny_model's Llama (checked against the server below)
ROUTES = ("/v1/completions", "/v1/chat/completions")


class Raw:
    """JSON text written verbatim (what a strict client library would refuse to send)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:60]!r}{'...' if len(self.text) > 60 else ''})"


def dumps(v: Any) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dumps(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(dumps(x) for x in v) + "]"
    return json.dumps(v)  # floats: nan/inf come out as NaN/Infinity


@st.composite
def _deep(draw: st.DrawFn) -> Raw:
    depth = draw(st.sampled_from([63, 64, 65, 100, 1000, 5000, 20000]))
    kind = draw(st.sampled_from(["list", "object", "open", "mixed"]))
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    if kind == "object":
        return Raw('{"a": ' * depth + "1" + "}" * depth)
    if kind == "open":  # never closed
        return Raw("[" * depth)
    return Raw('[{"x": ' * (depth // 2) + "0" + "}]" * (depth // 2))


NASTY_NUMBERS = st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"),
                                 Raw("1" + "0" * 5000), Raw("-0"), Raw("1E400"), Raw("4.9e-324")])
BIG_IDS = st.sampled_from([2**40, 2**32, 2**32 - 1, 2**31, 2**63, 2**64, 2**70, -1, -(2**40), VOCAB, VOCAB - 1, 0])
IDS = st.lists(st.integers(0, VOCAB - 1) | BIG_IDS, max_size=6)
LEAF = (st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12) | BIG_IDS)
# Junk of any type; deep nesting has a shape of its own below, so that it does not crowd out the rest.
JUNK = st.recursive(LEAF, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
                    max_leaves=8)
FLOAT = st.floats() | st.integers(-5, 5) | NASTY_NUMBERS
SCHEMAS = st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "string", "maxLength": 3},
                           {"enum": ["x", "y"]}, True, "{}", '{"type": "integer"}',
                           '{"items": ' * 300 + "{}" + "}" * 300])

# Plausible values (and edge cases) per field; each drawn field is junk instead a quarter of the time.
# max_tokens stays at 1-2 (else out of range), so the engine's share of the run stays small.
TOKENS = st.sampled_from([1, 2, 0, -1, 2**32, 2**40, 1.5, "2", True]) | NASTY_NUMBERS
SAMPLING: dict[str, Any] = {
    "max_tokens": TOKENS, "max_completion_tokens": TOKENS, "min_tokens": TOKENS,
    "temperature": FLOAT, "top_p": FLOAT, "min_p": FLOAT, "presence_penalty": FLOAT, "frequency_penalty": FLOAT,
    "repetition_penalty": FLOAT, "length_penalty": FLOAT,
    "top_k": st.integers(-2, VOCAB + 2) | BIG_IDS, "n": st.integers(-1, 17),
    "best_of": st.integers(0, 3), "beam_width": st.integers(0, 9),
    "use_beam_search": st.booleans(), "early_stopping": st.booleans(),
    "seed": st.integers(-1, 2**64) | NASTY_NUMBERS, "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3),
    "stop_token_ids": IDS, "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str) | BIG_IDS.map(str) | st.text(max_size=5),
                                  FLOAT, max_size=4),
    "prompt_logprobs": st.integers(-1, 21), "cache_salt": st.text(max_size=8), "user": st.text(max_size=8),
    "model": st.text(max_size=8),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.builds(
        lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, SCHEMAS),
    "guided_json": SCHEMAS, "guided_regex": st.sampled_from(["[a-z]{1,3}", "(", "a*"]),
    "guided_choice": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "json_object", "bad"]),
                                          SCHEMAS | JUNK, max_size=2),
}
COMPLETION = {**SAMPLING, "prompt": st.text(max_size=20) | IDS | st.lists(IDS, max_size=3)
              | st.lists(st.text(max_size=5), max_size=3),
              "echo": st.booleans(), "logprobs": st.integers(-1, 21), "suffix": st.text(max_size=3)}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | JUNK,
                                 "content": st.text(max_size=12) | JUNK},
                                optional={"tool_calls": JUNK, "tool_call_id": JUNK, "name": JUNK})
TOOL = st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                 st.sampled_from(["f", "g", "bad name"]), SCHEMAS | JUNK)
CHAT = {**SAMPLING, "messages": st.lists(MESSAGE, max_size=3), "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 21), "tools": st.lists(TOOL, max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
        "parallel_tool_calls": st.booleans()}
BASE = {"/v1/completions": {"prompt": "The quick brown fox", "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(ROUTES))
    fields = COMPLETION if route == ROUTES[0] else CHAT
    shape = draw(st.sampled_from(["fields"] * 6 + ["unknown", "deep", "top", "truncated", "garbled"]))
    if shape == "top":  # not an object at all
        return route, dumps(draw(JUNK | _deep())).encode()
    body: dict[str, Any] = dict(BASE[route])
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(JUNK) if draw(st.integers(0, 3)) == 0 else draw(fields[name])
    if shape == "unknown":
        body[draw(st.text(min_size=1, max_size=12))] = draw(JUNK)
    elif shape == "deep":  # a known field (or a new one) nested too deep
        body[draw(st.sampled_from(sorted(fields)) | st.text(max_size=5))] = draw(_deep())
    raw = dumps(body).encode()
    if shape == "truncated":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif shape == "garbled":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    return route, raw


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    port = free_port()
    with serve("--model", model_dir, "--num-gpu-blocks", "64", env={"PAGEDSERVE_HTTP_PORT": str(port)}) as s:
        with s.client() as c:
            assert c.model_info().vocab_size == VOCAB
        yield s, port


def send(port: int, path: str, body: bytes) -> tuple[int, str, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.getheader("Content-Type") or "", r.read()
    finally:
        c.close()


def check_answer(status: int, ctype: str, data: bytes) -> None:
    assert status < 500, (status, data[:500])
    if status >= 400:  # OpenAI's error shape
        err = json.loads(data)["error"]
        assert err["type"] and err["message"] and err["code"] == status, data[:300]  # vLLM's ErrorInfo
    elif ctype.startswith("text/event-stream"):
        assert data.rstrip().endswith(b"data: [DONE]") and b'"InternalServerError"' not in data, data[-500:]
    else:
        assert "choices" in json.loads(data), data[:300]


@settings(max_examples=1000, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(req=requests())
def test_no_body_gets_a_5xx(gw: tuple[Server, int], req: tuple[str, bytes]) -> None:
    path, body = req
    check_answer(*send(gw[1], path, body))


def test_still_serving_and_nothing_leaked(gw: tuple[Server, int]) -> None:
    # Runs after the fuzz (file order), on the same server.
    for path, body in BASE.items():
        status, ctype, data = send(gw[1], path, json.dumps(body).encode())
        assert status == 200, data
        assert json.loads(data)["usage"]["completion_tokens"] >= 1
    wait_all_free(gw[0])
