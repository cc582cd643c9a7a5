"""``bench vllm-diff``'s comparisons of the bodies' shape, beside the
answers' content (vllm_diff_compare): the error bodies field by field, the
keys each 200 body sends (null or set), ``prompt_logprobs`` ranks and ids, and
the ``/metrics`` families after the same load.

Each returns ``(kind, detail)`` pairs; the details name a field path or a
family, so that docs/api.md's accepted-differences table can match them."""
from __future__ import annotations

import re
from typing import Any

ERROR_FIELDS = ("type", "code", "param")
# Recursed into: the schema's objects. Maps keyed by data (a completion's
# top_logprobs {token: logprob}, prompt_logprobs {id: ...}) are leaves.
LEAF_KEYS = {"prompt_logprobs", "kv_transfer_params", "ec_transfer_params", "metrics", "parameters", "arguments"}
PROMPT_LP_ATOL = 0.02  # float32 on both; different kernels and summation orders
FAMILY_PREFIXES = ("vllm:", "http_")


def compare_errors(a: Any, b: Any) -> list[tuple[str, str]]:
    """vLLM's error body ``a`` and ours ``b``: the keys at both levels, then
    ``type``, ``code`` and ``param`` exactly, and ``message`` (reported apart)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [("error_body", f"vllm {type(a).__name__}, pagedserve {type(b).__name__}")]
    out: list[tuple[str, str]] = []
    if set(a) != set(b):
        out.append(("error_keys", f"top: {sorted(a)} vs {sorted(b)}"))
    ea, eb = a.get("error"), b.get("error")
    if not isinstance(ea, dict) or not isinstance(eb, dict):
        return out + [("error_body", "no error object")] if ea != eb else out
    if set(ea) != set(eb):
        out.append(("error_keys", f"error: {sorted(ea)} vs {sorted(eb)}"))
    for f in ERROR_FIELDS:
        if ea.get(f) != eb.get(f):
            out.append((f"error_{f}", f"{ea.get(f)!r} vs {eb.get(f)!r}"))
    if ea.get("message") != eb.get("message"):
        out.append(("error_message", f"{str(ea.get('message'))[:160]!r} vs {str(eb.get('message'))[:160]!r}"))
    return out


def key_paths(obj: Any, prefix: str = "") -> set[str]:
    """Each key path in a body, ``[]`` for a list's items, with ``=null``
    where the value is null: {"a": {"b": None}} -> {"a", "a.b=null"}."""
    out: set[str] = set()
    if isinstance(obj, list):
        for item in obj:
            out |= key_paths(item, prefix + "[]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            out.add(path + "=null" if v is None else path)
            if k not in LEAF_KEYS and not (k == "top_logprobs" and isinstance(v, list)
                                           and any(isinstance(x, dict) and "token" not in x for x in v)):
                out |= key_paths(v, path)
    return out


def compare_keys(a_bodies: list[Any], b_bodies: list[Any]) -> list[tuple[str, str]]:
    """The key paths (null or set) of vLLM's bodies against ours: a stream's
    chunks are pooled. A key set in one and null in the other is ``null_field``."""
    pa = set().union(*(key_paths(x) for x in a_bodies)) if a_bodies else set()
    pb = set().union(*(key_paths(x) for x in b_bodies)) if b_bodies else set()
    out: list[tuple[str, str]] = []
    for path in sorted(pa - pb):
        bare = path.removesuffix("=null")
        if bare in pb or bare + "=null" in pb:
            if not path.endswith("=null"):
                continue  # reported once, from the null side
            out.append(("null_field", f"{bare}: null in vllm, set here"))
        else:
            out.append(("key_missing", bare))
    for path in sorted(pb - pa):
        bare = path.removesuffix("=null")
        if bare in pa or bare + "=null" in pa:
            if path.endswith("=null"):
                out.append(("null_field", f"{bare}: set in vllm, null here"))
        else:
            out.append(("key_extra", bare))
    return out


def _plp(entries: Any) -> list[dict[str, dict[str, Any]]] | None:
    if not isinstance(entries, list):
        return None
    return [{str(k): (v if isinstance(v, dict) else {"logprob": v}) for k, v in (e or {}).items()} for e in entries]


def compare_prompt_logprobs(a: Any, b: Any, where: str) -> list[tuple[str, str]]:
    """vLLM's ``prompt_logprobs`` list (null, then {id: {logprob, rank,
    decoded_token}} per prompt token) against ours: the ids, ranks and
    decoded tokens exactly, the logprobs within PROMPT_LP_ATOL."""
    pa, pb = _plp(a), _plp(b)
    if pa is None or pb is None:
        return [] if pa is pb else [("prompt_logprobs", f"{where}: vllm {pa is not None}, pagedserve {pb is not None}")]
    if len(pa) != len(pb):
        return [("prompt_logprobs", f"{where}: {len(pa)} vs {len(pb)} positions")]
    out: list[tuple[str, str]] = []
    for i, (x, y) in enumerate(zip(pa, pb)):
        if set(x) != set(y):
            out.append(("prompt_lp_ids", f"{where} position {i}: {sorted(x)} vs {sorted(y)}"))
            continue
        for k in x:
            if x[k].get("rank") != y[k].get("rank"):
                out.append(("prompt_lp_rank", f"{where} position {i} id {k}: {x[k].get('rank')} vs {y[k].get('rank')}"))
            if x[k].get("decoded_token") != y[k].get("decoded_token"):
                out.append(("prompt_lp_token", f"{where} position {i} id {k}: {x[k].get('decoded_token')!r} vs "
                                               f"{y[k].get('decoded_token')!r}"))
            la, lb = x[k].get("logprob"), y[k].get("logprob")
            if (la is None) != (lb is None) or (la is not None and lb is not None and abs(la - lb) > PROMPT_LP_ATOL):
                out.append(("prompt_lp_logprob", f"{where} position {i} id {k}: {la} vs {lb}"))
    return out


def prompt_logprobs_of(body: Any) -> dict[str, Any]:
    """Where a 200 body carries prompt_logprobs: {"top": ..., "choice 0": ...} (null ones left out)."""
    if not isinstance(body, dict):
        return {}
    out = {"top": body["prompt_logprobs"]} if body.get("prompt_logprobs") is not None else {}
    for c in body.get("choices") or []:
        if isinstance(c, dict) and c.get("prompt_logprobs") is not None:
            out[f"choice {c.get('index', 0)}"] = c["prompt_logprobs"]
    return out


TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def families(text: str) -> dict[str, str]:
    """Prometheus text: family name -> type, for vLLM's prefixes."""
    return {n: t for n, t in TYPE_LINE.findall(text) if n.startswith(FAMILY_PREFIXES)}


def compare_metrics(a_text: str, b_text: str) -> list[tuple[str, str]]:
    """vLLM's families after the load against ours: one it has that we lack
    is ``metric_missing``, a type that differs ``metric_type``, one only we
    export ``metric_extra``."""
    fa, fb = families(a_text), families(b_text)
    out = [("metric_missing", n) for n in sorted(set(fa) - set(fb))]
    out += [("metric_type", f"{n}: {fa[n]} vs {fb[n]}") for n in sorted(set(fa) & set(fb)) if fa[n] != fb[n]]
    out += [("metric_extra", n) for n in sorted(set(fb) - set(fa))]
    return out


def bodies_of(raw: dict[str, Any]) -> list[Any]:
    """The JSON objects of one answer: its body, or a stream's chunks."""
    if raw.get("chunks") is not None:
        return list(raw["chunks"])
    return [raw["body"]] if isinstance(raw.get("body"), dict) else []

