"""Issue 41, "bodies that differ where clients look": on a real server, the response
bodies (completions, chat, /v1/models, /version, /tokenize, /detokenize) carry every
field vLLM 0.32's pydantic models dump, and the error bodies carry the ``type``,
``code`` (an integer: the status) and ``param`` that vLLM's own code gives for the same
case. Checked with vLLM's classes in the peer venv (a subprocess), skipped without
it; the rest (405's Allow, a NUL byte in a header, /tokenize's fields) needs no peer."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e_util import Server, serve
from models import make_tiny_model
from pagedserve.frontend.openai_api.http_extras import TOKENIZE_FIELDS

PEERS = Path(__file__).resolve().parents[1] / ".venv-peers"
NO_PEERS = not (PEERS / ".peers-stamp").exists()
PEER_REASON = "the peer venv with vLLM 0.32 is not installed (scripts/setup-peers.sh)"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    with serve("--model", model_dir, "--num-gpu-blocks", "64", "--max-model-len", "256") as s:
        yield s


def call(base: str, path: str, body: Any = None, method: str = "POST",
         headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def peer(code: str, payload: Any, tmp: Path) -> Any:
    """Runs ``code`` in the peer venv with ``payload`` as ``IN``; returns what it prints (JSON)."""
    src = tmp / "in.json"
    src.write_text(json.dumps(payload))
    prog = f"import json\nIN = json.load(open({str(src)!r}))\n{code}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run([str(PEERS / "bin" / "python"), "-c", prog], capture_output=True, text=True, timeout=600,
                         env=env, cwd=tmp)  # not the repository: its kernels/ would shadow a package
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# Each body through vLLM's own model: the fields its dump has that ours lacks, or has extra.
_FIELDS = r"""
from vllm.entrypoints.openai.completion.protocol import CompletionResponse
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse
from vllm.entrypoints.serve.engine.protocol import ModelList, ErrorResponse
from vllm.entrypoints.serve.tokenize.protocol import TokenizeResponse, DetokenizeResponse
CLS = {"completion": CompletionResponse, "chat": ChatCompletionResponse, "models": ModelList,
       "error": ErrorResponse, "tokenize": TokenizeResponse, "detokenize": DetokenizeResponse}

def diff(ours, theirs, path):
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = [f"{path}.{k}: missing" for k in theirs.keys() - ours.keys()]
        out += [f"{path}.{k}: extra" for k in ours.keys() - theirs.keys()]
        for k in ours.keys() & theirs.keys():
            out += diff(ours[k], theirs[k], f"{path}.{k}")
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        return [d for i, (a, b) in enumerate(zip(ours, theirs)) for d in diff(a, b, f"{path}[{i}]")]
    return []

out = {}
for name, body in IN.items():
    out[name] = diff(body, CLS[name.split(":")[0]].model_validate(body).model_dump(mode="json"), name)
# vLLM's /version is a plain dict: {"version": VLLM_VERSION} (serve/instrumentator/basic.py).
print(json.dumps(out))
"""

# What vLLM's create_error_response gives for the same cases.
_ERRORS = r"""
from http import HTTPStatus
from vllm.exceptions import VLLMValidationError, RetryableRequestError
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
def info(r):
    return {"type": r.error.type, "code": r.error.code, "param": r.error.param}
out = {
    # a bad sampling value (SamplingParams -> VLLMValidationError naming the field)
    "temperature": info(create_error_response(VLLMValidationError("x", parameter="temperature"))),
    # OpenAIServing._check_model
    "model": info(create_error_response("x", err_type="NotFoundError", status_code=HTTPStatus.NOT_FOUND,
                                        param="model")),
    # the engine cannot take a request now
    "unavailable": info(create_error_response(RetryableRequestError())),
    # FastAPI's router (serve/exception_handling/handlers/http.py): the status phrase
    "route404": {"type": HTTPStatus(404).phrase, "code": 404, "param": None},
    "route405": {"type": HTTPStatus(405).phrase, "code": 405, "param": None},
}
print(json.dumps(out))
"""


def test_bodies_have_every_field_vllm_dumps(srv: Server, tmp_path: Path) -> None:
    if NO_PEERS:
        pytest.skip(PEER_REASON)
    bodies: dict[str, Any] = {}
    for name, path, body in [
            ("completion", "/v1/completions", {"prompt": "Hello there", "max_tokens": 3, "n": 2, "temperature": 0.5,
                                               "logprobs": 2}),
            ("completion:echo", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "echo": True}),
            ("chat", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "logprobs": True,
                                              "top_logprobs": 2}),
            ("tokenize", "/tokenize", {"prompt": "Hello there", "return_token_strs": True}),
            ("tokenize:chat", "/tokenize", {"messages": MSGS}),
            ("detokenize", "/detokenize", {"tokens": [5, 6, 7]}),
            ("error:400", "/v1/completions", {"prompt": "x", "temperature": -1}),
            ("error:404", "/v1/completions", {"prompt": "x", "model": "no-such-model"})]:
        status, bodies[name], _ = call(srv.http, path, body)
        assert (status == 200) == (not name.startswith("error")), (name, status, bodies[name])
    for name, path in [("models", "/v1/models"), ("error:route404", "/no/such/route"),
                       ("error:route405", "/v1/completions")]:
        _, bodies[name], _ = call(srv.http, path, method="GET")
    found = peer(_FIELDS, bodies, tmp_path)
    assert found == {name: [] for name in bodies}, found
    status, version, _ = call(srv.http, "/version", method="GET")
    assert status == 200 and set(version) == {"version"}
    # The values vLLM sets where it has them: null, as vLLM sends them when unset.
    for name in ("completion", "chat"):
        assert bodies[name]["system_fingerprint"] is None and bodies[name]["service_tier"] is None
    assert all("prompt_token_ids" in c and c["prompt_token_ids"] is None for c in bodies["completion"]["choices"])
    msg = bodies["chat"]["choices"][0]["message"]
    assert msg["refusal"] is None and msg["reasoning"] is None and "tool_calls" not in msg
    card = bodies["models"]["data"][0]
    assert card["root"] and card["parent"] is None and card["permission"][0]["object"] == "model_permission"


def test_error_type_code_and_param_are_vllms(srv: Server, tmp_path: Path) -> None:
    if NO_PEERS:
        pytest.skip(PEER_REASON)
    expected = peer(_ERRORS, {}, tmp_path)
    got = {}
    for case, path, body, method in [("temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, "POST"),
                                     ("model", "/v1/chat/completions", {"messages": MSGS, "model": "nope"}, "POST"),
                                     ("route404", "/v2/nothing", None, "GET"),
                                     ("route405", "/v1/chat/completions", None, "GET")]:
        status, out, headers = call(srv.http, path, body, method)
        err = out["error"]
        assert isinstance(err["code"], int) and err["code"] == status, (case, out)
        got[case] = {k: err[k] for k in ("type", "code", "param")}
        if case == "route405":
            assert "POST" in headers.get("Allow", ""), headers  # a 405 names the methods
    # A 503 (the engine cannot take it now): the table's body for it.
    from pagedserve.frontend.core.error_table import RejectReason, rejected_api_error

    e = rejected_api_error(RejectReason.UNAVAILABLE, "the engine is unavailable")
    got["unavailable"] = {"type": e.type, "code": e.code, "param": e.param}
    assert e.response().headers["Retry-After"].isdigit()
    assert got == expected


_TOKENIZE_FIELDS = r"""
from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest
print(json.dumps({"tokenize": sorted(set(TokenizeCompletionRequest.model_fields) | set(TokenizeChatRequest.model_fields)),
                  "detokenize": sorted(DetokenizeRequest.model_fields)}))
"""


def test_tokenize_takes_every_field_vllm_declares(srv: Server, tmp_path: Path) -> None:
    if not NO_PEERS:
        declared = peer(_TOKENIZE_FIELDS, {}, tmp_path)
        assert set(declared["tokenize"]) == TOKENIZE_FIELDS
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                "parameters": {"type": "object",
                                                               "properties": {"city": {"type": "string"}}}}}]
    status, plain, _ = call(srv.http, "/tokenize", {"messages": MSGS})
    assert status == 200
    # Every field at once, each at a value that changes nothing: the same tokens.
    status, out, _ = call(srv.http, "/tokenize", {
        "messages": MSGS, "add_generation_prompt": True, "continue_final_message": False,
        "add_special_tokens": False, "return_token_strs": False, "chat_template": None,
        "chat_template_kwargs": {}, "mm_processor_kwargs": {}, "media_io_kwargs": {}, "tools": None, "model": None})
    assert status == 200 and out["tokens"] == plain["tokens"], out
    # Honoured: continue_final_message leaves the last message open (no generation prompt after it).
    prefill = [*MSGS, {"role": "assistant", "content": "The capital is"}]
    status, cont, _ = call(srv.http, "/tokenize", {"messages": prefill, "add_generation_prompt": False,
                                                   "continue_final_message": True, "return_token_strs": True})
    assert status == 200 and "".join(cont["token_strs"]).replace("\u0120", " ").rstrip().endswith("capital is")
    status, err, _ = call(srv.http, "/tokenize", {"messages": prefill, "add_generation_prompt": True,
                                                  "continue_final_message": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"
    # tools are rendered as the chat route renders them; add_special_tokens adds the BOS.
    status, with_tools, _ = call(srv.http, "/tokenize", {"messages": MSGS, "tools": tools})
    assert status == 200
    status, special, _ = call(srv.http, "/tokenize", {"messages": MSGS, "add_special_tokens": True})
    assert status == 200 and special["count"] >= plain["count"]
    status, err, _ = call(srv.http, "/tokenize", {"messages": MSGS, "mm_processor_kwargs": 5})
    assert status == 400 and err["error"]["param"] == "mm_processor_kwargs"


def test_a_nul_byte_in_a_header_is_a_400_and_one_warning_line(srv: Server) -> None:
    host, port = srv.http.removeprefix("http://").rsplit(":", 1)
    before = len(srv.log)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n")
        reply = s.recv(4096)
    assert reply.split(b"\r\n")[0].split(b" ")[1] == b"400", reply[:200]
    deadline = time.monotonic() + 5
    while not any("bad HTTP request" in line for line in srv.log[before:]) and time.monotonic() < deadline:
        time.sleep(0.05)
    new = srv.log[before:]
    assert sum("bad HTTP request" in line for line in new) == 1, new
    assert [line for line in new if "bad HTTP request" in line][0].find("WARNING") >= 0, new
    assert not any("Traceback" in line or "ERROR" in line for line in new), new
    status, _, _ = call(srv.http, "/v1/models", method="GET")  # still serving
    assert status == 200
