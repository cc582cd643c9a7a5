"""``bench vllm-diff``'s comparer on hand-made bodies (no vLLM needed): each
kind of body difference is found, an unlisted one fails the run, a listed one
passes, and a table row that matched nothing is reported. So the comparison
cannot silently pass (issue 41, acceptance 4)."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from benchmarks import vllm_diff_accepted as accepted
from benchmarks.vllm_diff import AFTER_LOAD, diff, required_failures
from benchmarks.vllm_diff_bodies import (compare_errors, compare_keys, compare_metrics, compare_prompt_logprobs,
                                         key_paths)
from benchmarks.vllm_diff_corpus import CHAT, CMPL, EXACT, STATUS, Case

ERR = {"error": {"message": "temperature must be at most 2", "type": "BadRequestError", "param": "temperature",
                 "code": 400}}
CHAT_BODY = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "system_fingerprint": None,
             "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, "token_ids": [5, 6],
                          "message": {"role": "assistant", "content": "hi", "refusal": None, "reasoning": None}}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                       "prompt_tokens_details": None}}
PLP = [None, {"42": {"logprob": -3.0, "rank": 17, "decoded_token": " the"},
              "7": {"logprob": -0.5, "rank": 1, "decoded_token": ","}}]
METRICS = ("# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n"
           "vllm:num_requests_running 0.0\n# TYPE vllm:request_success counter\n"
           "# TYPE http_requests_total counter\n# TYPE python_gc_objects_collected counter\n")
TABLE = """### Differences from vLLM 0.32 that vllm-diff accepts

| kind | requests | detail | reason |
| --- | --- | --- | --- |
| `error_message` | `bad-*` | `*` | the words are ours |
| `key_missing` | `chat-*` | `choices[].message.reasoning` | a reason |
| `metric_missing` | `/metrics` | `vllm:never_*`, `vllm:other` | a row nothing matches |

### Next section
| kind | requests | detail | reason |
"""


def test_error_bodies_are_compared_field_by_field() -> None:
    assert compare_errors(ERR, copy.deepcopy(ERR)) == []
    ours = copy.deepcopy(ERR)
    ours["error"].update(type="invalid_request_error", code="400", param=None, message="other words")
    kinds = [k for k, _ in compare_errors(ERR, ours)]
    assert kinds == ["error_type", "error_code", "error_param", "error_message"]
    ours = {"error": {**ERR["error"], "object": "error"}, "detail": 1}
    assert [k for k, _ in compare_errors(ERR, ours)] == ["error_keys", "error_keys"]
    assert compare_errors(ERR, "Internal Server Error")[0][0] == "error_body"


def test_every_key_sent_null_or_set_must_be_ours_too() -> None:
    assert compare_keys([CHAT_BODY], [copy.deepcopy(CHAT_BODY)]) == []
    assert "choices[].message.refusal=null" in key_paths(CHAT_BODY)
    ours = copy.deepcopy(CHAT_BODY)
    del ours["choices"][0]["message"]["refusal"]
    ours["usage"]["prompt_tokens_details"] = {"cached_tokens": 0}
    ours["service_tier"] = None
    found = compare_keys([CHAT_BODY], [ours])
    assert ("key_missing", "choices[].message.refusal") in found
    assert ("null_field", "usage.prompt_tokens_details: null in vllm, set here") in found
    assert ("key_extra", "service_tier") in found
    # A completion's top_logprobs maps tokens (data, not schema): not recursed into.
    lp = {"choices": [{"logprobs": {"tokens": ["a"], "top_logprobs": [{"a": -0.1, "b": -2.0}]}}]}
    other = {"choices": [{"logprobs": {"tokens": ["c"], "top_logprobs": [{"c": -0.1}]}}]}
    assert compare_keys([lp], [other]) == []


def test_prompt_logprobs_ranks_and_ids_exact_logprobs_close() -> None:
    assert compare_prompt_logprobs(PLP, copy.deepcopy(PLP), "top") == []
    near = copy.deepcopy(PLP)
    near[1]["42"]["logprob"] = -3.01
    assert compare_prompt_logprobs(PLP, near, "top") == []
    bad = copy.deepcopy(PLP)
    bad[1]["42"].update(rank=None, logprob=-3.5, decoded_token="the")
    assert [k for k, _ in compare_prompt_logprobs(PLP, bad, "top")] == [
        "prompt_lp_rank", "prompt_lp_token", "prompt_lp_logprob"]
    other_id = [None, {"43": PLP[1]["42"], "7": PLP[1]["7"]}]
    assert compare_prompt_logprobs(PLP, other_id, "top")[0][0] == "prompt_lp_ids"
    assert compare_prompt_logprobs(PLP, None, "top")[0][0] == "prompt_logprobs"


def test_metric_families_and_types() -> None:
    ours = METRICS.replace("vllm:num_requests_running gauge", "vllm:num_requests_running counter")
    ours = ours.replace("# TYPE http_requests_total counter\n", "# TYPE vllm:ours_only gauge\n")
    assert compare_metrics(METRICS, METRICS) == []
    assert compare_metrics(METRICS, ours) == [("metric_missing", "http_requests_total"),
                                              ("metric_type", "vllm:num_requests_running: gauge vs counter"),
                                              ("metric_extra", "vllm:ours_only")]


def _engine(results: dict[str, Any], metrics: str) -> dict[str, Any]:
    models = '{"object": "list", "data": [{"id": "m", "root": "m", "permission": []}]}'
    return {"results": results, "after_load": {"/metrics": {"status": 200, "text": metrics},
                                               "/v1/models": {"status": 200, "text": models}}}


def test_an_unlisted_difference_fails_a_listed_one_passes() -> None:
    cases = [Case("bad-temp", "invalid", CMPL, {}, STATUS), Case("chat-0", "chat", CHAT, {"temperature": 0}, EXACT)]
    ref = _engine({"bad-temp": {"status": 400, "body": ERR}, "chat-0": {"status": 200, "body": CHAT_BODY}}, METRICS)
    same = copy.deepcopy(ref)
    table = accepted.parse(TABLE)
    rows, made = diff(cases, ref, same)
    assert made == {"error bodies": 1, "key sets": 2, "metric families": 3}
    verdict = accepted.judge(rows, table)
    assert verdict["unlisted"] == [] and len(verdict["unused"]) == 3  # rows that matched nothing: reported
    assert [r["name"] for r in rows if r["cat"] == AFTER_LOAD] == ["/metrics", "/v1/models"]

    ours = copy.deepcopy(ref)
    ours["results"]["bad-temp"]["body"]["error"]["message"] = "temperature: at most 2"  # listed: the words
    del ours["results"]["chat-0"]["body"]["choices"][0]["message"]["reasoning"]  # listed
    rows, _ = diff(cases, ref, ours)
    verdict = accepted.judge(rows, table)
    assert verdict["unlisted"] == []
    assert verdict["unused"] == ["metric_missing on /metrics: vllm:never_*/vllm:other"]

    ours["results"]["bad-temp"]["body"]["error"]["code"] = "400"  # unlisted: code must be vLLM's integer
    del ours["results"]["chat-0"]["body"]["choices"][0]["message"]["refusal"]  # unlisted
    ours["results"]["chat-0"]["body"]["choices"][0]["token_ids"] = [5, 7]  # unlisted, and a requirement
    ours["after_load"]["/metrics"]["text"] = METRICS.replace("# TYPE vllm:request_success counter\n", "")
    rows, _ = diff(cases, ref, ours)
    verdict = accepted.judge(rows, table)
    assert sorted(verdict["unlisted"]) == sorted([
        "bad-temp: error_code: 400 vs '400'", "chat-0: key_missing: choices[].message.refusal",
        "chat-0: token_ids: choice 0: first difference at 1 of 2/2", "/metrics: metric_missing: vllm:request_success"])
    assert required_failures(rows) == {"token ids": ["chat-0"]}


def test_a_broken_table_accepts_nothing() -> None:
    with pytest.raises(ValueError, match="no section"):
        accepted.parse("# api\n")
    with pytest.raises(ValueError, match="no reason"):
        accepted.parse(TABLE.replace("the words are ours", ""))
    with pytest.raises(ValueError, match="columns"):
        accepted.parse(TABLE.replace("| kind | requests | detail | reason |", "| kind | reason |", 1))


def test_docs_api_table_parses_with_a_reason_per_row() -> None:
    table = accepted.load()
    assert table and all(len(a.reason) > 10 for a in table)
    # Each row names its requests: no row accepts a kind on every request and every detail at once.
    assert not [a.label() for a in table if "*" in a.kinds and "*" in a.requests and "*" in a.details]
