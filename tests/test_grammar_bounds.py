"""Cost bounds on structured-output specs (issue 19, "a grammar stalls the
whole batch"): every hostile spec of the issue is refused by the frontend's
validation in well under a second, before xgrammar parses it, with a message
naming the bound and its limit; realistic specs pass; specs just under the
bounds compile in under a second; and over HTTP, beside a greedy stream, each
hostile spec is a fast 400 while the stream never stalls and health stays
SERVING."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
from e2e_util import Server, free_port, serve
from grpc_health.v1 import health_pb2, health_pb2_grpc
from models import make_tiny_model

from pagedserve.bench.structured import CHOICES, REGEX, SCHEMA, TOOL_PARAMS
from pagedserve.common import grammar as g
from pagedserve.common.messages.types import StructuredSpec
from pagedserve.frontend.openai_api import openai_structured
from pagedserve.frontend.core import structured as fs
from pagedserve.frontend.core.validation import ValidationError
from pagedserve.v1 import generation_pb2 as pb

FIELD = "sampling_params.structured_outputs"


def nested_schema_text(depth: int) -> str:
    """An object schema ``depth`` objects deep, as text (json.dumps would recurse)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


def nested_schema(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def optional_properties(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"f{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                             for i in range(n)}}


def null_loops(n: int) -> str:
    """n nullable loops side by side: the matcher follows every split of the text."""
    return "root ::= " + " ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(
        f'r{i} ::= [a-z] r{i} | ""' for i in range(n))


# name -> (oneof field, value, the bound its refusal names)
HOSTILE: dict[str, tuple[str, Any, str]] = {
    "choice 256 x 1,024 chars": ("choice", [f"c{i:03d}" + "x" * 1020 for i in range(256)], "MAX_CHOICES_TOTAL_CHARS"),
    "left-recursive EBNF": ("grammar", 'root ::= root root | [a-z]', "left recursion"),
    "JSON schema 200 deep": ("json", nested_schema_text(200), "MAX_SCHEMA_DEPTH"),
    "regex (.*){1000}": ("regex", "(.*){1000}", "MAX_NESTED_REPEAT"),
    "regex [a-z]{1,50000}": ("regex", "[a-z]{1,50000}", "MAX_REPEAT"),
    "enum of 5,000": ("json", json.dumps({"enum": [f"value{i}" for i in range(5000)]}), "MAX_ENUM_VALUES"),
    "JSON schema 1,000 deep": ("json", nested_schema_text(1000), "MAX_SCHEMA_DEPTH"),
    # beyond the list: each stalled or compiled for seconds here
    "regex ([a-z]+){1,16}": ("regex", "([a-z]+){1,16}", "MAX_NESTED_REPEAT"),
    "regex (a.*b) x 1,000": ("regex", "(a.*b)" * 1000, "MAX_LOOPS"),
    "regex [a-z]+ x 16": ("regex", "[a-z]+" * 16, "MAX_ADJACENT_LOOPS"),
    "EBNF 70 nullable loops": ("grammar", null_loops(70), "MAX_LOOPS"),
    "EBNF 16 nullable loops": ("grammar", null_loops(16), "MAX_ADJACENT_LOOPS"),
    "1,650 optional properties": ("json", json.dumps(optional_properties(1650)), "MAX_OBJECT_PROPERTIES"),
    "pattern two {1,200}": ("json", json.dumps({"type": "string", "pattern": "[a-z]{1,200}[a-z]{1,200}"}),
                            "MAX_PATTERN_REPEAT_TOTAL"),
}


def _proto(kind: str, value: Any) -> pb.StructuredOutputs:
    if kind == "choice":
        return pb.StructuredOutputs(choice=pb.Choices(choices=value))
    return pb.StructuredOutputs(**{kind: value})


@pytest.fixture
def no_parse(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """xgrammar must not be reached: the bounds refuse first."""
    def boom(spec: StructuredSpec) -> Any:
        raise AssertionError(f"parsed {spec.kind} before the bounds refused it")

    fs._spec_error.cache_clear()
    monkeypatch.setattr(fs, "parse_grammar", boom)
    yield
    fs._spec_error.cache_clear()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_specs_are_refused_fast_naming_the_bound(name: str, no_parse: None) -> None:
    kind, value, bound = HOSTILE[name]
    t0 = time.perf_counter()
    with pytest.raises(ValidationError) as e:
        fs.spec_from_proto(_proto(kind, value))
    took = time.perf_counter() - t0
    assert took < 1.0, (name, took)
    assert e.value.field == f"{FIELD}.{kind}"
    msg = str(e.value)
    assert bound in msg, msg
    if bound != "left recursion":  # the bound and its limit: "(bound MAX_REPEAT=1000)"
        assert f"{bound}={getattr(g, bound)}" in msg, msg


def test_http_schema_objects_are_bounded_before_json_dumps() -> None:
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(5000):  # json.dumps of this would be a RecursionError
        deep = {"properties": {"a": deep}}
    sp = pb.SamplingParams()
    t0 = time.perf_counter()
    with pytest.raises(ValidationError) as e:
        openai_structured.apply_structured({"guided_json": deep}, sp)
    assert time.perf_counter() - t0 < 1.0
    assert e.value.field == "guided_json" and "MAX_SCHEMA_DEPTH=64" in str(e.value)


REALISTIC: dict[str, tuple[str, Any]] = {
    "20-field schema": ("json", json.dumps({
        "type": "object", "required": [f"f{i}" for i in range(20)],
        "properties": {f"f{i}": [{"type": "string", "maxLength": 200}, {"type": "integer", "minimum": 0},
                                 {"type": "array", "items": {"type": "number"}, "maxItems": 10},
                                 {"type": "boolean"}][i % 4] for i in range(20)}})),
    "200-value enum": ("json", json.dumps({"type": "string", "enum": [f"option {i}" for i in range(200)]})),
    "bench schema": ("json", json.dumps(SCHEMA)),
    "tool parameters": ("json", json.dumps(TOOL_PARAMS)),
    "email pattern": ("json", json.dumps({"type": "string", "pattern": r"^[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}$"})),
    "date pattern": ("json", json.dumps({"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"})),
    "nested 10 objects": ("json", json.dumps(nested_schema(10))),
    "[a-z]{1,64}": ("regex", "[a-z]{1,64}"),
    r"\d{3}-\d{4}": ("regex", r"\d{3}-\d{4}"),
    "IPv4": ("regex", r"(\d{1,3}\.){3}\d{1,3}"),
    "bench regex": ("regex", REGEX),
    "braces and classes are literals": ("regex", r"a\{99999\}[{1,99999}][\]x]{2}"),
    "choices": ("choice", CHOICES),
    "right-recursive EBNF": ("grammar", 'root ::= item ("," ws item)*\nitem ::= [a-z]+ | "(" root ")"\n'
                                        'ws ::= [ \\t]*  # spaces\n'),
    "expression EBNF": ("grammar", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                                   'term ::= factor (("*" | "/") factor)*\nfactor ::= [0-9]+ | "(" expr ")"'),
    "EBNF counted": ("grammar", 'root ::= word{1,8} "."\nword ::= [a-z]{1,12} " "?'),
    "JSON-like EBNF": ("grammar", 'root ::= object\nvalue ::= object | array | string | [0-9]+ | "true" | "null"\n'
                                  'object ::= "{" ws (string ws ":" ws value ws ("," ws string ws ":" ws value ws)*)? "}"\n'
                                  'array ::= "[" ws (value ws ("," ws value ws)*)? "]"\n'
                                  'string ::= "\\"" [^"\\\\]* "\\""\nws ::= [ \\t\\n]*'),
    "words and spaces": ("regex", r"\w+\s+\w+\s+\w+\s+\w+[.!?]"),
}


@pytest.mark.parametrize("name", sorted(REALISTIC))
def test_realistic_specs_pass(name: str) -> None:
    kind, value = REALISTIC[name]
    spec = fs.spec_from_proto(_proto(kind, value))
    assert spec is not None and spec.kind == kind


@pytest.mark.parametrize("grammar, cycle", [
    ('root ::= root "a" | "a"', "root -> root"),
    ('root ::= a "x"\na ::= b "x"\nb ::= a | "y"', "a -> b -> a"),
    ('root ::= a "b"\na ::= "c"? ("" | x) root\nx ::= "q"*', "root -> a -> root"),
    ('root ::= (x | "")* root "b" | "c"\nx ::= "d"', "root -> root"),
])
def test_left_recursion_is_found_through_nullable_prefixes(grammar: str, cycle: str) -> None:
    with pytest.raises(g.GrammarBoundError, match="left recursion") as e:
        fs.check_ebnf(grammar)
    assert cycle in str(e.value)


def test_regex_scan_counts_nesting_and_totals() -> None:
    g.check_regex("([a-z]+){8}")  # 8: at the bound
    g.check_regex("[a-z]{1,1000}[a-z]{1,1000}")  # 2,000: at the bound
    g.check_regex("(?:ab|c){2,5}(?P<n>x)*")
    g.check_regex("[a-z]+[0-9]+[a-z]+[0-9]+")  # side by side, but no text both can take
    for pattern, bound in [("(([a-z]+){4}){4}", "MAX_NESTED_REPEAT"), ("([a-z]?){1,1000}", "MAX_NESTED_REPEAT"),
                           ("([a-z]{1,10}){1,100}", "MAX_NESTED_REPEAT"), ("(a{500}){5}", "MAX_REPEAT_TOTAL"),
                           ("a{" + "9" * 5000 + "}", "MAX_REPEAT"), ("(x*y)" * 65, "MAX_LOOPS"),
                           ("a+a*(a|b)+[^x]+", "MAX_ADJACENT_LOOPS"), (r"\d+\w+[0-9]+\d*", "MAX_ADJACENT_LOOPS")]:
        with pytest.raises(g.GrammarBoundError) as e:
            g.check_regex(pattern)
        assert e.value.bound == bound, (pattern, e.value)


def test_the_analysis_itself_stays_fast_on_worst_inputs() -> None:
    """Inputs at MAX_GRAMMAR_CHARS built to make the scans slow."""
    chain = "\n".join(f"r{i} ::= r{i + 1}" for i in range(500)) + '\nr500 ::= ""'  # nullable one rule a round
    for check, text in [(fs.check_ebnf, chain), (fs.check_ebnf, "root ::= " + "(" * 60 + '"a"' + ")" * 60),
                        (g.check_regex, "(" * 4000 + ")" * 4000), (g.check_regex, "[a-z]" * 1600),
                        (g.check_schema_text, "[" * 32000 + "]" * 32000)]:
        # the best of three: a slow scan is slow every time, a busy CI machine's pause is not
        assert min(_timed(check, text[:g.MAX_SPEC_CHARS]) for _ in range(3)) < 1.0, text[:40]


def _timed(check: Any, text: str) -> float:
    t0 = time.perf_counter()
    try:
        check(text)
    except g.GrammarBoundError:
        pass
    return time.perf_counter() - t0


# ------------------------------------------------------------------ compile time just under the bounds
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("bounds"), "llama", seed=0)


UNDER = {
    "choices 8 x 1,024": ("choice", json.dumps([f"c{i}" + "x" * 1020 for i in range(8)])),
    "EBNF 8 KiB of literals": ("grammar", "root ::= " + " | ".join(f"l{i}" for i in range(8)) + "\n" +
                               "\n".join(f'l{i} ::= "{i:04d}' + "y" * 990 + '"' for i in range(8))),
    "regex (a.*b) x 64": ("regex", "(a.*b)" * 64),
    "EBNF 64 loops": ("grammar", "root ::= " + " ".join(f'"<{i}>" r{i}' for i in range(64)) + "\n" +
                      "\n".join(f'r{i} ::= [a-z] r{i} | ""' for i in range(64))),
    "regex 2 x {1,1000}": ("regex", "[a-z]{1,1000}[a-z]{1,1000}"),
    "regex ([a-z]{1,125}){8}": ("regex", "([a-z]{1,125}){8}"),
    "schema 63 levels": ("json", nested_schema_text(31)),
    "8 objects x 127 optional": ("json", json.dumps({"type": "object", "properties": {
        f"o{j}": optional_properties(127) for j in range(8)}})),
    "anyOf of 1,200 (4,801 values)": ("json", json.dumps({"anyOf": [
        {"type": "integer", "minimum": i, "maximum": i + 1} for i in range(1200)]})),
    "enum of 1,000": ("json", json.dumps({"enum": ["x" * 50 + str(i) for i in range(1000)]})),
    "pattern at 128": ("json", json.dumps({"type": "string", "pattern": "[a-z]{1,64}@[a-z]{1,64}"})),
}


def test_specs_just_under_the_bounds_compile_in_under_a_second(model_dir: str) -> None:
    from pagedserve.common.grammar import parse_grammar
    from pagedserve.gpuworker.structured import StructuredDecoding

    sd = StructuredDecoding(model_dir, 509, (0,))
    sd.compiler()
    rows = []
    for name, (kind, text) in UNDER.items():
        spec = StructuredSpec(kind, text)
        assert fs._spec_error(spec) is None, (name, fs._spec_error(spec))
        t0 = time.perf_counter()
        sd.compiler().compile_grammar(parse_grammar(spec))
        rows.append((name, time.perf_counter() - t0))
    print("\ncompile just under the bounds (tiny model, 509 tokens):")
    for name, s in rows:
        print(f"  {name:28s} {s * 1000:8.1f} ms")
    # Under 1 s here when the VM is quiet (0.3 s at most); its other jobs can double that.
    assert all(s < 2.0 for _, s in rows), rows


# ------------------------------------------------------------------ end to end, over HTTP
@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[Server]:
    port = free_port()
    with serve("--model", model_dir, "--num-gpu-blocks", "96", "--max-num-seqs", "8",
               env={"PAGEDSERVE_HTTP_PORT": str(port)}) as s:
        yield s


HTTP_FIELD = {"choice": "guided_choice", "grammar": "guided_grammar", "regex": "guided_regex", "json": "guided_json"}


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class GreedyStreams:
    """Greedy streams one after another until stopped; the worst gap between
    two chunks of one stream (its first token excluded)."""

    def __init__(self, client: openai.OpenAI, model: str) -> None:
        self.client, self.model = client, model
        self.stop = threading.Event()
        self.worst_gap = 0.0
        self.chunks = 0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                last = None
                for chunk in self.client.completions.create(model=self.model, prompt="The quick brown fox",
                                                            max_tokens=200, temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
                    now = time.monotonic()
                    if last is not None:
                        self.worst_gap = max(self.worst_gap, now - last)
                    last = now
                    self.chunks += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def _health(server: Server) -> int:
    with grpc.insecure_channel(server.addr) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_hostile_specs_over_http_beside_a_stream(server: Server) -> None:
    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    streams = GreedyStreams(client, model)
    streams.thread.start()
    while streams.chunks < 5 and streams.error is None:
        time.sleep(0.05)
    rows: list[tuple[str, int, float, str]] = []
    for name, (kind, value, _) in HOSTILE.items():
        body: dict[str, Any] = {"model": model, "prompt": "hi", "max_tokens": 8}
        # schemas as objects, as clients send them; the deep ones as text (json.loads would recurse here)
        body[HTTP_FIELD[kind]] = json.loads(value) if kind == "json" and "deep" not in name else value
        t0 = time.monotonic()
        status, answer = _post(server.http + "/v1/completions", body)
        took = time.monotonic() - t0
        err = answer.get("error", {})
        rows.append((name, status, took, str(err.get("message", ""))[:110]))
    with server.client() as c:  # gRPC: the deep schemas reach the frontend's own bound
        for depth in (200, 1000):
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                c.generate("hi", max_tokens=8, structured_outputs=pb.StructuredOutputs(json=nested_schema_text(depth)))
            rows.append((f"gRPC schema {depth} deep", e.value.code().value[0], time.monotonic() - t0,
                         str(e.value.details())[:110]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    time.sleep(1.0)  # the stream keeps going after the last refusal
    streams.stop.set()
    streams.thread.join(60)
    health = _health(server)
    client.close()
    print("\nhostile spec                  status  answered   message")
    for name, status, took, msg in rows:
        print(f"  {name:28s} {status:5d} {took * 1000:8.1f} ms  {msg}")
    print(f"concurrent greedy stream: {streams.chunks} chunks, worst inter-token gap {streams.worst_gap * 1000:.1f} ms; "
          f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(health)}")
    assert streams.error is None, streams.error
    for name, status, took, msg in rows:
        assert status in (400, grpc.StatusCode.INVALID_ARGUMENT.value[0]) and took < 1.0, (name, status, took, msg)
    assert streams.worst_gap < 1.0
    assert health == health_pb2.HealthCheckResponse.SERVING
