"""One request schema (issue 39): the sampling fields' table in
common/request_fields.py is the only place a bound is written.

* A bound changed in the table at run time (not in the source) reaches the
  gRPC error and the HTTP error of a real frontend (its gRPC server and HTTP
  gateway on loopback, against a scheduler socket that runs the scheduler's
  own admission check), the admission check itself, and the docs' field list.
* Over the real four processes (tiny Llama), every field's bounds and the
  values just past them get the same verdict over HTTP and over gRPC. A value
  the proto's type cannot hold (a negative uint32, an int32 past 2^31) is sent
  as the raw varint a client in another language could put on the wire.
* docs/api.md's field list is the rendered table.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import ClientSession
from grpc_health.v1 import health
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.common import request_fields as rf
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.metrics import FrontendMetrics
from pagedserve.frontend.openai_api import http_fields, http_gateway
from pagedserve.frontend.core.auth import ApiKeys
from pagedserve.frontend.core.engine_client import EngineClient
from pagedserve.frontend.core.generation import FrontendConfig, GenerationService
from pagedserve.frontend.grpc_api.server import serve as serve_grpc
from pagedserve.frontend.core.validation import Limits, sampling_params, validate
from pagedserve.scheduler.admission import check_add
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from e2e_util import Server, free_port, serve
from models import make_tiny_model, train_tokenizer
from test_engine_client_health import INFO, FakeScheduler, stats

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api.md"


# ------------------------------------------------------------------ the docs
def test_the_docs_field_list_is_the_rendered_table() -> None:
    text = DOCS.read_text()
    m = re.search(r"<!-- request-fields:start -->\n(.*?)<!-- request-fields:end -->", text, re.S)
    assert m is not None, "docs/api.md lost its request-fields markers"
    assert m.group(1) == rf.render_markdown(), "regenerate: python -m pagedserve.common.request_fields"


def test_every_table_field_is_an_engine_or_frontend_field_with_the_tables_default() -> None:
    engine = {f.name for f in msgspec.structs.fields(SamplingParams)}
    for name, f in rf.TABLE.items():
        if f.level == "request":
            assert name in pb.GenerateRequest.DESCRIPTOR.fields_by_name and name in fe.AddRequest.__struct_fields__
            continue
        assert name in engine or name in ("stop", "include_stop_str_in_output", "detokenize"), name
        if name in engine and f.type in rf.SCALARS:
            assert getattr(SamplingParams(), name) == f.default, name
        assert name in pb.SamplingParams.DESCRIPTOR.fields_by_name or f.openai is not None, name


# ------------------------------------------------------------------ one SamplingParams from either wire
VOCAB, MAX_MODEL_LEN, PROMPT = 509, 64, [5, 6, 7]
LIMITS = {"vocab_size": VOCAB, "max_model_len": MAX_MODEL_LEN, "max_n": 16, "max_beam_width": 8, "max_stop_ids": 64}
def _in_bounds(f: rf.Field) -> st.SearchStrategy[Any]:
    lo = LIMITS[f.lo] if isinstance(f.lo, str) else f.lo
    hi = LIMITS[f.hi] if isinstance(f.hi, str) else f.hi
    if f.type is bool:
        return st.booleans()
    if f.type is int:
        return st.integers(max(lo, 0), min(hi, 2**31 - 1))  # inside every wire type
    # multiples of 2^-7: float32 (gRPC) and double (JSON) hold them exactly
    return st.integers(math.ceil(lo * 128), math.floor(hi * 128)).map(lambda k: k / 128)


_DRAWN = [n for n in rf.SAMPLING if rf.TABLE[n].type in rf.SCALARS and rf.TABLE[n].vllm
          and n not in ("max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "n", "beam_width")]


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional={n: _in_bounds(rf.TABLE[n]) for n in _DRAWN}))
def test_the_same_fields_make_the_same_engine_params_over_either_wire(drawn: dict[str, Any]) -> None:
    """gRPC's decoder and HTTP's parser hand validate the same values: one SamplingParams."""
    limits = Limits(VOCAB, MAX_MODEL_LEN)
    over_grpc = sampling_params(pb.SamplingParams(max_tokens=5, **drawn), len(PROMPT), limits).params
    body = {"max_tokens": 5, **drawn}
    values = {**http_fields.sampling_values(body, limits), "max_tokens": 5}
    over_http = validate(values, len(PROMPT), limits, prefix="", route="completions").params
    assert over_http == over_grpc


# ------------------------------------------------------------------ a bound changed at run time
async def _scheduler(fake: FakeScheduler) -> None:
    """Answers queries; runs the scheduler's admission on each AddRequest and
    answers as the scheduler does (control.py): refused, or one token and done."""
    while True:
        msg = await fake.recv()
        if isinstance(msg, fe.InfoQuery):
            await fake.send(msgspec.structs.replace(INFO, query_id=msg.query_id))
        elif isinstance(msg, fe.StatsQuery):
            await fake.send(stats(msg.query_id, False))
        elif isinstance(msg, fe.AddRequest):
            why = check_add(msg, INFO.model)
            n = len(msg.prompt_token_ids)
            delta = fe.TokenDelta(msg.request_id, 0, [7], fe.FinishReason.LENGTH, n) if why is None else \
                fe.TokenDelta(msg.request_id, 0, [], fe.FinishReason.ERROR, n, f"invalid request: {why}",
                              error_kind=fe.ErrorKind.INVALID_REQUEST)
            await fake.send(fe.Outputs([delta]))


async def _over_both(tmp: str, temperatures: list[float]) -> list[tuple[Any, str, int, str]]:
    """(gRPC code, details, HTTP status, HTTP message) per temperature, from one in-process frontend."""
    ctx = zmq.asyncio.Context()
    fake = FakeScheduler(ctx, os.path.join(tmp, "run"))
    sched = asyncio.create_task(_scheduler(fake))
    engine = EngineClient(fake.addrs, resume_timeout_s=5)
    metrics = FrontendMetrics(lambda: engine.last_stats, lambda: engine.num_streams)
    svc = GenerationService(engine, train_tokenizer(100), FrontendConfig(), metrics)
    grpc_port, http_port = free_port(), free_port()
    server = await serve_grpc(svc, "127.0.0.1", grpc_port, health.aio.HealthServicer())
    runner = await http_gateway.start(http_gateway.Gateway(svc, ApiKeys([]), metrics.registry, lambda: True),
                                      "127.0.0.1", http_port)
    out = []
    try:
        await engine.start(10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as ch, ClientSession() as http:
            stub = pb_grpc.GenerationStub(ch)
            for t in temperatures:
                call = stub.Generate(pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6]),
                                                        sampling_params=pb.SamplingParams(max_tokens=1, temperature=t)))
                code, details = grpc.StatusCode.OK, ""
                try:
                    async for _ in call:
                        pass
                except grpc.aio.AioRpcError as e:
                    code, details = e.code(), e.details() or ""
                async with http.post(f"http://127.0.0.1:{http_port}/v1/completions",
                                     json={"prompt": [5, 6], "max_tokens": 1, "temperature": t}) as r:
                    body = await r.json()
                out.append((code, details, r.status, body.get("error", {}).get("message", "")))
    finally:
        sched.cancel()
        await runner.cleanup()
        await server.stop(0)
        await engine.close()
        fake.close()
        ctx.term()
    return out


def _admission(temperature: float) -> str | None:
    return check_add(fe.AddRequest("r", [5, 6], SamplingParams(max_tokens=1, temperature=temperature), 0.0),
                     INFO.model)


def test_a_bound_changed_in_the_table_reaches_both_protocols_admission_and_the_docs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert rf.TABLE["temperature"].hi == 2.0 and _admission(1.75) is None and "| [0, 2] |" in rf.render_markdown()
    monkeypatch.setitem(rf.TABLE, "temperature", dataclasses.replace(rf.TABLE["temperature"], hi=1.5))
    seen = asyncio.run(asyncio.wait_for(_over_both(str(tmp_path), [1.75, 1.25]), 60))
    (code, details, status, message), ok = seen
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == \
        "sampling_params.temperature: must be in [0.0, 1.5], got 1.75"
    assert status == 400 and message == "temperature: must be in [0.0, 1.5], got 1.75"
    assert ok == (grpc.StatusCode.OK, "", 200, "")  # inside the new bound: the frontend and admission let it run
    assert _admission(1.75) == "temperature: must be in [0.0, 1.5], got 1.75"
    assert _admission(1.25) is None
    row = next(line for line in rf.render_markdown().splitlines() if line.startswith("| `temperature`"))
    assert "| [0, 1.5] |" in row


# ------------------------------------------------------------------ every bound, both protocols
BASE_MAX_TOKENS = 4  # every case's max_tokens but max_tokens' own (min_tokens' bound)
# Values one protocol spells differently (docs/api.md): (name, value) -> (HTTP verdict, gRPC verdict).
HTTP_ALIASES = {("seed", -1): ("accepted", "refused"),  # vLLM's "no seed"; the uint64 wire's -1 is 2^64 - 1
                ("cache_salt", ""): ("refused", "accepted")}  # vLLM refuses ""; proto3's "" is no salt
_WIRE = {  # proto scalar type -> the values its field holds
    "uint32": (0, 2**32 - 1), "int32": (-(2**31), 2**31 - 1), "uint64": (0, 2**64 - 1)}
_TYPES = {13: "uint32", 5: "int32", 4: "uint64"}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    with serve("--model", model_dir, "--num-gpu-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN),
               "--generation-config", "vllm") as s:  # no model defaults: the table's are the defaults
        yield s


def _step(f: rf.Field, bound: float) -> float:
    if f.type is int:
        return 1
    return 2.0**-7 if bound == 0 else min(2.0**-7, abs(bound) / 2)  # powers of two: float32 holds them exactly


def _scalar_cases(f: rf.Field) -> list[Any]:
    env = {**LIMITS, "max_tokens": BASE_MAX_TOKENS}
    values: list[Any] = []
    for b in (f.lo, f.hi):
        if b is None:
            continue
        v = env[b] if isinstance(b, str) else b
        s = _step(f, v)
        values += [v - s, v, v + s]
    return sorted(set(values))


def _cases(f: rf.Field) -> list[Any]:
    """Each bound and the values just past it (containers: the count, and an entry's bound)."""
    if f.type is str:
        lo, hi = f.lo, f.hi
        assert isinstance(lo, int) and isinstance(hi, int)
        return ["s" * (lo - 1), "s" * lo, "s" * hi, "s" * (hi + 1), *(f"a{c}b" for c in f.forbidden)]
    if f.type in rf.SCALARS:
        return _scalar_cases(f)
    most = LIMITS[f.hi] if isinstance(f.hi, str) else f.hi
    assert isinstance(most, int)
    if f.name == "stop":
        return [["s"] * most, ["s"] * (most + 1), [""], ["x"], ["x" * 256], ["x" * 257]]
    if f.name == "stop_token_ids":
        return [list(range(most)), list(range(most + 1)), [0], [-1], [VOCAB - 1], [VOCAB]]
    if f.name == "logit_bias":
        hi, s = float(f.item_hi), 2.0**-7  # type: ignore[arg-type]
        return [{i: 1.0 for i in range(most)}, {i: 1.0 for i in range(most + 1)}, {5: hi}, {5: hi + s},
                {5: -hi}, {5: -hi - s}, {VOCAB - 1: 1.0}, {VOCAB: 1.0}]
    raise AssertionError(f"no cases for container field {f.name}: add them")


def _varint(v: int) -> bytes:
    v %= 2**64
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _grpc_bytes(name: str, value: Any, max_tokens: int) -> bytes:
    """A GenerateRequest with ``name: value``; a value outside the proto type goes as its raw varint."""
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=PROMPT), sampling_params=pb.SamplingParams(
        **({} if name == "max_tokens" else {"max_tokens": max_tokens})))
    if rf.TABLE[name].level == "request":
        setattr(req, name, value)
        return req.SerializeToString()
    fd = pb.SamplingParams.DESCRIPTOR.fields_by_name[name]
    wire = _TYPES.get(fd.type)
    items = value if isinstance(value, list) else list(value) if isinstance(value, dict) else [value]
    if wire is None or all(_WIRE[wire][0] <= v <= _WIRE[wire][1] for v in items if isinstance(v, int)):
        sp = req.sampling_params
        if isinstance(value, dict):
            sp.logit_bias.update(value)
        elif isinstance(value, list):
            getattr(sp, name).extend(value)
        else:
            setattr(sp, name, value)
        return req.SerializeToString()
    # Raw varints (a repeated field's elements unpacked, which every parser accepts).
    inner = b"".join(_varint(fd.number << 3) + _varint(v) for v in items)
    return req.SerializeToString() + _varint(4 << 3 | 2) + _varint(len(inner)) + inner  # merged into field 4


def _grpc_verdict(srv: Server, raw: bytes) -> str:
    with grpc.insecure_channel(srv.addr) as ch:
        call = ch.unary_stream("/pagedserve.v1.Generation/Generate", request_serializer=lambda b: b,
                               response_deserializer=pb.GenerateResponse.FromString)
        try:
            for _ in call(raw, timeout=120):
                pass
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
            return "refused"
    return "accepted"


def _http_verdict(srv: Server, body: dict[str, Any]) -> str:
    req = urllib.request.Request(srv.http + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            return "accepted"
    except urllib.error.HTTPError as e:
        assert e.code == 400, (e.code, e.read()[:300])
        return "refused"


def _http_value(name: str, value: Any) -> Any:
    return {str(k): v for k, v in value.items()} if name == "logit_bias" else value


def test_every_bound_gets_the_same_verdict_over_http_and_grpc(srv: Server) -> None:
    checked, differ = [], []
    for name, f in rf.TABLE.items():
        if f.type is bool:
            continue  # no bound
        for value in _cases(f):
            max_tokens = BASE_MAX_TOKENS
            over_grpc = _grpc_verdict(srv, _grpc_bytes(name, value, max_tokens))
            alias = HTTP_ALIASES.get((name, value)) if not isinstance(value, (list, dict)) else None
            if f.http_name is None:
                checked.append((name, value, over_grpc))
                continue
            body = {"prompt": PROMPT, **({} if name == "max_tokens" else {"max_tokens": max_tokens}),
                    f.http_name: _http_value(name, value)}
            over_http = _http_verdict(srv, body)
            checked.append((name, value, over_grpc))
            if alias is not None:
                assert (over_http, over_grpc) == alias, (name, value, over_http, over_grpc)
            elif over_http != over_grpc:
                differ.append((name, repr(value)[:60], over_http, over_grpc))
    assert not differ, f"(field, value, HTTP, gRPC) with different verdicts: {differ}"
    # The bounds themselves are accepted and the values past them refused (both protocols agree, above).
    verdicts = {(n, repr(v)): g for n, v, g in checked}
    for name, f in rf.TABLE.items():
        if f.type in (int, float):
            env = {**LIMITS, "max_tokens": BASE_MAX_TOKENS}
            lo = env[f.lo] if isinstance(f.lo, str) else f.lo
            hi = env[f.hi] if isinstance(f.hi, str) else f.hi
            assert verdicts[(name, repr(lo))] == "accepted" and verdicts[(name, repr(hi))] == "accepted", name
            assert verdicts[(name, repr(hi + _step(f, hi)))] == "refused", name
            if (name, lo - _step(f, lo)) not in HTTP_ALIASES:
                assert verdicts[(name, repr(lo - _step(f, lo)))] == "refused", name
    assert len(checked) > 100
