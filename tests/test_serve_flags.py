"""`pagedserve serve` takes vLLM 0.32's launch flags (issue 20, acceptance 2):
--help lists each; each parses to its config or OpenAI option; each flag we
cannot honour is one stderr line naming it, exit status 2, before anything
loads; and one real serve with many of them at once shows each effect over
HTTP (and gRPC / the log where the effect is the engine's)."""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e_util import Server, serve
from models import make_tiny_model
from pagedserve.common.config import EngineConfig, add_engine_args, config_from_args, engine_argv
from pagedserve.frontend.openai_api.openai_args import add_openai_args, build_options, generation_defaults, openai_argv
from pagedserve.launcher import _frontend_args
from pagedserve.serve_args import parse_serve_args

# The flags of issue 20 (vLLM 0.32 spellings), each listed by --help.
FLAGS = ["--kv-cache-dtype", "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--max-num-partial-prefills",
         "--disable-log-requests", "--enable-log-requests", "--disable-log-stats", "--uvicorn-log-level",
         "--chat-template", "--generation-config", "--override-generation-config", "--trust-remote-code",
         "--tokenizer", "--tokenizer-mode", "--revision", "--max-logprobs", "--response-role", "--ssl-keyfile",
         "--ssl-certfile", "--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials",
         "--root-path", "--hf-overrides", "--load-format", "--dtype", "--api-key", "--data-parallel-size",
         "--trust-request-chat-template", "--kv-events-config", "--prefix-caching-hash-algo",
         "--pipeline-parallel-size", "--quantization", "--enable-lora", "--enable-auto-tool-choice",
         "--tool-call-parser"]

KEYS = ("key-one-1111", "key-two-2222")
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")})


def test_help_lists_every_flag() -> None:
    r = _run("serve", "--help")
    assert r.returncode == 0, r.stderr
    for flag in FLAGS:
        assert flag in r.stdout, flag
    for value in ("half", "fp8_e5m2", "dummy", "hermes", "llama3_json", "pythonic", "trace"):
        assert value in r.stdout, value


def test_engine_flags_parse_and_reach_every_component() -> None:
    sa = parse_serve_args(["--dtype", "half", "--kv-cache-dtype", "auto", "--no-enable-chunked-prefill",
                           "--max-num-partial-prefills", "2", "--load-format", "dummy", "--hf-overrides",
                           '{"max_position_embeddings": 256}', "--trust-remote-code", "--tokenizer", "/tok",
                           "--tokenizer-mode", "slow"])
    c = sa.cfg
    assert (c.dtype, c.kv_cache_dtype, c.enable_chunked_prefill, c.max_num_partial_prefills) == ("float16", "auto",
                                                                                                  False, 2)
    assert (c.load_format, json.loads(c.hf_overrides or "{}"), c.trust_remote_code) == (
        "dummy", {"max_position_embeddings": 256}, True)
    assert (c.tokenizer, c.tokenizer_mode) == ("/tok", "slow")
    assert parse_serve_args(["--dtype", "float"]).cfg.dtype == "float32"
    assert parse_serve_args(["--dtype", "bfloat16"]).cfg.dtype == "bfloat16"
    assert parse_serve_args([]).cfg.enable_chunked_prefill is True
    # A child component rebuilds the same config from serve's flags.
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert config_from_args(p.parse_args(engine_argv(c))) == c
    assert config_from_args(p.parse_args(engine_argv(EngineConfig()))) == EngineConfig()


def test_openai_flags_parse_to_options_and_reach_the_frontend(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path, "llama", seed=0)
    gen = json.loads(Path(model, "generation_config.json").read_text())
    gen.update(max_new_tokens=5, top_k=3, temperature=0.7)
    Path(model, "generation_config.json").write_text(json.dumps(gen))
    argv = ["--response-role", "bot", "--max-logprobs", "3", "--chat-template", TEMPLATE,
            "--override-generation-config", '{"temperature": 0, "max_new_tokens": 4}', "--enable-log-requests",
            "--disable-log-stats", "--uvicorn-log-level", "warning", "--allowed-origins", '["https://a.example"]',
            "--allowed-methods", '["POST"]', "--allowed-headers", '["X-A"]', "--allow-credentials",
            "--root-path", "/llm", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--trust-request-chat-template", "--api-key", *KEYS]
    sa = parse_serve_args(argv)
    assert sa.api_keys == KEYS
    assert not any(k in " ".join(_frontend_args(sa)) for k in KEYS)  # keys travel in the environment
    opts = build_options(sa.openai, model, 500)
    assert opts.response_role == "bot" and opts.max_logprobs == 3 and opts.chat_template == TEMPLATE
    # vLLM's get_diff_sampling_param: the model's non-default fields, the override on top, max_new_tokens renamed.
    assert opts.default_sampling == {"temperature": 0, "top_k": 3, "max_tokens": 4}
    assert opts.override_max_tokens == 4  # vLLM's cap from --override-generation-config's max_new_tokens
    assert opts.log_requests is True and opts.root_path == "/llm" and opts.trust_request_chat_template is True
    assert build_options(parse_serve_args([]).openai, model, 500).trust_request_chat_template is False
    assert (opts.allowed_origins, opts.allowed_methods, opts.allowed_headers, opts.allow_credentials) == (
        ("https://a.example",), ("POST",), ("X-A",), True)
    assert (opts.enable_auto_tool_choice, opts.tool_call_parser) == (True, "hermes")
    # The frontend's own parser rebuilds the same options from what serve hands it.
    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_openai_args(p)
    assert build_options(p.parse_args(list(sa.frontend_flags)), model, 500) == opts
    # Defaults as vLLM's: role assistant, 20 logprobs, generation config auto, no CORS, logging requests off.
    d = build_options(parse_serve_args([]).openai, model, 500)
    assert (d.response_role, d.max_logprobs, d.allowed_origins, d.log_requests) == ("assistant", 20, (), False)
    assert d.default_sampling == {"temperature": 0.7, "top_k": 3, "max_tokens": 5}
    assert d.override_max_tokens is None
    assert build_options(parse_serve_args(["--generation-config", model]).openai, model,
                         500).override_max_tokens == 5  # a folder's max_new_tokens caps (vLLM)
    assert generation_defaults("vllm", model, None) == {}
    assert build_options(parse_serve_args(["--max-logprobs", "-1"]).openai, model, 500).max_logprobs == 500
    # A template file, and vLLM's escapes in an inline one.
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert build_options(parse_serve_args(["--chat-template", str(f)]).openai, model, 500).chat_template == TEMPLATE
    inline = build_options(parse_serve_args(["--chat-template", "{{ 'a' }}\\n"]).openai, model, 500)
    assert inline.chat_template == "{{ 'a' }}\n"
    # Older spellings and the variables.
    assert parse_serve_args(["--disable-log-requests"]).openai.enable_log_requests is False


REFUSALS = [
    (["--quantization", "awq"], "--quantization"),
    (["--enable-lora"], "--enable-lora"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
    (["--data-parallel-size", "2"], "--data-parallel-size"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice"),
    (["--chat-template", "no-such-template.jinja"], "--chat-template"),
    (["--generation-config", "/no/such/folder"], "--generation-config"),
    (["--max-num-partial-prefills", "0"], "--max-num-partial-prefills"),
    (["--api-key", "short"], "--api-key"),
    (["--ssl-certfile", "/x.pem"], "--ssl-certfile"),
    (["--root-path", "llm"], "--root-path"),
]


@pytest.mark.parametrize("argv,flag", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_refusal_is_one_line_naming_the_flag(argv: list[str], flag: str) -> None:
    r = _run("serve", *argv)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
    if flag == "--data-parallel-size":
        assert "docs/deployment.md" in lines[0] and "pagedserve ray-serve --num-replicas 2" in lines[0]
    if flag == "--api-key":
        assert "short" not in r.stderr  # a key is never echoed


def test_accepted_values_of_refusable_flags() -> None:
    sa = parse_serve_args(["--quantization", "None", "--pipeline-parallel-size", "1", "--data-parallel-size", "1",
                           "--kv-cache-dtype", "auto"])
    assert sa.cfg.kv_cache_dtype == "auto"


# ---- one real serve with many flags at once -------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = Path(tmp_path_factory.mktemp("models")) / "gen"
    shutil.copytree(make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=0), folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(max_new_tokens=5, top_k=3)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return str(folder)


@pytest.fixture(scope="module")
def srv(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tok = Path(tmp_path_factory.mktemp("tok")) / "tokenizer"
    shutil.copytree(model_dir, tok)
    with serve(model_dir, "--kv-cache-memory", "4MiB", "--served-model-name", "m",
               "--response-role", "bot", "--max-logprobs", "3", "--chat-template", TEMPLATE,
               "--override-generation-config", '{"max_new_tokens": 3, "temperature": 0}',
               "--root-path", "/llm", "--allowed-origins", '["https://a.example"]',
               "--api-key", *KEYS, "--dtype", "half", "--load-format", "dummy",
               "--hf-overrides", '{"max_position_embeddings": 256}',
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--tokenizer", str(tok),
               "--trust-remote-code", "--no-enable-chunked-prefill", "--max-num-partial-prefills", "1",
               "--kv-cache-dtype", "auto", "--disable-log-stats", "--enable-log-requests",
               "--uvicorn-log-level", "warning", "--quantization", "none", env={"PAGEDSERVE_API_KEY": ""}) as s:
        yield s


def call(srv: Server, path: str, body: dict[str, Any] | None = None, key: str | None = KEYS[0],
         method: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(srv.http + path, data=None if body is None else json.dumps(body).encode(),
                                 headers=h, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, _body(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, _body(e.read()), dict(e.headers)


def _body(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_api_keys_both_work_a_third_does_not_and_none_is_printed(srv: Server) -> None:
    for key in KEYS:
        assert call(srv, "/v1/models", key=key)[0] == 200, key
    assert call(srv, "/v1/models", key="key-three-3333")[0] == 401
    assert call(srv, "/v1/models", key=None)[0] == 401
    log = "".join(srv.log)
    assert not any(k in log for k in KEYS)
    with open(f"/proc/{srv.pids['frontend']}/cmdline", "rb") as f:
        assert not any(k.encode() in f.read() for k in KEYS)


def test_chat_template_is_the_tokenizers_for_every_api(srv: Server) -> None:
    status, chat, _ = call(srv, "/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, chat
    status, plain, _ = call(srv, "/tokenize", {"model": "m", "prompt": "<<hi>>", "add_special_tokens": False})
    assert status == 200, plain
    assert chat["tokens"] == plain["tokens"]


def test_hf_overrides_reach_the_worker(srv: Server) -> None:
    status, body, _ = call(srv, "/tokenize", {"model": "m", "prompt": "hi"})
    assert status == 200 and body["max_model_len"] == 256, body


def test_dtype_half_and_dummy_weights(srv: Server, model_dir: str) -> None:
    log = "".join(srv.log)
    assert "(LlamaForCausalLM, float16," in log, log[-2000:]
    # Dummy weights (uniform in +-1e-3): every token about as likely as any other.
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    status, body, _ = call(srv, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 1})
    assert status == 200, body
    for lp in body["choices"][0]["logprobs"]["token_logprobs"]:
        assert abs(lp + math.log(vocab)) < 0.05, (lp, vocab)


def test_no_stats_lines_with_disable_log_stats(srv: Server) -> None:
    assert not any("Running:" in line and "reqs" in line for line in srv.log)


# The effects below are the gateway's (http_gateway reads OpenAIOptions): vLLM's behaviour.
def test_response_role(srv: Server) -> None:
    status, body, _ = call(srv, "/v1/chat/completions", CHAT)
    assert status == 200, body
    assert body["choices"][0]["message"]["role"] == "bot"


def test_max_logprobs(srv: Server) -> None:
    ok = call(srv, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1, "logprobs": 3})
    assert ok[0] == 200, ok[1]
    status, body, _ = call(srv, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1, "logprobs": 4})
    assert status == 400, body
    status, body, _ = call(srv, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4})
    assert status == 400, body


def test_generation_config_defaults(srv: Server) -> None:
    # vLLM 0.32: max_new_tokens 5 in the model's generation_config.json, 3 by --override-generation-config,
    # which also caps what a request asks for (override_max_tokens); chat's absent max_tokens takes it.
    for body, want in (({"prompt": "hi"}, 3), ({"prompt": "hi", "max_tokens": 4}, 3),
                       ({"prompt": "hi", "max_tokens": 2}, 2)):
        status, out, _ = call(srv, "/v1/completions", {"model": "m", **body})
        assert status == 200, out
        c = out["usage"]["completion_tokens"]
        assert c == want or (c < want and out["choices"][0]["finish_reason"] == "stop"), (body, out)
    status, out, _ = call(srv, "/v1/chat/completions", {"model": "m", "messages": CHAT["messages"]})
    assert status == 200, out
    c = out["usage"]["completion_tokens"]
    assert c == 3 or (c < 3 and out["choices"][0]["finish_reason"] == "stop"), out


def test_root_path(srv: Server) -> None:
    assert call(srv, "/llm/v1/models")[0] == 200
    assert call(srv, "/v1/models")[0] == 200


def test_cors_preflight(srv: Server) -> None:
    status, _, headers = call(srv, "/v1/chat/completions", method="OPTIONS", key=None, headers={
        "Origin": "https://a.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert status == 200, headers
    assert headers.get("Access-Control-Allow-Origin") == "https://a.example", headers
    status, _, headers = call(srv, "/v1/chat/completions", method="OPTIONS", key=None, headers={
        "Origin": "https://b.example", "Access-Control-Request-Method": "POST"})
    assert "Access-Control-Allow-Origin" not in headers, headers


def test_auto_tool_choice(srv: Server) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    status, body, _ = call(srv, "/v1/chat/completions", {**CHAT, "tools": tools, "tool_choice": "auto"})
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls"), body


def _prefill_chunks(enable_chunked_prefill: bool) -> list[dict[int, int]]:
    """Tokens each step computes per sequence, for prompts of 100 and 30 tokens under a 64-token budget."""
    from test_scheduler import add, make_engine

    core, worker, _ = make_engine(64, budget=64)
    if not enable_chunked_prefill:  # the same engine, the flag off (EngineConfig is frozen)
        import dataclasses

        from pagedserve.scheduler.engine import EngineCore

        core = EngineCore(dataclasses.replace(core.cfg, enable_chunked_prefill=False), core.blockmgr, worker)
    add(core, "a", list(range(1, 101)), 2)
    add(core, "b", list(range(200, 230)), 2)
    for _ in range(3):
        core.step()
    return [{s.seq_id: s.num_tokens for s in step.scheduled} for step in worker.steps]


def test_chunked_prefill_on_and_off() -> None:
    on = _prefill_chunks(True)
    assert sorted(on[0].values()) == [64]  # a's first 64 tokens; b waits behind it
    assert sorted(on[1].values()) == [28, 36]  # a's last 36, and b split into what is left
    off = _prefill_chunks(False)  # the budget grows to the model's length: each prompt whole
    assert sorted(off[0].values()) == [30, 100]
    assert all(n == 1 for step in off[1:] for n in step.values())  # decodes only: nothing was split
