"""The Ray ingress's pure parts, without Ray: the replica label on engine metrics
(read back by prometheus_client's own parser), and a stream's continuation
after its replica died (pagedserve/rayserve/resume.py)."""
from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.rayserve.observe import _label
from pagedserve.rayserve.resume import StreamState


def _engine_metrics() -> str:
    reg = CollectorRegistry()
    Counter("vllm:prefix_cache_hits", "hits", ["model_name"], registry=reg).labels("m").inc(7)
    Gauge("vllm:num_requests_running", "running", registry=reg).set(3)
    h = Histogram("vllm:time_to_first_token_seconds", "ttft", ["model_name"], buckets=(0.1, 1.0), registry=reg)
    h.labels("m").observe(0.5)
    return generate_latest(reg).decode()


def test_every_sample_gets_the_replica_label_and_keeps_its_value() -> None:
    text = _engine_metrics()
    labelled = "".join(line + "\n" for _, lines in _label(text, "r1") for line in lines)
    want = {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}
    got = {}
    for f in text_string_to_metric_families(labelled):
        for s in f.samples:
            labels = dict(s.labels)
            assert labels.pop("replica") == "r1", s
            got[(s.name, tuple(sorted(labels.items())))] = s.value
    assert got == want and len(want) > 8
    assert {f.name for f in text_string_to_metric_families(labelled)} == \
        {f.name for f in text_string_to_metric_families(text)}


def _sse(obj: object) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def test_a_chat_stream_continues_from_what_the_client_saw() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 10}
    st = StreamState("/v1/chat/completions", json.dumps(body).encode())
    role = {"id": "chatcmpl-a", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                              "content": ""}}]}
    piece = {"id": "chatcmpl-a", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    raw = _sse(role) + _sse(piece)
    out = st.events(raw[:7]) + st.events(raw[7:-3]) + st.events(raw[-3:])  # split anywhere: whole events out
    assert b"".join(out) == raw and st.text == "Hel" and st.resumable()
    cont = json.loads(st.continuation(lambda text, ids=False: [1, 2] if ids else 2))
    assert cont["messages"][-1] == {"role": "assistant", "content": "Hel"} and cont["continue_final_message"]
    assert cont["add_generation_prompt"] is False and cont["max_tokens"] == 8
    st.resumed = 1
    new_role = {**role, "id": "chatcmpl-b", "created": 9}
    assert st.rewrite(_sse(new_role)) is None, "the client had the role chunk"
    more = json.loads(st.rewrite(_sse({**piece, "id": "chatcmpl-b", "created": 9}))[6:])
    assert (more["id"], more["created"]) == ("chatcmpl-a", 5)
    usage = json.loads(st.rewrite(_sse({"id": "x", "choices": [], "usage": {"prompt_tokens": 12,
                                                                            "completion_tokens": 8}}))[6:])
    assert usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 10}


def test_a_completion_continues_with_its_text_or_ids_appended() -> None:
    for prompt, want in (("Once", "Once upon"), ([7, 8], [7, 8, 1, 2])):
        st = StreamState("/v1/completions", json.dumps({"prompt": prompt, "stream": True, "max_tokens": 3}).encode())
        st.events(_sse({"id": "cmpl-a", "created": 1, "choices": [{"index": 0, "text": " upon"}]}))
        cont = json.loads(st.continuation(lambda text, ids=False: [1, 2] if ids else 2))
        assert cont["prompt"] == want and cont["max_tokens"] == 1
    assert st.continuation(lambda text, ids=False: 3) is None, "the budget is spent: nothing to ask"


def test_what_a_continuation_would_change_is_not_resumed() -> None:
    base = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    for extra in ({"n": 2}, {"logprobs": True}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"response_format": {"type": "json_object"}}, {"stream": False}):
        assert not StreamState("/v1/chat/completions", json.dumps({**base, **extra}).encode()).resumable(), extra
    done = StreamState("/v1/chat/completions", json.dumps(base).encode())
    done.events(b"data: [DONE]\n\n")
    assert not done.resumable()
    assert StreamState("/v1/chat/completions", json.dumps(base).encode()).resumable()
