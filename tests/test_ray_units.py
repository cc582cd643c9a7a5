"""The Ray ingress's pure parts, without Ray: the replica label on engine metrics
(read back by prometheus_client's own parser), and a stream's continuation
after its replica died (pagedserve/rayserve/resume.py)."""
from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.rayserve.affinity import CHOSEN_TTL_S, SPECULATIVE_TTL_S, Affinity
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


# ---------------------------------------------------------------- the KV-aware choice (affinity.py), without Ray
def _prompt(user: int, blocks: int) -> list[int]:
    """A user's prompt as block hashes: its turns share their leading blocks."""
    return [user * 1000 + i for i in range(blocks)]


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _three(cached: dict[str, set[int]] | None = None) -> list[tuple[str, set[int]]]:
    return [(r, (cached or {}).get(r, set())) for r in ("a", "b", "c")]


def test_a_burst_of_cold_prompts_is_spread_by_the_prefill_waiting_not_by_report_timing() -> None:
    aff = Affinity(clock=_Clock())
    sizes = [60, 40, 40, 50, 38, 63, 45, 55, 41]  # blocks of 9 first turns, all at once, nothing cached
    got = [aff.choose(_three(), _prompt(u, n), key=f"r{u}") for u, n in enumerate(sizes)]
    # Each goes where the fewest blocks wait (2 more per request in flight), ties by id: a 62, b 42, c 42,
    # b 94 (the tie with c), c 82, a 127, c 129, b 151, a 170
    assert [c.ranked[0] for c in got] == ["a", "b", "c", "b", "c", "a", "c", "b", "a"]
    assert all(c.reason == "least_loaded" and c.hit == 0 for c in got)
    assert {r: aff.load(r) for r in "abc"} == {"a": (170, 3), "b": (151, 3), "c": (129, 3)}
    assert got[-1].costs == {"a": 127 + 41, "b": 151 + 41, "c": 129 + 41}
    # A stats report from a, showing its first prompt computed: that prefill leaves a's queue, its requests stay
    nxt = aff.choose(_three({"a": set(_prompt(0, 60))}), _prompt(20, 50), key="r20")
    assert (nxt.ranked, nxt.reason, nxt.costs) == (["a", "c", "b"], "least_loaded", {"a": 160, "b": 201, "c": 179})
    assert aff.load("a") == (110 + 52, 4)


def test_a_later_turn_goes_back_to_its_prefix_unless_that_replica_is_busier_than_recomputing() -> None:
    aff = Affinity(clock=_Clock())
    cached = {"a": set(_prompt(1, 50)), "b": set(_prompt(2, 40))}
    aff.routed("cold", "c", _prompt(3, 30), set())  # c: 30 blocks to prefill, +2
    turn2 = aff.choose(_three(cached), _prompt(1, 53), key="u1t2")  # 50 of its 53 blocks cached on a
    assert (turn2.ranked, turn2.reason, turn2.hit) == (["a", "b", "c"], "prefix_hit", 50)
    assert turn2.costs == {"a": 3, "b": 53, "c": 32 + 53}
    for k in ("cold", "u1t2"):
        aff.finished(k)
    aff.routed("y", "a", _prompt(6, 30), set())  # now a has a cold prompt of 30 blocks waiting
    long_hit = aff.choose(_three(cached), _prompt(1, 55), key="u1t3")  # 53 held (50 reported, 3 just sent)
    assert (long_hit.ranked, long_hit.reason, long_hit.hit) == (["a", "b", "c"], "prefix_hit", 53)
    assert long_hit.costs == {"a": 32 + 2, "b": 55, "c": 55}
    aff.finished("u1t3")
    short = {"a": set(_prompt(8, 5)) | set(_prompt(9, 5))}
    short_hit = aff.choose(_three(short), _prompt(8, 50), key="u8")  # 5 blocks held: less than a's queue
    assert (short_hit.ranked, short_hit.reason, short_hit.hit) == (["b", "c", "a"], "fallback", 0)
    assert short_hit.costs == {"a": 32 + 45, "b": 50, "c": 50}
    aff.finished("y")
    idle = aff.choose(_three(short), _prompt(9, 50), key="u9")  # a idle again: the same short hit wins
    assert (idle.ranked[0], idle.reason, idle.hit) == ("a", "prefix_hit", 5)


def test_a_prompt_s_prefill_leaves_the_queue_as_its_replica_reports_its_blocks_computed() -> None:
    aff = Affinity(clock=_Clock())
    for u in range(3):
        aff.choose(_three(), _prompt(u, 60), key=f"u{u}")
    assert {r: aff.load(r) for r in "abc"} == {"a": (62, 1), "b": (62, 1), "c": (62, 1)}
    partly = _three({"b": set(_prompt(1, 45))})  # b computed 45 of its prompt's 60 blocks (chunked prefill)
    assert aff.load("b", partly[1][1]) == (17, 1)
    nxt = aff.choose(partly, _prompt(9, 40), key="u9")
    assert (nxt.ranked, nxt.costs) == (["b", "a", "c"], {"a": 102, "b": 57, "c": 102})
    assert aff.load("b") == (17 + 42, 2)


def test_in_flight_counts_from_the_choice_until_the_response_ends() -> None:
    aff = Affinity(clock=_Clock())
    first = aff.choose(_three(), _prompt(1, 10), key="k1")
    assert first.ranked[0] == "a" and aff.load("a") == (12, 1)
    aff.routed("k1", "b", _prompt(1, 10), set())  # Serve took the next: a was full
    assert aff.load("a") == (0, 0) and aff.load("b") == (12, 1)
    assert aff.choose(_three(), _prompt(2, 10), key="k2").ranked[0] == "a"
    aff.finished("k1")
    assert aff.load("b") == (0, 0)
    assert aff.choose(_three(), _prompt(3, 10), key="k3").ranked[0] == "b"
    aff.forget("a")  # a died: its requests go elsewhere (routed again)
    assert aff.load("a") == (0, 0) and set(aff.flights) == {"k3"}
    again = aff.choose(_three(), _prompt(3, 10), key="k3")  # Serve asks again for the same request:
    # its first try no longer counts (else b would cost 12, more than a's 10), its blocks do (just sent to b)
    assert (again.ranked[0], again.reason, again.costs) == ("b", "prefix_hit", {"a": 10, "b": 0, "c": 10})
    assert set(aff.flights) == {"k3"} and aff.load("b") == (2, 1)


def test_a_choice_serve_never_sent_stops_counting_and_a_sent_one_counts_until_it_ends() -> None:
    clock = _Clock()
    aff = Affinity(clock=clock)
    aff.choose(_three(), _prompt(1, 20), key="cancelled")  # a; its client left while Serve probed a
    aff.choose(_three(), _prompt(2, 20), key="sent")  # b, confirmed below
    aff.routed("sent", "b", _prompt(2, 20), set())
    clock.t += CHOSEN_TTL_S + 1
    nxt = aff.choose(_three(), _prompt(3, 20), key="next")
    assert (nxt.ranked, nxt.costs) == (["a", "c", "b"], {"a": 20, "b": 42, "c": 20})
    assert set(aff.flights) == {"sent", "next"}


def test_a_just_routed_prompt_counts_as_cached_for_a_while() -> None:
    clock = _Clock()
    aff = Affinity(clock=clock)
    aff.choose(_three(), _prompt(1, 20), key="t1")
    aff.finished("t1")
    clock.t += SPECULATIVE_TTL_S - 0.1
    hit = aff.choose(_three(), _prompt(1, 22), key="t2")
    assert (hit.ranked[0], hit.reason, hit.hit) == ("a", "prefix_hit", 20)
    aff.finished("t2")
    clock.t += SPECULATIVE_TTL_S + 0.1  # no report showed it since: the speculation lapses
    late = aff.choose(_three(), _prompt(1, 24), key="t3")
    assert (late.ranked[0], late.reason, late.hit) == ("a", "least_loaded", 0)
    assert late.costs == {"a": 24, "b": 24, "c": 24}


def test_a_replica_far_over_the_least_busy_in_requests_loses_even_a_full_hit() -> None:
    clock = _Clock()
    aff = Affinity(imbalance=2, decode_blocks=0, clock=clock)
    cached = {"a": set(_prompt(1, 40))}
    for i in range(3):
        aff.routed(f"h{i}", "a", [9000 + i], {9000 + i})  # three requests on a, all cached: no prefill
    assert aff.choose(_three(cached), _prompt(1, 41), key="u").ranked == ["b", "c", "a"]
    aff.finished("u")
    clock.t += SPECULATIVE_TTL_S + 1  # b no longer counts as holding it (no report said so)
    aff.finished("h0")  # two over the least busy: within the bound
    assert aff.choose(_three(cached), _prompt(1, 41), key="u").ranked[0] == "a"


def test_the_benchmark_s_verdicts_come_from_the_medians_of_its_runs() -> None:
    from benchmarks.ray_multiturn import summarize

    def run(router: str, hit: float, p50: float, p99: float, tok: float, lost: int = 0) -> dict[str, object]:
        return {"router": router, "prefix_hit_rate": hit, "ttft_p50_s": p50, "ttft_p99_s": p99, "output_tok_s": tok,
                "lost": ["x"] * lost}

    runs = [run("kv", 0.7, 0.5, 20.6, 37.7), run("round-robin", 0.39, 4.0, 22.8, 17.8),
            run("round-robin", 0.39, 3.4, 18.2, 19.3), run("kv", 0.72, 0.5, 18.4, 38.1),
            run("kv", 0.68, 0.49, 20.5, 33.3), run("round-robin", 0.35, 4.3, 17.6, 20.5),
            run("kv-kill", 0.6, 0.98, 33.0, 27.0)]
    out = summarize(runs, ["kv", "round-robin"], kill=True)
    assert out["median"]["kv"] == {"prefix_hit_rate": 0.7, "ttft_p50_s": 0.5, "ttft_p99_s": 20.5,
                                   "output_tok_s": 37.7, "lost": 0}
    assert out["median"]["round-robin"]["ttft_p99_s"] == 18.2
    assert out["verdicts"] == {"kv_ahead_on_hit_rate": True, "kv_ahead_on_ttft_p50": True,
                               "kv_ahead_on_ttft_p99": False, "kv_ahead_on_output_tok_s": True,
                               "acceptance_2": False, "kill_lost_0": True, "kill_ttft_p50_within_2x": True,
                               "acceptance_3": True}
    assert out["kill"] == {"lost": 0, "ttft_p50_s": 0.98, "ttft_p50_vs_undisturbed": 1.96}
    runs[1]["ttft_p99_s"] = runs[2]["ttft_p99_s"] = 21.0  # round-robin's median p99 now behind kv's
    runs[-1].update(lost=["cut"], ttft_p50_s=1.2)
    out = summarize(runs, ["kv", "round-robin"], kill=True)
    assert out["verdicts"]["acceptance_2"] and out["verdicts"]["kv_ahead_on_ttft_p99"]
    assert not out["verdicts"]["acceptance_3"] and not out["verdicts"]["kill_lost_0"]
    assert out["kill"]["ttft_p50_vs_undisturbed"] == 2.4 and not out["verdicts"]["kill_ttft_p50_within_2x"]
