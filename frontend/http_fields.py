"""Body fields of vLLM's ``/tokenize`` and ``/detokenize`` (any other is a 400
naming it), and the readers of fields that carry token ids: every id must be
inside the vocabulary before it goes into the request message, whose uint32
fields would otherwise raise (2**40) or wrap. A field sent as null counts as
absent. The generation routes' fields are vLLM's (``openai_extras``).
"""
from __future__ import annotations

import re
from typing import Any

from pagedserve.frontend.errors import ApiError
from pagedserve.frontend.validation import MAX_LOGIT_BIAS, Limits, ValidationError, check_token_ids

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
    if len(value) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"{p}: at most {MAX_LOGIT_BIAS} entries, got {len(value)}", param=p)
    entries: dict[int, float] = {}
    for k, v in value.items():
        if not _ID_KEY.fullmatch(k):
            raise ApiError(400, f"{p}: keys must be token ids, got {k[:40]!r}", param=p)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ApiError(400, f"{p}: values must be numbers, got {type(v).__name__} for {k}", param=p)
        entries[int(k)] = float(v)
    check_ids(list(entries), limits, p)
    return entries
