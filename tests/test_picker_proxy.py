"""The picker's HTTP front (pagedserve/kvpicker_proxy.py) in front of two real engines (`pagedserve
serve`, a tiny model, KV events on): a chat request's prompt hashes, computed by the picker through
the chat template, are the blocks the engine that answered then publishes; the next turn goes to
that engine by prefix; a prompt nobody holds goes to the least loaded; the engine's answers come
back byte for byte (its /tokenize body and headers, its 401 with a wrong key, its error object),
and a stream event by event."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web
from e2e_util import free_port, serve
from models import make_tiny_model
from transformers import AutoTokenizer

from pagedserve.kvpicker import EventReader, Picker, Pod, block_hashes
from pagedserve.kvpicker_proxy import PromptHasher, make_app

BS = 8
KEY = "picker-test-key"
SEED = "42"


def _post(url: str, body: Any, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _run_app(app: web.Application, port: int) -> Iterator[None]:
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert started.wait(30)
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


@dataclass
class Setup:
    url: str  # the picker's
    servers: list[Any]
    picker: Picker
    hasher: PromptHasher

    def hashes(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.hasher.token_ids("/v1/chat/completions", {"messages": messages})
        return block_hashes(ids or [], BS, SEED)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("picker")
    model = make_tiny_model(tmp / "m", "llama", seed=0)
    ev = [(f"ipc://{tmp}/kv{i}.pub", f"ipc://{tmp}/kv{i}.replay") for i in range(2)]
    env = {"PYTHONHASHSEED": SEED, "PAGEDSERVE_API_KEY": KEY}
    args = ["--model", model, "--block-size", str(BS), "--num-gpu-blocks", "64", "--max-num-seqs", "4"]
    cfgs = [json.dumps({"enable_kv_cache_events": True, "endpoint": p, "replay_endpoint": r, "topic": f"kv@pod{i}"})
            for i, (p, r) in enumerate(ev)]
    with serve(*args, "--kv-events-config", cfgs[0], env=env) as s0, \
            serve(*args, "--kv-events-config", cfgs[1], env=env) as s1:
        pods = [Pod(f"pod{i}", s.http, p, r) for i, (s, (p, r)) in enumerate(zip((s0, s1), ev))]
        picker = Picker(pods, "kv")
        reader = EventReader(pods)
        port = free_port()
        hasher = PromptHasher(AutoTokenizer.from_pretrained(model), BS, SEED)
        try:
            for _ in _run_app(make_app(picker, hasher), port):
                yield Setup(f"http://127.0.0.1:{port}", [s0, s1], picker, hasher)
        finally:
            reader.close()


def _chat(url: str, messages: list[dict[str, str]], stream: bool = False) -> tuple[int, dict[str, str], bytes]:
    return _post(url + "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True, "stream": stream})


def _wait(cond: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_chat_turns_follow_the_cache_and_hashes_match_the_engine(setup: Setup) -> None:
    url, picker = setup.url, setup.picker
    a, b = picker.pods
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    turn1 = [system, {"role": "user", "content": "Say something about rivers."}]
    status, headers, body = _chat(url, turn1)
    assert status == 200, body
    assert headers["x-picker-pod"] == "pod0"  # nobody holds it; a tie on load: the first pod
    # the picker's tokens are the engine's (its own /tokenize, and the prompt it counted) ...
    ids = setup.hasher.token_ids("/v1/chat/completions", {"messages": turn1})
    _, _, raw = _post(setup.servers[0].http + "/tokenize", {"messages": turn1})
    assert ids == json.loads(raw)["tokens"] and len(ids) == json.loads(body)["usage"]["prompt_tokens"]
    # ... and the engine publishes the prompt's full blocks: exactly the hashes the picker computed
    tok_hashes = setup.hashes(turn1)
    assert len(tok_hashes) >= 4
    _wait(lambda: a.index.prefix(tok_hashes) == len(tok_hashes), "pod0 published the prompt's blocks")
    assert b.index.prefix(tok_hashes) == 0
    answer = json.loads(body)["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And lakes?"}]
    a.in_flight = 3  # busier, but within the imbalance: the prefix wins
    try:
        status, headers, _ = _chat(url, turn2)
        assert status == 200 and headers["x-picker-pod"] == "pod0"
        # another user's prompt, held by nobody: the least loaded
        status, headers, _ = _chat(url, [{"role": "user", "content": "Tell me about mountains. " * 6}])
        assert status == 200 and headers["x-picker-pod"] == "pod1"
    finally:
        a.in_flight = 0
    assert a.routed.get("prefix_hit") == 1 and a.routed.get("least_loaded") == 1 and b.routed == {"least_loaded": 1}


def test_answers_come_back_byte_for_byte(setup: Setup) -> None:
    url, servers, picker = setup.url, setup.servers, setup.picker
    for pod, server in zip(picker.pods, servers):
        # the next request goes to this pod: the other is busier and nobody holds the prompt
        other = picker.pods[1 - picker.pods.index(pod)]
        other.in_flight = 5
        try:
            for path, body, key in [("/tokenize", {"prompt": "Hello there, rivers and lakes."}, KEY),
                                    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, "wrong-key"),
                                    ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, KEY),
                                    ("/v1/completions", {"prompt": "Hi", "model": "no-such-model"}, KEY)]:
                via = _post(url + path, body, key)
                direct = _post(server.http + path, body, key)
                assert via[0] == direct[0] and via[2] == direct[2], (path, via, direct)
                assert via[1]["x-picker-pod"] == pod.name
                for h in ("Content-Type", "Content-Length"):
                    assert via[1].get(h) == direct[1].get(h), (path, h)
            # a stream: the same events (ids and times aside), [DONE] last
            msgs = [{"role": "user", "content": "Count to three."}]
            via, direct = _chat(url, msgs, stream=True), _chat(server.http, msgs, stream=True)
            assert via[0] == direct[0] == 200 and via[1]["Content-Type"] == direct[1]["Content-Type"]
            assert _events(via[2]) == _events(direct[2]) and via[2].endswith(b"data: [DONE]\n\n")
        finally:
            other.in_flight = 0


def _events(raw: bytes) -> list[Any]:
    """A stream's events, ids and times aside, with the text of every delta joined at the end:
    a busy frontend sends two tokens in one chunk, so where the stream splits its text is not
    the proxy's doing (a chunk the proxy dropped, reordered or rewrote still changes the text)."""
    out: list[Any] = []
    text = ""
    for ev in raw.decode().split("\n\n"):
        data = ev.removeprefix("data: ")
        if not data or data == "[DONE]":
            out.append(data)
            continue
        obj = json.loads(data)
        obj.pop("id", None)
        obj.pop("created", None)
        choices = obj.get("choices") or []
        for ch in choices:
            text += ch.get("delta", {}).pop("content", None) or ""
        if len(choices) == 1 and not choices[0].get("delta") and choices[0].get("finish_reason") is None:
            continue  # a chunk that carried text only
        out.append(obj)
    return [*out, text]


def test_state_route(setup: Setup) -> None:
    url, picker = setup.url, setup.picker
    with urllib.request.urlopen(url + "/picker/state", timeout=30) as r:
        state = json.load(r)
    assert state["policy"] == "kv" and [p["name"] for p in state["pods"]] == ["pod0", "pod1"]
    assert state["pods"][0]["cached_blocks"] == len(picker.pods[0].index.hashes) > 0

