"""One answer (a JSON body or the chunks of a stream) reduced to what
``bench vllm-diff`` compares, and the comparison of vLLM's with ours.

Token ids come from the choice's ``token_ids`` (vLLM's ``return_token_ids``,
which the harness adds to every valid request) or, failing that, from
logprob tokens spelled ``token_id:N`` (``return_tokens_as_token_ids``)."""
from __future__ import annotations

import json
from typing import Any

from benchmarks.vllm_diff_corpus import SAMPLED, STATUS, Case

LOGPROB_ATOL = 0.02  # float32 on both; different kernels and summation orders


def _lp_entries(lp: Any) -> list[tuple[str, float | None, dict[str, float]]]:
    """(token, logprob, top {token: logprob}) per position, from either API's shape."""
    if not isinstance(lp, dict):
        return []
    if "content" in lp:  # chat
        return [(e.get("token", ""), e.get("logprob"), {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []})
                for e in lp.get("content") or []]
    tokens, values, tops = lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    return [(t, values[i] if i < len(values) else None, dict(tops[i] or {}) if i < len(tops) else {})
            for i, t in enumerate(tokens)]


def _merge_tool_deltas(acc: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    for d in deltas:
        i = d.get("index", len(acc))
        while len(acc) <= i:
            acc.append({"type": None, "name": "", "arguments": ""})
        fn = d.get("function") or {}
        acc[i]["type"] = d.get("type") or acc[i]["type"]
        acc[i]["name"] += fn.get("name") or ""
        acc[i]["arguments"] += fn.get("arguments") or ""


def _tool_calls(calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not calls:
        return None
    return [{"type": c.get("type"), "name": (c.get("function") or {}).get("name", ""),
             "arguments": (c.get("function") or {}).get("arguments", "")} for c in calls]


def _new_choice(index: int) -> dict[str, Any]:
    return {"index": index, "text": "", "token_ids": None, "finish_reason": None, "stop_reason": None,
            "tool_calls": None, "logprobs": [], "prompt_token_ids": None, "prompt_logprobs": None}


def normalize(route_is_chat: bool, status: int, body: Any, chunks: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The comparable outcome: status, choices (text, ids, finish_reason,
    tool_calls, logprobs, prompt ids), usage, stream usage pattern. (The
    prompt_logprobs, ranks included, are vllm_diff_bodies' to compare.)"""
    out: dict[str, Any] = {"status": status, "choices": [], "usage": None, "prompt_token_ids": None,
                           "prompt_logprobs": None, "chunks_with_usage": None}
    if status != 200:
        return out
    choices: dict[int, dict[str, Any]] = {}
    if chunks is not None:
        with_usage = 0
        for ch in chunks:
            if ch.get("usage"):
                out["usage"] = ch["usage"]
                with_usage += bool(ch.get("choices"))
            out["prompt_token_ids"] = out["prompt_token_ids"] or ch.get("prompt_token_ids")
            for c in ch.get("choices") or []:
                acc = choices.setdefault(c.get("index", 0), _new_choice(c.get("index", 0)))
                delta = c.get("delta") if route_is_chat else c
                delta = delta or {}
                acc["text"] += (delta.get("content") if route_is_chat else delta.get("text")) or ""
                if delta.get("tool_calls"):
                    acc["tool_calls"] = acc["tool_calls"] or []
                    _merge_tool_deltas(acc["tool_calls"], delta["tool_calls"])
                if c.get("token_ids") is not None:
                    acc["token_ids"] = (acc["token_ids"] or []) + list(c["token_ids"])
                acc["prompt_token_ids"] = acc["prompt_token_ids"] or c.get("prompt_token_ids")
                acc["logprobs"] += _lp_entries(c.get("logprobs"))
                acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
                acc["stop_reason"] = c.get("stop_reason", acc["stop_reason"])
        out["chunks_with_usage"] = with_usage
    elif isinstance(body, dict):
        out["usage"] = body.get("usage")
        out["prompt_token_ids"] = body.get("prompt_token_ids")
        out["prompt_logprobs"] = body.get("prompt_logprobs")
        for c in body.get("choices") or []:
            acc = choices.setdefault(c.get("index", 0), _new_choice(c.get("index", 0)))
            msg = c.get("message") or {}
            acc["text"] = (msg.get("content") if route_is_chat else c.get("text")) or ""
            acc["tool_calls"] = _tool_calls(msg.get("tool_calls")) if route_is_chat else None
            acc["token_ids"] = c.get("token_ids")
            acc["prompt_token_ids"] = c.get("prompt_token_ids")
            acc["prompt_logprobs"] = c.get("prompt_logprobs")
            acc["logprobs"] = _lp_entries(c.get("logprobs"))
            acc["finish_reason"] = c.get("finish_reason")
            acc["stop_reason"] = c.get("stop_reason")
    for acc in choices.values():
        if acc["token_ids"] is None and acc["logprobs"] and all(t.startswith("token_id:") for t, _, _ in
                                                                acc["logprobs"]):
            acc["token_ids"] = [int(t.split(":", 1)[1]) for t, _, _ in acc["logprobs"]]
            acc["ids_from"] = "logprobs"
    out["choices"] = [choices[i] for i in sorted(choices)]
    return out


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _first_diff(a: list[Any], b: list[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _logprobs_differ(a: list[Any], b: list[Any]) -> str | None:
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} positions"
    for i, ((ta, la, topa), (tb, lb, topb)) in enumerate(zip(a, b)):
        if ta != tb:
            return f"token {i}: {ta!r} vs {tb!r}"
        if (la is None) != (lb is None) or (la is not None and lb is not None and abs(la - lb) > LOGPROB_ATOL):
            return f"logprob {i}: {la} vs {lb}"
        if set(topa) != set(topb):
            return f"top {i}: {sorted(topa)} vs {sorted(topb)}"
        worst = max((abs(topa[k] - topb[k]) for k in topa), default=0.0)
        if worst > LOGPROB_ATOL:
            return f"top {i}: off by {worst:.3f}"
    return None


def compare(case: Case, a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, detail) for each way ``b`` (pagedserve) differs from ``a`` (vLLM); [] is a match."""
    if a["status"] != b["status"]:
        return [("status", f"{a['status']} vs {b['status']}")]
    if case.compare == STATUS or a["status"] != 200:
        return []
    if len(a["choices"]) != len(b["choices"]):
        return [("n_choices", f"{len(a['choices'])} vs {len(b['choices'])}")]
    out: list[tuple[str, str]] = []
    ua, ub = a["usage"] or {}, b["usage"] or {}
    if ua.get("prompt_tokens") != ub.get("prompt_tokens"):
        out.append(("usage", f"prompt_tokens {ua.get('prompt_tokens')} vs {ub.get('prompt_tokens')}"))
    if case.compare == SAMPLED:
        return out
    if ua.get("completion_tokens") != ub.get("completion_tokens"):
        out.append(("usage", f"completion_tokens {ua.get('completion_tokens')} vs {ub.get('completion_tokens')}"))
    if (a["chunks_with_usage"] or 0) > 0 and not b["chunks_with_usage"]:
        out.append(("continuous_usage", f"{a['chunks_with_usage']} chunks with usage vs {b['chunks_with_usage']}"))
    pa, pb = a["prompt_token_ids"], b["prompt_token_ids"]
    if pa is not None and pb is not None and pa != pb:
        out.append(("prompt_token_ids", f"differ at {_first_diff(pa, pb)} (lengths {len(pa)}, {len(pb)})"))
    for ca, cb in zip(a["choices"], b["choices"]):
        i = ca["index"]
        ia, ib = ca["token_ids"], cb["token_ids"]
        if ia is None or ib is None:
            out.append(("ids_missing", f"choice {i}: vllm {ia is not None}, pagedserve {ib is not None}"))
        elif ia != ib:
            out.append(("token_ids", f"choice {i}: first difference at {_first_diff(ia, ib)} of {len(ia)}/{len(ib)}"))
        if (ia is None or ib is None or ia == ib) and ca["text"] != cb["text"]:
            at = _first_diff(list(ca["text"]), list(cb["text"]))
            ta_, tb_ = ca["text"][at:at + 40], cb["text"][at:at + 40]
            out.append(("text", f"choice {i}: from char {at}: {ta_!r} vs {tb_!r}"))
        if ca["finish_reason"] != cb["finish_reason"]:
            out.append(("finish_reason", f"choice {i}: {ca['finish_reason']} vs {cb['finish_reason']}"))
        if ca["stop_reason"] != cb["stop_reason"]:
            out.append(("stop_reason", f"choice {i}: {ca['stop_reason']!r} vs {cb['stop_reason']!r}"))
        ta = [(t["type"], t["name"], _args(t["arguments"])) for t in ca["tool_calls"] or []]
        tb = [(t["type"], t["name"], _args(t["arguments"])) for t in cb["tool_calls"] or []]
        if ta != tb:
            out.append(("tool_calls", f"choice {i}: {ta} vs {tb}"[:300]))
        elif [t["arguments"] for t in ca["tool_calls"] or []] != [t["arguments"] for t in cb["tool_calls"] or []]:
            out.append(("tool_args_spelling", f"choice {i}: the same JSON, spelled differently"))
        if ia == ib or ia is None or ib is None:
            why = _logprobs_differ(ca["logprobs"], cb["logprobs"])
            if why:
                out.append(("logprobs", f"choice {i}: {why}"))
    return out

