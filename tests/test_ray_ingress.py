"""Issue 42, acceptance 1: the Ray ingress forwards, so through it every feature
answers as a single engine does. tests/ray_features.py sends the same requests to
`pagedserve serve` (the embedded SmolLM2, greedy or seeded, so outputs compare
exactly) and to the ingress in front of two replicas of it with the same
SERVE_ARGS (--api-key, tools): streaming, n, logprobs, response_format, tools
(named, required, auto), stop, errors, auth with the right key and a wrong one,
/tokenize, /detokenize, /v1/models and the model name, then /metrics and /health.
Opt-in (PAGEDSERVE_RAY_TESTS=1; about 2 minutes)."""
from __future__ import annotations

from typing import Any

import pytest

from ray_util import run_script

# What each probe must answer (so that "the same on both" cannot pass on two equal failures)
EXPECTED = {"models": 200, "models_no_key": 401, "completion": 200, "completion_wrong_key": 401,
            "completion_stream": 200, "completion_ids": 200, "completion_n2": 200, "completion_n2_greedy": 400,
            "completion_logprobs": 200, "completion_stop": 200, "chat": 200, "chat_stream": 200,
            "chat_n2_logprobs": 200, "chat_stop": 200, "chat_json_schema": 200, "chat_json_object": 200,
            "tools_named": 200, "tools_required": 200, "tools_auto": 200, "tools_named_stream": 200,
            "error_max_tokens": 400, "error_unknown_model": 404, "error_bad_json": 400, "error_too_long": 400,
            "error_unknown_route": 404, "tokenize": 200, "tokenize_chat": 200, "detokenize": 200, "version": 200}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    return run_script("ray_features.py", tmp_path_factory.mktemp("ray"))


def test_every_probe_answers_through_the_ingress_as_on_a_single_engine(run: dict[str, list[Any]]) -> None:
    probes = {p["name"]: p for p in run["PROBE"]}
    assert set(probes) == set(EXPECTED)
    for name, p in probes.items():
        assert p["single"]["status"] == EXPECTED[name], (name, p["single"])
        assert p["ray"] == p["single"], name


def test_the_answers_are_the_features_asked_for(run: dict[str, list[Any]]) -> None:
    """What the single engine (hence the ingress) answered is the feature, not a degraded 200."""
    b = {p["name"]: p["ray"]["body"] for p in run["PROBE"]}
    assert b["models"]["data"][0]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert len(b["completion_n2"]["choices"]) == 2 and len(b["chat_n2_logprobs"]["choices"]) == 2
    assert all(len(t["top_logprobs"]) == 3 for c in b["chat_n2_logprobs"]["choices"] for t in c["logprobs"]["content"])
    assert b["completion_logprobs"]["choices"][0]["logprobs"]["top_logprobs"]
    assert "," not in b["completion_stop"]["choices"][0]["text"]
    assert b["completion_stop"]["choices"][0]["finish_reason"] == "stop"
    for name in ("tools_named", "tools_required"):  # "auto" may answer in prose: compared above only
        assert "get_weather" in str(b[name]["choices"][0]["message"]), b[name]
    assert [e for e in b["chat_stream"] if e != "[DONE]"][-1]["usage"]["completion_tokens"] > 0
    assert b["chat_stream"][-1] == b["completion_stream"][-1] == "[DONE]"
    for name in ("models_no_key", "completion_wrong_key", "error_max_tokens", "error_unknown_model", "error_bad_json"):
        assert set(b[name]["error"]) >= {"message", "type", "code"}, (name, b[name])


def test_metrics_and_health(run: dict[str, list[Any]]) -> None:
    [m] = run["METRICS"]
    own = set(m["ray_own"])
    engines = set(m["ray_families"]) - own
    assert set(m["single_families"]) <= engines, "the engines' families, all of them"
    # beyond them only a labelled counter's _created that one replica's history made (e.g. a rejection)
    assert all(f.endswith("_created") for f in engines - set(m["single_families"])), engines - set(m["single_families"])
    assert {"pagedserve_router_requests_total", "pagedserve_router_prefix_hit_blocks"} <= own
    assert m["ray_unlabelled"] == 0 and len(m["ray_replicas"]) == 2, "every engine sample has its replica label"
    assert m["single_unlabelled"] > 0
    assert sum(m["routed"].values()) >= len(EXPECTED) and m["routed"].get("prefix_hit", 0) > 0, m["routed"]
    [h] = run["HEALTH"]
    assert h["single"]["status"] == h["ray"]["status"] == 200
    assert h["single"]["body"]["status"] == h["ray"]["body"]["status"] == "ok"
    assert [r["healthy"] for r in h["ray"]["body"]["replicas"]] == [True, True]


def test_grpc_through_the_replica_the_ingress_names(run: dict[str, list[Any]]) -> None:
    """gRPC: POST /pagedserve/route gives the KV-chosen replica's address (behind the engine's own auth), and
    that engine's gRPC API answers as the single engine's does."""
    [g] = run["GRPC"]
    assert g["route_status"] == 200 and g["route_wrong_key"] == 401, g
    assert g["route_wrong_key_body"]["error"]["code"] == 401  # vLLM's integer code, as the engine answers
    assert g["ray"] == g["single"] and g["single"]["ids"] and g["single"]["wrong_key"] == "UNAUTHENTICATED", g


def test_a_stream_whose_replica_is_killed_resumes_on_another(run: dict[str, list[Any]]) -> None:
    """Acceptance 3's client view: the replica serving a greedy stream is killed (ray.kill) after a few
    events; the ingress resumes it on the other replica from what was streamed, and the client's text
    is the single engine's, in one stream with one id, ending in [DONE]."""
    for r in run["RESUME"]:
        assert r["killed"] and r["events_before_kill"] >= 3, r
        assert r["ray_text"] == r["single_text"] and r["ids"] == 1 and r["done"], r
    assert {r["route"] for r in run["RESUME"]} == {"/v1/completions", "/v1/chat/completions"}
    assert run["METRICS_AFTER_KILL"][0]["resumed"] >= 2
