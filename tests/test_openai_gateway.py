"""The OpenAI-compatible HTTP gateway, driven by the official `openai` Python
client against the real four processes: completions and chat (streaming and
not) equal the gRPC output for the same (templated) prompt; errors in the
OpenAI shape; /v1/models, /health, /metrics."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from e2e_util import Server, free_port, serve
from models import make_tiny_model
from pagedserve.frontend.core.chat_template import render_chat

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


@pytest.fixture(scope="module")
def gw(model_dir: str) -> Iterator[tuple[Server, str]]:
    port = free_port()
    with serve("--model", model_dir, "--num-gpu-blocks", "64", env={"PAGEDSERVE_HTTP_PORT": str(port)}) as s:
        yield s, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(gw: tuple[Server, str]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=gw[1] + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_models_health_and_metrics(gw: tuple[Server, str], model_name: str, model_dir: str) -> None:
    # Served under the model as given (as vLLM); 'model' may also be the engine's own name.
    assert model_name == model_dir
    with gw[0].client() as c:
        engine_name = c.model_info().model_name
    assert openai.OpenAI(base_url=gw[1] + "/v1", api_key="unused").completions.create(
        model=engine_name, prompt=PROMPT, max_tokens=2).model == model_dir
    with urllib.request.urlopen(gw[1] + "/health") as r:
        assert r.status == 200 and json.load(r)["status"] == "ok"
    with urllib.request.urlopen(gw[1] + "/metrics") as r:
        assert b"pagedserve:generation_tokens_total" in r.read()


def test_completions_equal_grpc_streaming_and_not(gw: tuple[Server, str], client: openai.OpenAI,
                                                  model_name: str) -> None:
    with gw[0].client() as c:
        ids, text, reason = c.generate(PROMPT, max_tokens=12, temperature=0.0)
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == model_name
    assert r.choices[0].text == text and r.choices[0].finish_reason == reason
    assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == len(c_tokens(gw, PROMPT))
    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    # That it streams: a longer output, since a client that reads late gets what is
    # pending merged into one chunk (a loaded machine merged all 12 tokens once).
    long = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=200, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}))
    assert sum(1 for ch in long if ch.choices) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)
    # Token-id prompts, stop strings and logprobs take the same path.
    r2 = client.completions.create(model=model_name, prompt=ids[:3], max_tokens=5, temperature=0, logprobs=2)
    assert len(r2.choices[0].logprobs.token_logprobs) == 5 and len(r2.choices[0].logprobs.top_logprobs[0]) == 2
    stop = text[4:8]
    r3 = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r3.choices[0].text == text[:text.index(stop)] and r3.choices[0].finish_reason == "stop"


def c_tokens(gw: tuple[Server, str], text: str) -> list[int]:
    with gw[0].client() as c:
        return c.tokenize(text)


def test_chat_equals_grpc_on_the_templated_prompt(gw: tuple[Server, str], client: openai.OpenAI, model_name: str,
                                                  model_dir: str) -> None:
    from transformers import AutoTokenizer

    templated = render_chat(AutoTokenizer.from_pretrained(model_dir), MESSAGES)
    assert templated.endswith("<|im_start|>assistant\n")
    with gw[0].client() as c:
        ids, text, reason = c.generate(templated, max_tokens=10, temperature=0.0)
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
    assert r.choices[0].finish_reason == reason and r.usage.completion_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
    assert chunks[-1].choices[0].finish_reason == reason
    lp = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    assert "".join(e.token for e in content) == text[:len("".join(e.token for e in content))]
    n2 = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=4, temperature=1.0,
                                        seed=3, n=2)
    assert [ch.index for ch in n2.choices] == [0, 1]


def _raw(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_errors_have_the_openai_shape(gw: tuple[Server, str], client: openai.OpenAI, model_name: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, temperature=-1)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "temperature" and "[0.0, 2.0]" in err["message"]
    assert err["type"] == "BadRequestError" and err["code"] == 400  # vLLM 0.32's ErrorInfo
    with pytest.raises(openai.BadRequestError) as e2:
        client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=100000)
    assert e2.value.body["param"] == "max_tokens" and "max_model_len=512" in e2.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e3:
        client.completions.create(model=model_name, prompt=PROMPT, logprobs=21)
    assert e3.value.body["param"] == "logprobs"
    with pytest.raises(openai.NotFoundError) as e4:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert e4.value.body["code"] == 404 and e4.value.body["type"] == "NotFoundError"
    assert e4.value.body["param"] == "model" and "`no-such-model` does not exist" in e4.value.body["message"]
    for body, param in [(b"{not json", "body"), (b"[1]", "body"), (b'{"prompt": 5}', "prompt"),
                        (b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
                        (b'{"prompt": "hi", "stop": 5}', "stop"),
                        (b'{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias")]:
        status, out = _raw(gw[1] + "/v1/completions", body)
        assert status == 400 and out["error"]["param"] == param, (body, out)
        assert set(out["error"]) == {"message", "type", "param", "code"}
    status, out = _raw(gw[1] + "/v1/chat/completions", b'{"messages": []}')
    assert status == 400 and out["error"]["param"] == "messages"
    # Still serving.
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_http_client_disconnect_frees_everything(gw: tuple[Server, str], model_name: str) -> None:
    import http.client
    import time

    host, port = gw[1].removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": model_name, "prompt": PROMPT, "max_tokens": 480, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    assert resp.readline().startswith(b"data: ")  # streaming has begun
    with gw[0].client() as c:
        assert c.server_info().num_running == 1
        conn.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = c.server_info()
            if info.num_running == 0 and info.num_free_gpu_blocks == info.num_gpu_blocks \
                    and info.num_requests_in_flight == 0:
                break
            time.sleep(0.05)
    assert info.num_running == 0 and info.num_free_gpu_blocks == info.num_gpu_blocks, info
    assert info.num_requests_in_flight == 0
