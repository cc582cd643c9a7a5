"""The differential test against vLLM (issue 20, acceptance 1; issue 41,
acceptance 4): the same 200 requests to vLLM 0.32's CPU OpenAI server and to
``pagedserve serve``, same model, greedy, one server at a time (``python -m
benchmarks vllm-diff``); also the error bodies field by field, the keys each
body sends, ``prompt_logprobs`` ranks and the ``/metrics`` families after the
load. Zero differences outside docs/api.md's accepted table.

The run is opt-in (PAGEDSERVE_VLLM_DIFF=1, several minutes on two cores) and
needs the peer venv; the checks of the comparison itself always run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from benchmarks import vllm_diff_accepted as accepted
from benchmarks.peer_engines import PEERS_VENV
from benchmarks.vllm_diff import REQUIRED, all_cases, required_failures
from benchmarks.vllm_diff_compare import compare, normalize
from benchmarks.vllm_diff_corpus import CHAT, CMPL, EXACT, STATUS, Case

STAMP = PEERS_VENV / ".peers-stamp"


def test_corpus_is_200_requests_covering_every_feature() -> None:
    cases = all_cases()
    assert len(cases) == 200
    cats = Counter(c.cat for c in cases)
    assert set(cats) == {"completions", "chat", "stream", "n", "logprobs", "echo", "stop", "extras", "structured",
                         "tools", "invalid", "prompt_logprobs"}
    plp = [c for c in cases if c.body.get("prompt_logprobs") is not None and c.compare == EXACT]
    assert len(plp) >= 6 and any(c.body.get("echo") for c in plp) and {c.route for c in plp} == {CHAT, CMPL}
    # Some bodies keep their default shape (no return_token_ids): the null fields vLLM sends there.
    assert {c.route for c in cases if c.plain} == {CHAT, CMPL}
    assert cats["invalid"] >= 25 and all(c.compare == STATUS for c in cases if c.cat == "invalid")
    keys = {k for c in cases for k in c.body} | {k for c in cases for k in (c.body.get("stream_options") or {})}
    for field in ("echo", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "skip_special_tokens",
                  "spaces_between_special_tokens", "add_generation_prompt", "continue_final_message",
                  "chat_template_kwargs", "prompt_logprobs", "truncate_prompt_tokens", "return_tokens_as_token_ids",
                  "top_k", "min_p", "repetition_penalty", "continuous_usage_stats", "response_format",
                  "structured_outputs", "guided_json", "tools", "tool_choice", "logprobs", "top_logprobs", "n"):
        assert field in keys, field
    choices = {json.dumps(c.body.get("tool_choice")) for c in cases if c.cat == "tools"}
    assert {'"auto"', '"required"'} <= choices and any("function" in x for x in choices)
    # Greedy wherever ids are compared exactly.
    assert all(c.body.get("temperature") == 0 for c in cases if c.compare == EXACT)


def _chat_body(ids: list[int], text: str, finish: str, args: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": finish, "token_ids": ids, "message": {
        "role": "assistant", "content": text,
        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": args}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": len(ids)}}


def test_compare_finds_each_required_difference() -> None:
    case = Case("t", "tools", CHAT, {"temperature": 0})
    base = normalize(True, 200, _chat_body([1, 2, 3], "hi", "tool_calls", '{"a": 1}'), None)
    assert compare(case, base, base) == []
    # The same JSON arguments spelled differently are the same call (reported apart).
    kinds = [k for k, _ in compare(case, base, normalize(True, 200, _chat_body([1, 2, 3], "hi", "tool_calls",
                                                                                '{"a":1}'), None))]
    assert kinds == ["tool_args_spelling"]
    other = normalize(True, 200, _chat_body([1, 2, 4], "hi", "stop", '{"a": 2}'), None)
    kinds = [k for k, _ in compare(case, base, other)]
    assert {"token_ids", "finish_reason", "tool_calls"} <= set(kinds)
    bad = Case("b", "invalid", CMPL, {}, STATUS)
    assert compare(bad, normalize(False, 400, {}, None), normalize(False, 200, {"choices": []}, None))[0][0] == "status"
    assert compare(bad, normalize(False, 400, {}, None), normalize(False, 400, {}, None)) == []


def test_a_stream_reduces_to_its_whole_answer() -> None:
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
                  {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}]},
                            "token_ids": [1]}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
                            "token_ids": [2]}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                            "token_ids": [3], "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}]
    whole = normalize(True, 200, _chat_body([1, 2, 3], "", "tool_calls", '{"a": 1}'), None)
    streamed = normalize(True, 200, None, chunks)
    assert compare(Case("s", "tools", CHAT, {"temperature": 0}), whole, streamed) == []
    # Ids spelled token_id:N in logprobs count when token_ids is absent.
    lp = {"choices": [{"index": 0, "text": "ab", "finish_reason": "length", "logprobs": {
        "tokens": ["token_id:7", "token_id:9"], "token_logprobs": [-0.1, -0.2], "top_logprobs": [None, None]}}]}
    assert normalize(False, 200, lp, None)["choices"][0]["token_ids"] == [7, 9]


def test_required_failures_name_the_requirement() -> None:
    rows = [{"name": "a", "cat": "x", "mismatches": [["token_ids", "", None], ["logprobs", "", None]]},
            {"name": "b", "cat": "x", "mismatches": [["text", "", None]]},
            {"name": "c", "cat": "invalid", "mismatches": [["status", "400 vs 200", None]]}]
    assert required_failures(rows) == {"token ids": ["a"], "same HTTP status": ["c"]}
    listed = [*rows, {"name": "d", "cat": "x", "mismatches": [["token_ids", "", 0]]}]  # docs/api.md's row 0
    assert required_failures(listed) == required_failures(rows)
    assert set(REQUIRED.values()) == {"token ids", "tool_calls", "finish_reason", "same HTTP status"}


def test_the_kept_differences_are_listed_in_docs_api() -> None:
    """guided_* and a per-request disable_any_whitespace: applied here, ignored by vLLM 0.32."""
    table = accepted.load()
    for name in ("so-guided-json", "so-guided-choice", "so-no-ws"):
        assert any(a.matches("token_ids", name, "choice 0: first difference at 0 of 9/9") for a in table), name
    assert not any(a.matches("token_ids", "cmpl-0", "choice 0: x") for a in table)


@pytest.fixture(scope="module")
def diff(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not STAMP.exists():
        pytest.skip(f"no peer venv ({STAMP} missing): run scripts/setup-peers.sh")
    if os.environ.get("PAGEDSERVE_VLLM_DIFF") != "1":
        pytest.skip("opt-in: set PAGEDSERVE_VLLM_DIFF=1 (starts vLLM, then pagedserve, 200 requests each; "
                    "several minutes on two cores)")
    # PAGEDSERVE_VLLM_DIFF_ANSWERS=DIR: compare the answers of an earlier run kept there (no servers).
    kept = os.environ.get("PAGEDSERVE_VLLM_DIFF_ANSWERS")
    out: Path = Path(kept) if kept else tmp_path_factory.mktemp("vllm-diff")
    cmd = [sys.executable, "-m", "benchmarks", "vllm-diff", "--out", str(out)]
    proc = subprocess.run(cmd + (["--compare-only"] if kept else []), capture_output=True, text=True, timeout=3600,
                          cwd=Path(__file__).resolve().parents[1])
    print(proc.stdout[-6000:])
    # 1: unlisted differences (the tests below name them); anything else is a crash.
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "diff.json").read_text())
    assert result["requests"] == 200
    return result


def _broken(diff: dict[str, Any], kinds: set[str]) -> list[str]:
    """The mismatches of these kinds that docs/api.md's table does not list."""
    return [f"{r['name']}: {m[0]}: {m[1]}" for r in diff["rows"] for m in r["mismatches"]
            if m[0] in kinds and m[2] is None]


def test_identical_token_ids(diff: dict[str, Any]) -> None:
    assert not (bad := _broken(diff, {"token_ids", "ids_missing", "n_choices"})), "\n".join(bad)


def test_identical_tool_calls_and_finish_reason(diff: dict[str, Any]) -> None:
    assert not (bad := _broken(diff, {"tool_calls", "finish_reason"})), "\n".join(bad)


def test_same_http_status(diff: dict[str, Any]) -> None:
    assert not (bad := _broken(diff, {"status"})), "\n".join(bad)


def test_error_bodies_field_by_field(diff: dict[str, Any]) -> None:
    assert diff["comparisons"]["error bodies"] >= 25
    kinds = {"error_body", "error_keys", "error_type", "error_code", "error_param", "error_message"}
    assert not (bad := _broken(diff, kinds)), "\n".join(bad)


def test_null_and_present_fields(diff: dict[str, Any]) -> None:
    assert diff["comparisons"]["key sets"] >= 150
    assert not (bad := _broken(diff, {"key_missing", "key_extra", "null_field"})), "\n".join(bad)


def test_prompt_logprobs_ranks(diff: dict[str, Any]) -> None:
    assert diff["comparisons"]["prompt_logprobs"] >= 7
    kinds = {"prompt_logprobs", "prompt_lp_ids", "prompt_lp_rank", "prompt_lp_token", "prompt_lp_logprob"}
    assert not (bad := _broken(diff, kinds)), "\n".join(bad)


def test_metric_families_after_the_load(diff: dict[str, Any]) -> None:
    assert diff["comparisons"]["metric families"] >= 20
    assert not (bad := _broken(diff, {"metric_missing", "metric_type", "metric_extra"})), "\n".join(bad)


def test_no_unlisted_difference_of_any_kind(diff: dict[str, Any]) -> None:
    assert diff["unlisted"] == [], "\n".join(diff["unlisted"])
