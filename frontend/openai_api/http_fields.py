"""Body fields of vLLM's ``/tokenize`` and ``/detokenize`` (any other is a 400
naming it), and the readers of fields that carry token ids: every id must be
inside the vocabulary before it goes into the request message, whose uint32
fields would otherwise raise (2**40) or wrap. A field sent as null counts as
absent. The generation routes' fields are vLLM's (``openai_extras``);
``sampling_values`` reads their sampling fields by the one table
(common/request_fields.py), for ``validation.validate``.
"""
from __future__ import annotations

import re
from typing import Any

from pagedserve.common.request_fields import INT64, MAX_SEED, SAMPLING, TABLE, check_type
from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.core.validation import Limits, ValidationError, check_token_ids

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """Raises ApiError(400) naming the first field (sorted) that is not understood."""
    unknown = sorted(k for k, v in body.items() if v is not None and k not in allowed)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not supported by pagedserve (unsupported fields: "
                            f"{', '.join(unknown[:8])})", param=unknown[0], code="unsupported_field")


def is_token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def check_ids(ids: list[int], limits: Limits, param: str) -> None:
    """400 naming ``param`` for an id outside [0, vocab_size)."""
    try:
        check_token_ids(ids, limits, param)
    except ValidationError as e:
        raise ApiError(400, str(e), param=param) from None


def token_ids(value: Any, limits: Limits, param: str) -> list[int]:
    """A list of token ids inside the vocabulary (``stop_token_ids``)."""
    if not isinstance(value, list) or not all(is_token_id(t) for t in value):
        raise ApiError(400, f"{param}: must be a list of token ids (integers)", param=param)
    check_ids(value, limits, param)
    return value


_ID_KEY = re.compile(r"-?[0-9]{1,20}")  # JSON object keys are strings; ASCII digits only (int() takes more)


def logit_bias(value: Any, limits: Limits) -> dict[int, float]:
    """OpenAI's ``{"token id": bias}``; the bias range is validation's."""
    p = "logit_bias"
    if not isinstance(value, dict):
        raise ApiError(400, f"{p}: must be an object of token id -> bias", param=p)
    most = TABLE[p].hi
    if isinstance(most, int) and len(value) > most:  # before reading them all
        raise ApiError(400, f"{p}: at most {most} entries, got {len(value)}", param=p)
    entries: dict[int, float] = {}
    for k, v in value.items():
        if not _ID_KEY.fullmatch(k):
            raise ApiError(400, f"{p}: keys must be token ids, got {k[:40]!r}", param=p)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ApiError(400, f"{p}: values must be numbers, got {type(v).__name__} for {k}", param=p)
        entries[int(k)] = float(v)
    check_ids(list(entries), limits, p)
    return entries


# Read by the routes themselves (max_tokens, the logprobs counts: openai_extras) or below by shape.
_BY_ROUTE = frozenset({"max_tokens", "logprobs", "prompt_logprobs", "stop", "stop_token_ids", "logit_bias"})


def _seed(v: Any) -> Any:
    """vLLM's int64 seed: -1 is none; another negative maps onto the table's [0, 2^63 - 1]."""
    if isinstance(v, int) and not isinstance(v, bool) and v < 0:
        if v < INT64[0]:
            raise ApiError(400, f"seed: must be in [{INT64[0]}, {INT64[1]}], got {v}", param="seed")
        return None if v == -1 else v % (MAX_SEED + 1)
    return v


def sampling_values(body: dict[str, Any], limits: Limits) -> dict[str, Any]:
    """The body's sampling fields as table names (type-checked; a bound is validate's)."""
    out: dict[str, Any] = {}
    for name in SAMPLING:
        f = TABLE[name]
        key = f.http_name
        if key is None or name in _BY_ROUTE or body.get(key) is None:
            continue
        value = _seed(body[key]) if name == "seed" else body[key]
        why = None if value is None else check_type(f, value)
        if why is not None:
            raise ApiError(400, f"{key}: {why}", param=key)
        if value is not None:
            out[name] = value
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ApiError(400, "stop: must be a string or a list of strings", param="stop")
        out["stop"] = stops
    if body.get("stop_token_ids") is not None:
        out["stop_token_ids"] = token_ids(body["stop_token_ids"], limits, "stop_token_ids")
    if body.get("logit_bias") is not None:
        out["logit_bias"] = logit_bias(body["logit_bias"], limits)
    if body.get("use_beam_search") and not out.get("beam_width"):
        out["beam_width"] = max(out.get("n", 1), 2)
    return out
