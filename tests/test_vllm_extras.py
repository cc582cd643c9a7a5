"""vLLM 0.32's request extras on /v1/completions and /v1/chat/completions, over
the real four processes, checked against the tokenizer's own answers; fields
outside vLLM's models ignored as vLLM does; vLLM's refusals as 400s; and the
OpenAI server options (response role, max_logprobs, generation-config
defaults, request logging, CORS, root path) from `serve`'s flags."""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e_util import Server, serve
from models import make_tiny_model
from pagedserve.frontend.openai_api.openai_extras import OURS, VLLM_CHAT_FIELDS, VLLM_COMPLETION_FIELDS

PROMPT = "The quick brown fox jumps over the lazy dog and the cat"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]
PEERS = Path(__file__).resolve().parents[1] / ".venv-peers"
KEY = "sk-extras-test-key-0123456789"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def srv(model_dir: str) -> Iterator[Server]:
    with serve("--model", model_dir, "--num-gpu-blocks", "64") as s:
        yield s


def post(base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         method: str = "POST") -> tuple[int, Any, Any]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode() if method == "POST" else None,
                                 method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read().decode()
            return r.status, json.loads(raw) if "json" in r.headers.get("Content-Type", "") else raw, r.headers
    except urllib.error.HTTPError as e:
        raw = e.read().decode()
        try:
            return e.code, json.loads(raw), e.headers
        except ValueError:
            return e.code, raw, e.headers


def events(raw: str) -> list[dict[str, Any]]:
    out = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def cmpl(srv: Server, **body: Any) -> dict[str, Any]:
    code, r, _ = post(srv.http, "/v1/completions", {"prompt": PROMPT, "temperature": 0, **body})
    assert code == 200, r
    return r  # type: ignore[no-any-return]


def chat(srv: Server, **body: Any) -> dict[str, Any]:
    code, r, _ = post(srv.http, "/v1/chat/completions", {"messages": MSGS, "temperature": 0, **body})
    assert code == 200, r
    return r  # type: ignore[no-any-return]


def test_skip_special_tokens_and_return_token_ids(srv: Server, tok: Any) -> None:
    special = tok.convert_tokens_to_ids("<|im_start|>")
    bias = {"logit_bias": {str(special): 100}, "max_tokens": 3, "return_token_ids": True}
    kept = cmpl(srv, skip_special_tokens=False, **bias)["choices"][0]
    assert kept["token_ids"] == [special] * 3
    assert kept["text"] == tok.decode(kept["token_ids"], skip_special_tokens=False) == "<|im_start|>" * 3
    assert kept["prompt_token_ids"] == tok(PROMPT).input_ids
    assert cmpl(srv, **bias)["choices"][0]["text"] == ""  # vLLM's default skips them
    streamed = events(post(srv.http, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "stream": True,
                                                         "skip_special_tokens": False, **bias})[1])
    assert "".join(e["choices"][0]["text"] for e in streamed) == kept["text"]
    assert sum((e["choices"][0]["token_ids"] for e in streamed), []) == kept["token_ids"]
    assert streamed[0]["choices"][0]["prompt_token_ids"] == kept["prompt_token_ids"]
    c = chat(srv, spaces_between_special_tokens=False, skip_special_tokens=False, **bias)
    assert c["choices"][0]["message"]["content"] == "<|im_start|>" * 3
    assert c["prompt_token_ids"] == tok(tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True),
                                        add_special_tokens=False).input_ids


def test_continue_final_message_renders_as_the_tokenizer_and_echoes(srv: Server, tok: Any) -> None:
    msgs = [*MSGS, {"role": "assistant", "content": "The capital is"}]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    r = chat(srv, messages=msgs, add_generation_prompt=False, continue_final_message=True, return_prompt_text=True,
             return_token_ids=True, echo=True, max_tokens=4)
    assert r["prompt_text"] == want and not want.endswith("<|im_end|>\n")
    assert r["prompt_token_ids"] == tok(want, add_special_tokens=False).input_ids
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"].startswith("The capital is")
    # vLLM 0.32's detokenizer drops a character still incomplete at the length cut (no U+FFFD at the end).
    text = tok.decode(r["choices"][0]["token_ids"], skip_special_tokens=True).rstrip("\ufffd")
    assert msg["content"] == "The capital is" + text
    code, e, _ = post(srv.http, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True,
                                                         "add_generation_prompt": True})
    assert code == 400 and "continue_final_message" in e["error"]["message"]
    # chat_template_kwargs reach the template; a request's own template needs the server's trust (vLLM).
    docs = chat(srv, chat_template_kwargs={"add_generation_prompt": False}, return_prompt_text=True, max_tokens=1)
    assert docs["prompt_text"] == tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=False)
    code, e, _ = post(srv.http, "/v1/chat/completions", {"messages": MSGS, "chat_template": "{{ 'x' }}"})
    assert code == 400 and "--trust-request-chat-template" in e["error"]["message"]


def test_truncate_prompt_tokens_keeps_the_last_k_ids(srv: Server, tok: Any) -> None:
    ids = tok(PROMPT).input_ids
    r = cmpl(srv, truncate_prompt_tokens=5, return_token_ids=True, max_tokens=6)
    assert r["choices"][0]["prompt_token_ids"] == ids[-5:] and r["usage"]["prompt_tokens"] == 5
    assert r["choices"][0]["text"] == cmpl(srv, prompt=ids[-5:], max_tokens=6)["choices"][0]["text"]
    right = cmpl(srv, truncate_prompt_tokens=5, truncation_side="right", return_token_ids=True, max_tokens=1)
    assert right["choices"][0]["prompt_token_ids"] == ids[:5]
    c = chat(srv, truncate_prompt_tokens=4, return_token_ids=True, max_tokens=1)
    templated = tok(tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False).input_ids
    assert c["prompt_token_ids"] == templated[-4:]
    code, e, _ = post(srv.http, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 10**6})
    assert code == 400 and e["error"]["param"] == "truncate_prompt_tokens"


def test_return_tokens_as_token_ids_and_prompt_logprobs(srv: Server, tok: Any) -> None:
    r = cmpl(srv, logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True, max_tokens=4)["choices"][0]
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
    assert all(k.startswith("token_id:") for top in r["logprobs"]["top_logprobs"] for k in top)
    c = chat(srv, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True, return_token_ids=True,
             max_tokens=3)["choices"][0]
    assert [e["token"] for e in c["logprobs"]["content"]] == [f"token_id:{t}" for t in c["token_ids"]]
    ids = tok(PROMPT).input_ids
    p = cmpl(srv, prompt_logprobs=1, max_tokens=1)["choices"][0]["prompt_logprobs"]
    assert len(p) == len(ids) and p[0] is None
    assert all(str(t) in entry and entry[str(t)]["logprob"] <= 0 for t, entry in zip(ids[1:], p[1:]))
    # Offsets run over the token strings, as vLLM's.
    lp = cmpl(srv, logprobs=0, max_tokens=4)["choices"][0]["logprobs"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]


def test_continuous_usage_stats_in_every_chunk(srv: Server, tok: Any) -> None:
    n_prompt = len(tok(PROMPT).input_ids)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    evs = events(post(srv.http, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 8,
                                                    "stream": True, "stream_options": opts,
                                                    "return_token_ids": True, "ignore_eos": True})[1])
    seen = 0
    for e in evs[:-1]:
        seen += len(e["choices"][0]["token_ids"])
        assert e["usage"] == {"prompt_tokens": n_prompt, "total_tokens": n_prompt + seen, "completion_tokens": seen}
    assert evs[-1]["choices"] == [] and evs[-1]["usage"]["completion_tokens"] == 8 == seen
    # vLLM: continuous usage only with include_usage; none without it.
    plain = events(post(srv.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": True,
                                                      "stream_options": {"continuous_usage_stats": True}})[1])
    assert all("usage" not in e for e in plain)
    templated = len(tok(tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False).input_ids)
    chat_evs = events(post(srv.http, "/v1/chat/completions", {"messages": MSGS, "temperature": 0, "max_tokens": 5,
                                                             "stream": True, "stream_options": opts,
                                                             "ignore_eos": True, "return_token_ids": True})[1])
    first = chat_evs[0]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # vLLM's chat chunks carry completion_tokens_details, null (its completion chunks leave it out).
    assert first["usage"] == {"prompt_tokens": templated, "total_tokens": templated, "completion_tokens": 0,
                              "completion_tokens_details": None}
    seen = 0
    for e in chat_evs[1:-1]:
        seen += len(e["choices"][0]["token_ids"])
        assert e["usage"]["completion_tokens"] == seen and e["usage"]["prompt_tokens"] == templated
    assert chat_evs[-1]["usage"]["completion_tokens"] == 5 == seen


def test_fields_outside_vllms_models_are_ignored_and_vllms_own_accepted(srv: Server) -> None:
    plain = cmpl(srv, max_tokens=5)["choices"][0]["text"]
    extras = {"store": True, "metadata": {"a": "b"}, "service_tier": "flex", "logits_processors": ["x"],
              "made_up_field": {"deep": [1, 2]}, "best_of": 3, "priority": 5, "user": "u1",
              "kv_transfer_params": {"do_remote_prefill": False}, "vllm_xargs": {"k": 1}, "session_id": "s",
              "watermarking": False, "stream_interval": 2, "thinking_token_budget": -1, "cache_salt": "salt-1",
              "add_special_tokens": True, "min_tokens": 1, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    assert cmpl(srv, max_tokens=5, **extras)["choices"][0]["text"] == plain
    chat_extras = {**extras, "reasoning_effort": "low", "parallel_tool_calls": True, "include_reasoning": True,
                   "documents": [{"title": "t", "text": "x"}], "mm_processor_kwargs": {}, "seed": -1}
    chat(srv, max_tokens=2, **chat_extras)
    r = cmpl(srv, max_tokens=1, request_id="my-req-1")
    assert r["id"] == "cmpl-my-req-1"
    code, c, _ = post(srv.http, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1},
                      headers={"X-Request-Id": "hdr-7"})
    assert code == 200 and c["id"] == "chatcmpl-hdr-7"


INVALID = [  # (route, body, param): vLLM 0.32 answers each with 400
    ("c", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("c", {"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("c", {"n": 2, "temperature": 0}, "n"),
    ("c", {"logprobs": 21}, "logprobs"),
    ("c", {"logprobs": -2}, "logprobs"),
    ("c", {"prompt_logprobs": -3}, "prompt_logprobs"),
    ("c", {"truncation_side": "middle"}, "truncation_side"),
    ("c", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("c", {"cache_salt": ""}, "cache_salt"),
    ("c", {"cache_salt": "a/b"}, "cache_salt"),
    ("c", {"temperature": 2.5}, "temperature"),
    ("c", {"top_k": -2}, "top_k"),
    ("c", {"suffix": "x"}, "suffix"),
    ("c", {"priority": "high"}, "priority"),
    ("c", {"skip_special_tokens": "maybe"}, "skip_special_tokens"),  # "no" is false to pydantic's lax mode
    ("c", {"max_tokens": "2.5"}, "max_tokens"),
    ("c", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("c", {"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ("c", {"bad_words": [""]}, "bad_words"),
    ("c", {"max_tokens": 10**5}, "max_tokens"),
    ("h", {"top_logprobs": 2}, "top_logprobs"),
    ("h", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("h", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("h", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("h", {"kv_transfer_params": "x"}, "kv_transfer_params"),
]


def test_what_vllm_refuses_is_a_400_naming_the_field(srv: Server) -> None:
    for route, body, param in INVALID:
        path, base = (("/v1/completions", {"prompt": PROMPT}) if route == "c"
                      else ("/v1/chat/completions", {"messages": MSGS}))
        code, e, _ = post(srv.http, path, {**base, "max_tokens": 2, **body})
        assert code == 400 and e["error"]["param"] == param, (body, e)


@pytest.mark.skipif(not (PEERS / ".peers-stamp").exists(), reason="the peer venv with vLLM 0.32 is not installed "
                                                                  "(scripts/setup-peers.sh)")
def test_every_field_of_vllms_request_models_is_accepted(srv: Server, tmp_path: Path) -> None:
    code = ("import json\nfrom vllm.entrypoints.openai.completion.protocol import CompletionRequest as C\n"
            "from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as H\n"
            "def d(m):\n  out = {}\n  for k, f in m.model_fields.items():\n"
            "    try: json.dumps(f.default); out[k] = f.default\n    except TypeError: out[k] = None\n"
            "  return out\nprint(json.dumps({'c': d(C), 'h': d(H)}))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run([str(PEERS / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)  # not the repository: its kernels/ would shadow a package
    assert out.returncode == 0, out.stderr[-2000:]
    fields = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(fields["c"]) == VLLM_COMPLETION_FIELDS and set(fields["h"]) == VLLM_CHAT_FIELDS
    assert not OURS & (VLLM_COMPLETION_FIELDS | VLLM_CHAT_FIELDS)
    # Every field at vLLM's own default is accepted (a default stands for "absent").
    skip = {"prompt", "messages", "model", "request_id", "stream", "echo", "tool_choice"}
    for route, path, base in (("c", "/v1/completions", {"prompt": PROMPT}),
                              ("h", "/v1/chat/completions", {"messages": MSGS})):
        body = {k: v for k, v in fields[route].items() if k not in skip}
        body["max_tokens"] = 2
        code, r, _ = post(srv.http, path, {**base, **body})
        assert code == 200, r


# ------------------------------------------------------------------ server options
@pytest.fixture(scope="module")
def opt_srv(model_dir: str) -> Iterator[Server]:
    with serve("--model", model_dir, "--num-gpu-blocks", "64", "--max-model-len", "128", "--response-role", "bot",
               "--max-logprobs", "3", "--enable-log-requests", "--allowed-origins", '["https://a.example"]',
               "--root-path", "/llm", "--api-key", KEY,
               "--override-generation-config", '{"temperature": 0.0, "max_new_tokens": 4}') as s:
        yield s


AUTH = {"Authorization": f"Bearer {KEY}"}


def test_response_role_max_logprobs_and_generation_defaults(opt_srv: Server) -> None:
    c = openai.OpenAI(base_url=opt_srv.http + "/v1", api_key=KEY, max_retries=0, timeout=60)
    eos = {"ignore_eos": True}
    r = c.chat.completions.create(model=c.models.list().data[0].id, messages=MSGS, extra_body=eos)  # type: ignore[arg-type]
    assert r.choices[0].message.role == "bot"
    assert r.usage is not None and r.usage.completion_tokens == 4  # the default max_tokens
    greedy = c.chat.completions.create(model=r.model, messages=MSGS, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                       extra_body=eos)
    assert greedy.choices[0].message.content == r.choices[0].message.content  # the default temperature 0
    chunks = list(c.chat.completions.create(model=r.model, messages=MSGS, stream=True))  # type: ignore[arg-type]
    assert chunks[0].choices[0].delta.role == "bot"
    with pytest.raises(openai.BadRequestError) as e:  # greedy by default: n > 1 is refused, as vLLM
        c.chat.completions.create(model=r.model, messages=MSGS, n=2)  # type: ignore[arg-type]
    assert e.value.body["param"] == "n"  # type: ignore[index]
    assert len(c.chat.completions.create(model=r.model, messages=MSGS, n=2, temperature=1.0,  # type: ignore[arg-type]
                                         seed=1).choices) == 2
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=r.model, prompt=PROMPT, logprobs=4)
    assert c.completions.create(model=r.model, prompt=PROMPT, logprobs=3, max_tokens=2).choices[0].logprobs
    # vLLM's override_max_tokens: --override-generation-config's max_new_tokens caps every request
    # (serving_chat/serving_completion: generation_config "auto" reads it from the override).
    long = c.completions.create(model=r.model, prompt=PROMPT, max_tokens=128, extra_body={"ignore_eos": True})
    assert long.usage is not None and long.usage.completion_tokens == 4
    r2 = c.completions.create(model=r.model, prompt=PROMPT, max_tokens=1, extra_body={"request_id": "logged-1"})
    assert r2.id == "cmpl-logged-1"
    c.close()
    lines = [line for line in opt_srv.log if "Received request cmpl-logged-1" in line]
    assert len(lines) == 1 and "max_tokens: 1" in lines[0]
    assert not any(KEY in line for line in opt_srv.log)


def test_cors_and_root_path(opt_srv: Server) -> None:
    pre = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    code, body, h = post(opt_srv.http, "/v1/chat/completions", {}, headers=pre, method="OPTIONS")
    assert code == 200 and body == "OK" and h["Access-Control-Allow-Origin"] == "https://a.example"
    assert h["Access-Control-Allow-Headers"] == "authorization, content-type" and h["Access-Control-Max-Age"] == "600"
    code, body, h = post(opt_srv.http, "/v1/chat/completions", {}, method="OPTIONS",
                         headers={**pre, "Origin": "https://evil.example"})
    assert code == 400 and body == "Disallowed CORS origin" and "Access-Control-Allow-Origin" not in h
    code, models, h = post(opt_srv.http, "/v1/models", {}, method="GET", headers={**AUTH, "Origin": "https://a.example"})
    assert code == 200 and h["Access-Control-Allow-Origin"] == "https://a.example" and "Origin" in h["Vary"]
    code, _, h = post(opt_srv.http, "/v1/models", {}, method="GET", headers={**AUTH, "Origin": "https://evil.example"})
    assert code == 200 and "Access-Control-Allow-Origin" not in h
    code, raw, h = post(opt_srv.http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True},
                        headers={**AUTH, "Origin": "https://a.example"})
    assert code == 200 and h["Access-Control-Allow-Origin"] == "https://a.example" and events(raw)
    # root_path: served with and without the prefix; auth still guards the prefixed routes.
    code, prefixed, _ = post(opt_srv.http, "/llm/v1/models", {}, method="GET", headers=AUTH)
    # (each ModelCard's permission id and created time are fresh per call, as vLLM's)
    assert code == 200 and [m["id"] for m in prefixed["data"]] == [m["id"] for m in models["data"]]
    assert post(opt_srv.http, "/llm/v1/models", {}, method="GET")[0] == 401
    assert post(opt_srv.http, "/llm/health", {}, method="GET")[0] == 200
    code, r, _ = post(opt_srv.http, "/llm/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers=AUTH)
    assert code == 200 and r["usage"]["completion_tokens"] == 2
