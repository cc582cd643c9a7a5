"""Structured outputs (issue 12): specs validated in the frontend, grammars
enforced by the worker's batched token mask. In-process engine checks
(preemption replay, n > 1, the mask itself), then the real four processes
over gRPC and over the OpenAI HTTP API with the official client: 50 outputs
per kind parse and validate on a tiny random model, a named tool call returns
valid arguments, bad specs are refused naming the field."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import openai
import pytest
import torch
from e2e_util import Server, free_port, serve
from models import make_tiny_model

from pagedserve.bench.structured import CHOICES, REGEX, SCHEMA, TOOL_PARAMS, check_output, spec
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import SamplingParams, StructuredSpec
from pagedserve.frontend.core.chat_template import render_chat
from pagedserve.frontend.core.validation import Limits, ValidationError, sampling_params
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.structured import StructuredDecoding
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient
from pagedserve.v1 import generation_pb2 as pb

N = 50
MAX_TOKENS = 256
TOOL_MAX_TOKENS = 200
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("structured"), "llama", seed=0)


def _engine(model_dir: str, blocks: int) -> EngineCore:
    cfg = EngineConfig(model=model_dir, block_size=8, num_gpu_blocks=blocks, max_num_seqs=64)
    return EngineCore(cfg, InProcessBlockClient(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks,
                                                                       i.block_size)),
                      InProcessWorkerClient(ModelRunner(cfg)))


def _texts(core: EngineCore, tok: Any) -> dict[tuple[str, int], tuple[str, str | None]]:
    acc: dict[tuple[str, int], list[Any]] = {}
    for d in core.run_until_idle():
        assert d.error is None, d.error
        a = acc.setdefault((d.request_id, d.index), [[], None])
        a[0] += d.token_ids
        a[1] = d.finish_reason or a[1]
    return {k: (tok.decode(ids, skip_special_tokens=True), fr) for k, (ids, fr) in acc.items()}


# ------------------------------------------------------------------ in-process
def test_recompute_preemption_replays_the_grammar_and_n_samples_each_follow_it(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(PROMPT).input_ids
    # 40 blocks of 8 tokens cannot hold 12 such outputs at once: recompute preemptions.
    small = _engine(model_dir, 40)
    kinds = ["json", "regex", "choice"]
    for i in range(12):
        small.handle(AddRequest(f"r{i}", ids, SamplingParams(max_tokens=MAX_TOKENS, seed=i, n=2 if i % 4 == 0 else 1,
                                                             structured=spec(kinds[i % 3])), 0.0))
    out = _texts(small, tok)
    assert small.scheduler.num_preemptions > 0 and len(out) == 15
    for (rid, _), (text, reason) in out.items():
        assert reason == "stop", (rid, text)
        check_output(kinds[int(rid[1:]) % 3], text)
    # n = 4: every forked sample has its own matcher (and its own seed stream).
    big = _engine(model_dir, 400)
    big.handle(AddRequest("n4", ids, SamplingParams(max_tokens=MAX_TOKENS, seed=3, n=4, structured=spec("json")), 0.0))
    out = _texts(big, tok)
    assert len(out) == 4 and len({t for t, _ in out.values()}) > 1
    for text, reason in out.values():
        assert reason == "stop"
        check_output("json", text)


def test_mask_allows_only_grammar_tokens_then_only_eos(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    sd = StructuredDecoding(model_dir, 509, (eos,))
    choice = StructuredSpec("choice", json.dumps(["yes", "no"]))

    class Row:
        def __init__(self, seq_id: int, params: SamplingParams) -> None:
            self.seq_id, self.params = seq_id, params

    rows = [Row(1, SamplingParams(structured=choice)), Row(2, SamplingParams())]
    sd.add(1, rows[0].params, [])
    sd.add(2, rows[1].params, [])
    logits = torch.zeros(2, 509)
    sd.apply(logits, rows)
    allowed = {tok.decode([t]) for t in (logits[0] > -1e30).nonzero().flatten().tolist()}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed), allowed
    assert bool((logits[1] == 0).all())  # the unconstrained row is untouched
    done = tok("yes", add_special_tokens=False).input_ids
    sd.add(1, rows[0].params, done)  # a re-sent sequence replays its output
    logits = torch.zeros(2, 509)
    sd.apply(logits, rows)
    assert (logits[0] > -1e30).nonzero().flatten().tolist() == [eos]
    with pytest.raises(ValueError, match="breaks its grammar"):
        sd.add(3, rows[0].params, tok("maybe", add_special_tokens=False).input_ids)
    sd.add(4, SamplingParams(structured=StructuredSpec("json", json.dumps(SCHEMA))), [])
    assert sd.compiled == 2
    sd.add(5, SamplingParams(structured=StructuredSpec("json", json.dumps(SCHEMA))), [])
    assert sd.compiled == 2  # cached by spec


def test_frontend_refuses_bad_specs_naming_the_field() -> None:
    limits = Limits(vocab_size=509, max_model_len=512)

    def refused(field: str, **kw: Any) -> str:
        so = kw.pop("so")
        with pytest.raises(ValidationError) as e:
            sampling_params(pb.SamplingParams(structured_outputs=so, **kw), 4, limits)
        assert e.value.field == field, e.value
        return str(e.value)

    f = "sampling_params.structured_outputs"
    assert "invalid JSON schema" in refused(f + ".json", so=pb.StructuredOutputs(json='{"type": "objec"}'))
    assert "not valid JSON" in refused(f + ".json", so=pb.StructuredOutputs(json="{"))
    assert "invalid regex" in refused(f + ".regex", so=pb.StructuredOutputs(regex="[a-"))
    assert "invalid grammar" in refused(f + ".grammar", so=pb.StructuredOutputs(grammar="root ::= missing"))
    refused(f + ".choice", so=pb.StructuredOutputs(choice=pb.Choices(choices=[])))
    refused(f + ".choice", so=pb.StructuredOutputs(choice=pb.Choices(choices=["x" * 1025])))
    refused(f + ".regex", so=pb.StructuredOutputs(regex="a" * (64 * 1024 + 1)))
    refused(f + ".json_object", so=pb.StructuredOutputs(json_object=False))
    ok = pb.StructuredOutputs(regex="a+")
    assert "beam" in refused(f, so=ok, beam_width=2)
    assert "ignore_eos" in refused(f, so=ok, ignore_eos=True)
    assert "min_tokens" in refused(f, so=ok, min_tokens=1)
    prep = sampling_params(pb.SamplingParams(structured_outputs=ok), 4, limits)
    assert prep.params.structured == StructuredSpec("regex", "a+")


def test_tool_calls_render_in_a_plain_form_when_the_template_has_none(model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_PARAMS}}]
    conv = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = render_chat(tok, conv, tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nsunny<|im_end|>" in text
    assert text.startswith("<|im_start|>system\nYou may call these functions:\n<tools>\n")
    assert text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------ the four processes
@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[tuple[Server, str]]:
    port = free_port()
    # Compact JSON server-wide (vLLM's flag): a random model given free whitespace pads it to the length limit.
    with serve("--model", model_dir, "--num-gpu-blocks", "1200", "--max-num-seqs", "64",
               "--structured-outputs-config", '{"disable_any_whitespace": true}',
               env={"PAGEDSERVE_HTTP_PORT": str(port)}) as s:
        yield s, f"http://127.0.0.1:{port}"


GRPC_SPECS = {
    "json": pb.StructuredOutputs(json=json.dumps(SCHEMA)),
    "regex": pb.StructuredOutputs(regex=REGEX),
    "choice": pb.StructuredOutputs(choice=pb.Choices(choices=CHOICES)),
}


@pytest.mark.parametrize("kind", sorted(GRPC_SPECS))
def test_grpc_50_outputs_per_kind_parse_and_validate(server: tuple[Server, str], kind: str) -> None:
    texts: list[str] = []
    with server[0].client() as c:
        for r in range(N // 10):  # n = 10 forked samples per request
            col = c.generate_all(PROMPT, timeout=120, max_tokens=MAX_TOKENS, n=10, seed=100 * r, temperature=1.0,
                                 structured_outputs=GRPC_SPECS[kind])
            for _, text, reason in col.results():
                assert reason == "stop", text
                texts.append(text)
        assert len(texts) == N
        for t in texts:
            check_output(kind, t)
        assert len(set(texts)) > 1  # sampled, not one answer repeated
        with pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPT, max_tokens=8, structured_outputs=pb.StructuredOutputs(regex="(ab"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("sampling_params.structured_outputs.regex: invalid regex")


@pytest.fixture(scope="module")
def oai(server: tuple[Server, str]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


HTTP_EXTRA = {
    "json": {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}},
    "regex": {"extra_body": {"structured_outputs": {"regex": REGEX}}},
    "choice": {"extra_body": {"guided_choice": CHOICES}},
}


@pytest.mark.parametrize("kind", sorted(HTTP_EXTRA))
def test_http_50_outputs_per_kind_parse_and_validate(oai: openai.OpenAI, kind: str) -> None:
    texts: list[str] = []
    for r in range(N // 10):
        resp = oai.chat.completions.create(model=oai.models.list().data[0].id, n=10, seed=7 + 100 * r,
                                           messages=[{"role": "user", "content": "Describe a pet."}],
                                           max_tokens=MAX_TOKENS, temperature=1.0, **HTTP_EXTRA[kind])  # type: ignore[arg-type]
        for ch in resp.choices:
            assert ch.finish_reason == "stop" and ch.message.content is not None
            texts.append(ch.message.content)
    assert len(texts) == N
    for t in texts:
        check_output(kind, t)


def test_named_and_required_tool_calls_and_a_tool_calls_conversation(oai: openai.OpenAI) -> None:
    model = oai.models.list().data[0].id
    # The tiny byte-level tokenizer spends ~300 tokens on the tool listing; max_model_len is 512.
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOL_PARAMS}},
                  {"type": "function", "function": {"name": "noop"}}]
    msgs: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    named = oai.chat.completions.create(model=model, messages=msgs, tools=tools, n=10, seed=1, max_tokens=TOOL_MAX_TOKENS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for ch in named.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls  # type: ignore[misc]
        assert call.function.name == "get_weather" and call.id
        check_output("tool", call.function.arguments)
    # Streaming: the name first, then the arguments as they are generated.
    stream = oai.chat.completions.create(model=model, messages=msgs, tools=tools, seed=2, max_tokens=TOOL_MAX_TOKENS,
                                         stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args, names, last = "", [], None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            names += [tc.function.name] if tc.function and tc.function.name else []
            args += tc.function.arguments or "" if tc.function else ""
        last = chunk.choices[0].finish_reason or last
    assert names == ["get_weather"] and last == "tool_calls"
    check_output("tool", args)
    req = oai.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required", seed=3,
                                      max_tokens=TOOL_MAX_TOKENS, parallel_tool_calls=False)
    ch = req.choices[0]
    assert ch.finish_reason == "tool_calls"
    (call,) = ch.message.tool_calls  # type: ignore[misc]
    assert call.function.name in ("get_weather", "noop")
    if call.function.name == "get_weather":
        check_output("tool", call.function.arguments)
    # The call and its result go back in as a conversation (rendered, not refused).
    conv = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 12 C"}]
    again = oai.chat.completions.create(model=model, messages=conv, tools=tools, tool_choice="none", max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length")


def _error(oai: openai.OpenAI, **kw: Any) -> tuple[int, str | None, str]:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=oai.models.list().data[0].id, max_tokens=8,
                                    messages=[{"role": "user", "content": "hi"}], **kw)
    body: Any = e.value.body
    return e.value.status_code, body.get("param"), body.get("message", "")


def test_http_refusals_name_the_field(oai: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert _error(oai, extra_body={"guided_json": {"type": "objec"}})[:2] == (400, "guided_json")
    assert _error(oai, extra_body={"guided_regex": "[a-"})[:2] == (400, "guided_regex")
    assert _error(oai, response_format={"type": "json_schema", "json_schema": {"name": "x"}})[:2] == \
        (400, "response_format.json_schema")
    assert _error(oai, response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})[:2] == \
        (400, "guided_regex")
    assert _error(oai, extra_body={"guided_whitespace_pattern": " "})[:2] == (400, "guided_whitespace_pattern")
    assert _error(oai, extra_body={"guided_decoding_backend": "outlines"})[:2] == (400, "guided_decoding_backend")
    assert _error(oai, tools=tools)[:2] == (400, "tool_choice")  # "auto" (the default): no tool parser
    assert _error(oai, tools=tools, tool_choice={"type": "function", "function": {"name": "g"}})[:2] == \
        (400, "tool_choice")
    assert _error(oai, extra_body={"functions": [{"name": "f"}]})[:2] == (400, "functions")
    assert _error(oai, extra_body={"guided_regex": "a", "use_beam_search": True, "n": 2})[:2] == \
        (400, "structured_outputs")
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=oai.models.list().data[0].id, prompt="hi", max_tokens=4,
                               extra_body={"tools": tools, "tool_choice": "required"})
    assert (e.value.body or {}).get("param") == "tools"  # type: ignore[union-attr]
    ok = oai.completions.create(model=oai.models.list().data[0].id, prompt="hi", max_tokens=16,
                                extra_body={"guided_choice": CHOICES})
    assert ok.choices[0].text in CHOICES


def test_sampling_noise_stays_below_one() -> None:
    """u = 1 would give infinite Gumbel noise: that token wins even when the
    grammar masked it to -inf (seen with SmolLM2's 49152-token vocabulary)."""
    from pagedserve.gpuworker.sampler import uniform_noise

    keys = torch.tensor([61, 650, 1089, 1177], dtype=torch.int64)  # each hashes to the top value somewhere
    u = uniform_noise(keys, 49152)
    assert bool((u < 1.0).all()) and bool((u > 0.0).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 3}, {"type": "string"}])
def test_json_strings_refuse_control_characters_and_surrogates(model_dir: str, schema: dict[str, Any]) -> None:
    """xgrammar 0.2.9 lets both through; the worker's grammar must not."""
    import xgrammar as xgr

    sd = StructuredDecoding(model_dir, 509, (0,))
    compiled = sd.compile(StructuredSpec("json", json.dumps(schema)))

    def accepts(data: bytes) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return all(m.accept_string(bytes([b])) for b in data)

    assert accepts(b'"ab"') and accepts('"\u00e9"'.encode())
    assert not accepts(b'"\x10') and not accepts(b'"\n')
    assert not accepts('"'.encode() + b"\xed\xa0\x80")  # an encoded surrogate


def test_bench_structured_ci_size(model_dir: str) -> None:
    from pagedserve.bench.structured import report, run

    r = run(model_dir, 4, 1.0, ("regex", "choice"), max_tokens=64, num_gpu_blocks=200)
    assert set(r["kinds"]) == {"regex", "choice"}
    for k in r["kinds"].values():
        assert k["valid"] == k["total"] == 4 and not k["errors"]
        assert k["output_tokens"] == k["baseline_tokens"] > 0  # the baseline decodes the same lengths
        assert k["constrained_tok_s"] > 0 and k["baseline_tok_s"] > 0
    assert "regex" in report(r) and json.loads(json.dumps(r))["bench"] == "structured"
