"""vLLM's request models are pydantic models in lax mode: a scalar field takes
a value that converts cleanly (``"max_tokens": "10"`` is 10, ``"echo": "true"``
is true, ``"n": 2.0`` is 2), and vLLM answers 200. The same conversions here,
before the body is read, for the int, float and bool fields of
``CompletionRequest`` / ``ChatCompletionRequest`` (their lists, read from
vLLM 0.32's models: the sampling ones from common/request_fields.py's table). A value that does not convert is left as it came, so the
field's own check refuses it (400) as vLLM does."""
from __future__ import annotations

import math
import re
from typing import Any

from pagedserve.common.request_fields import TABLE


def _table(kind: type) -> frozenset[str]:
    """The table's vLLM fields of one type, by their HTTP name (logprobs: per route, below)."""
    return frozenset(f.http_name for f in TABLE.values()
                     if f.type is kind and f.vllm and f.http_name is not None and f.name != "logprobs")


_INTS = _table(int) | {"priority", "routed_experts_prompt_start", "thinking_token_budget", "truncate_prompt_tokens"}
INT_FIELDS = {False: _INTS | {"logprobs"}, True: _INTS | {"max_completion_tokens", "top_logprobs"}}
FLOAT_FIELDS = _table(float)
_BOOLS = _table(bool) | {"add_special_tokens", "echo", "return_mm_kwargs", "return_token_ids",
                         "return_token_offsets", "return_tokens_as_token_ids", "skip_special_tokens",
                         "spaces_between_special_tokens", "stream", "use_beam_search", "watermarking"}
BOOL_FIELDS = {False: _BOOLS, True: _BOOLS | {"add_generation_prompt", "continue_final_message", "include_reasoning",
                                              "logprobs", "parallel_tool_calls", "return_prompt_text"}}
# pydantic's strings for booleans (case-insensitive, surrounding whitespace ignored)
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
_INT_TEXT = re.compile(r"^[+-]?\d+(_\d+)*(\.0*)?$")


def _as_int(v: Any) -> Any:
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    if isinstance(v, str) and _INT_TEXT.match(v.strip()):
        return int(v.strip().split(".")[0].replace("_", ""))
    return v


def _as_float(v: Any) -> Any:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            f = float(v.strip())
        except ValueError:
            return v
        return f if math.isfinite(f) else v  # a non-finite number goes to the field's own check as sent
    return v


def _as_bool(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        s = v.strip().lower()
        if s in _TRUE or s in _FALSE:
            return s in _TRUE
    return v


def lax(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """``body`` with its scalar fields converted as vLLM's pydantic models convert them."""
    out = dict(body)
    for key, value in body.items():
        if value is None:
            continue
        if key in INT_FIELDS[chat]:
            out[key] = _as_int(value)
        elif key in FLOAT_FIELDS:
            out[key] = _as_float(value)
        elif key in BOOL_FIELDS[chat]:
            out[key] = _as_bool(value)
    opts = body.get("stream_options")
    if isinstance(opts, dict):
        out["stream_options"] = {k: _as_bool(v) if k in ("include_usage", "continuous_usage_stats") else v
                                 for k, v in opts.items()}
    return out
