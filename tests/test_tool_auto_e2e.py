"""tool_choice "auto" end to end: `serve --enable-auto-tool-choice
--tool-call-parser hermes` on a tiny random model whose output is pinned by a
regex (structured outputs), so the model writes a known hermes tool call; the
answer's tool_calls, content and finish_reason, streaming and not, through the
official openai client. Without the flags, "auto" is vLLM's 400."""
from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from e2e_util import Server, free_port, serve
from models import make_tiny_model
from pagedserve.frontend.openai_api import openai_tools
from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.openai_api.openai_options import OpenAIOptions

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def pinned(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": re.escape(text).replace("\\ ", " ").replace("\\\n", "\\n")}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    port = free_port()
    with serve("--model", model, "--num-gpu-blocks", "64", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               env={"PAGEDSERVE_HTTP_PORT": str(port)}):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        yield c
        c.close()


def _ask(client: openai.OpenAI, text: str, **kw: Any) -> Any:
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS,
                                          temperature=0, max_tokens=300, extra_body=pinned(text), **kw)


def test_auto_returns_the_parsed_call(client: openai.OpenAI) -> None:
    for kw in ({"tool_choice": "auto"}, {}):  # no tool_choice with tools: auto, as vLLM
        r = _ask(client, CALL_TEXT, **kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert ch.message.content == "Checking. "
        [tc] = ch.message.tool_calls
        assert tc.type == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", tc.id)
        assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}
        assert tc.function.arguments == '{"city": "Paris"}'  # vLLM's json.dumps form


def test_auto_streams_the_call_as_vllm_deltas(client: openai.OpenAI) -> None:
    chunks = list(_ask(client, CALL_TEXT, tool_choice="auto", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert content == "Checking. "
    named = [tc for tc in calls if tc.function and tc.function.name]
    assert len(named) == 1 and named[0].index == 0 and named[0].function.name == "get_weather"
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", named[0].id) and named[0].type == "function"
    args = "".join(tc.function.arguments or "" for tc in calls if tc.function)
    assert json.loads(args) == {"city": "Paris"} and args == '{"city": "Paris"}'  # the text as written
    assert all(tc.index == 0 for tc in calls)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]
    # the name comes before any argument text, and no chunk repeats it
    assert calls.index(named[0]) == min(i for i, tc in enumerate(calls) if tc.function)


def test_auto_plain_text_stays_content(client: openai.OpenAI) -> None:
    r = _ask(client, "It is sunny in Paris.")
    assert r.choices[0].message.content == "It is sunny in Paris."
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "stop"
    chunks = list(_ask(client, "It is sunny in Paris.", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is sunny in Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_auto_without_the_flags_is_vllms_400() -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "auto"}
    for opts in (None, OpenAIOptions(), OpenAIOptions(tool_call_parser="hermes"),
                 OpenAIOptions(enable_auto_tool_choice=True)):
        for b in (body, {k: v for k, v in body.items() if k != "tool_choice"}):
            with pytest.raises(ApiError) as e:
                openai_tools.take_tools(b, opts)
            assert e.value.status == 400 and e.value.param == "tool_choice"
            assert str(e.value) == ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                    'to be set')
    mode, tools, rest = openai_tools.take_tools(body, OpenAIOptions(enable_auto_tool_choice=True,
                                                                    tool_call_parser="hermes"))
    assert mode is not None and mode.parser == "hermes" and mode.schema is None and tools == TOOLS
    assert "tools" not in rest and "tool_choice" not in rest


STRICT = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "strict": True,
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"enum": ["Paris"]}}}}},
          {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_named_and_required_follow_vllms_hermes_grammar(client: openai.OpenAI) -> None:
    # vLLM 0.32 with hermes: the output is <tool_call> blocks (tool_grammar), read by the parser;
    # named finishes with the engine's "stop", required with "tool_calls"; content "" for both.
    model = client.models.list().data[0].id
    for choice, finish in (({"type": "function", "function": {"name": "get_weather"}}, "stop"), ("required", "tool_calls")):
        r = client.chat.completions.create(model=model, messages=MESSAGES, tools=STRICT, tool_choice=choice,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=200, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == finish and ch.message.content == "", ch
        [tc] = ch.message.tool_calls  # type: ignore[misc]
        if choice != "required" or tc.function.name == "get_weather":
            assert tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {"city": "Paris"}


def test_hermes_keeps_special_tokens_as_vllm(client: openai.OpenAI) -> None:
    # vLLM's hermes adjust_request: skip_special_tokens off for a request with tools.
    base = str(client.base_url).removesuffix("/v1/")
    req = urllib.request.Request(base + "/tokenize", data=json.dumps({"prompt": "<|im_end|>",
                                 "add_special_tokens": False}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        [eos] = json.load(resp)["tokens"]
    body = {"logit_bias": {str(eos): 100}, "ignore_eos": True}
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0,  # type: ignore[arg-type]
                                           extra_body=body)
    tools = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0, tools=TOOLS,  # type: ignore[arg-type]
                                           extra_body=body)
    assert plain.choices[0].message.content == "" and tools.choices[0].message.content == "<|im_end|>" * 2
