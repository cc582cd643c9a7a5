"""The request's fields (the sampling ones and cache_salt), in one table: per field its type, default,
bound, its vLLM/OpenAI name and whose bound it is. Everything else is derived
from ``TABLE`` at call time: the frontend's ``validate`` (both protocols: the
gRPC decoder and the HTTP parser only turn their wire into a dict of given
values), the scheduler's admission (``violation``), the HTTP lax-coercion
field lists, ``SamplingParams``' defaults and the field list in docs/api.md
(``render_markdown``; ``python -m pagedserve.common.request_fields`` prints it).

A bound is a number, or the name of a limit (``vocab_size``, ``max_model_len``,
``max_n``, ``max_beam_width``, ``max_stop_ids``: the server's) or of an
earlier field (``min_tokens`` <= ``max_tokens``). Where vLLM 0.32 and we
differed, each field says which one both protocols now use (``source``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# top_p and repetition_penalty must be > 0; below this floor they are refused. A power of two, so the
# proto's float32 carries it exactly (the same verdict as JSON's double), and far above float32's
# smallest values, which the worker's float32 tensors would round to 0 (a top_p of 0 masks every token).
MIN_POSITIVE = 2.0**-30
INT32_MAX = 2**31 - 1  # top_k is a proto int32
MAX_SEED = 2**63 - 1
INT64 = (-(2**63), 2**63 - 1)  # vLLM's seed type over HTTP (negatives: HTTP spellings, below)

Bound = int | float | str | None


class ValidationError(ValueError):
    """A bound was broken; ``field`` names it (dotted, as in the proto)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Field:
    name: str  # SamplingParams' and the gRPC proto's name
    type: type  # int, float, bool; list/dict: ``hi`` bounds the entry count, ``item_*`` each entry
    default: Any
    lo: Bound = None
    hi: Bound = None
    lo_open: bool = False
    hi_open: bool = False
    openai: str | None = ""  # the vLLM/OpenAI body key: "" the same name, None not on HTTP
    vllm: bool = True  # a field of vLLM 0.32's request models (HTTP lax-coerces only those)
    source: str = "vLLM"  # whose bound both protocols use: "vLLM" (0.32's) or "ours: why"
    item_lo: Bound = None
    item_hi: Bound = None
    item_hi_open: bool = False
    forbidden: str = ""  # str fields: characters refused
    level: str = "sampling"  # "sampling": in SamplingParams; "request": on the request itself (GenerateRequest)
    # Per-route defaults where the protocols' own defaults differ (gRPC, completions, chat).
    route_defaults: Mapping[str, Any] = field(default_factory=dict)
    doc: str = ""

    @property
    def http_name(self) -> str | None:
        return self.name if self.openai == "" else self.openai


def _f(*fields: Field) -> dict[str, Field]:
    return {f.name: f for f in fields}


TABLE: dict[str, Field] = _f(
    # 16: OpenAI's and vLLM's for completions, and SamplingParams' own; gRPC and chat differ.
    Field("max_tokens", int, 16, 1, "max_model_len", route_defaults={"grpc": 256, "chat": None},
          doc="past the room the prompt leaves: lowered to it; absent: the route's default (chat: the "
              "generation config's max_new_tokens, else the room left), lowered to the room; chat also reads "
              "`max_completion_tokens`"),
    Field("temperature", float, 1.0, 0.0, 2.0, doc="0 = greedy"),
    Field("top_p", float, 1.0, MIN_POSITIVE, 1.0, source="vLLM's (0, 1], with a floor of 2^-30"),
    Field("top_k", int, 0, -1, INT32_MAX, source="vLLM, capped at int32 (the proto's type)",
          doc="-1 or 0: off; a k past the vocabulary is off too"),
    Field("min_p", float, 0.0, 0.0, 1.0, doc="0: off"),
    Field("seed", int, None, 0, MAX_SEED,
          doc="HTTP also takes vLLM's int64: -1 is no seed, another negative seed s is s mod 2^63"),
    Field("n", int, 1, 1, "max_n", source="ours: --max-n (default 16)"),
    Field("min_tokens", int, 0, 0, "max_tokens"),
    Field("stop", list, (), None, 16, item_lo=1, item_hi=256, source="ours: vLLM has no count or length bound",
          doc="a string or a list of strings, each of 1..256 characters"),
    Field("stop_token_ids", list, (), None, "max_stop_ids", item_lo=0, item_hi="vocab_size", item_hi_open=True,
          source="ours: the server's max_stop_ids (default 64)", doc="ids inside the vocabulary"),
    Field("include_stop_str_in_output", bool, False, source=""),
    Field("ignore_eos", bool, False, source=""),
    Field("repetition_penalty", float, 1.0, MIN_POSITIVE, 10.0,
          source="ours: vLLM takes any finite value > 0 (the floor as top_p's)", doc="1.0: off"),
    Field("presence_penalty", float, 0.0, -2.0, 2.0),
    Field("frequency_penalty", float, 0.0, -2.0, 2.0),
    Field("logit_bias", dict, {}, None, 300, item_lo=-100.0, item_hi=100.0,
          source="ours: vLLM clamps values into [-100, 100], we refuse", doc="token id -> bias; ids in the vocabulary"),
    Field("logprobs", int, None, 0, 20,
          source="ours: the engine returns at most 20; HTTP also applies --max-logprobs",
          doc="the sampled token's logprob plus the top k; chat: `top_logprobs` with `logprobs: true`; "
              "HTTP -1 is the vocabulary size"),
    Field("prompt_logprobs", int, None, 0, 20, source="ours: as logprobs",
          doc="every prompt token's (but the first); bypasses the prefix cache"),
    Field("beam_width", int, 1, 0, "max_beam_width", vllm=False,
          source="ours: --max-beam-width (default 8); HTTP's use_beam_search is max(n, 2) beams",
          doc="0 or 1: off; `n` <= `beam_width`"),
    Field("length_penalty", float, 1.0, -10.0, 10.0, source="ours: vLLM has no bound"),
    Field("early_stopping", bool, False, vllm=False, source="", doc="ours (beam search)"),
    Field("detokenize", bool, True, openai=None, source="", doc="false: token ids only; not with `stop`"),
    Field("cache_salt", str, None, 1, 128, forbidden="@/\\\x00", level="request",
          doc="none of `@ / \\` or NUL; requests share prefix-cache blocks only with the same salt; "
              "gRPC's empty string is no salt"),
)
SAMPLING = tuple(name for name, f in TABLE.items() if f.level == "sampling")

SCALARS = (int, float, bool)


def default(name: str, route: str | None = None) -> Any:
    """The field's default, or its route's (``grpc``, ``completions``, ``chat``) where that differs."""
    f = TABLE[name]
    return f.route_defaults[route] if route in f.route_defaults else f.default


def _resolve(b: Bound, env: Mapping[str, Any]) -> int | float | None:
    return env[b] if isinstance(b, str) else b


def _shown(b: Bound, value: Any) -> str:
    """A bound in a message: a named one with its value (``max_model_len=512``)."""
    return f"{b}={value}" if isinstance(b, str) else str(value)


def _range(lo: Any, hi: Any, lo_open: bool, hi_open: bool) -> str:
    return f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"


def check_value(f: Field, value: Any, env: Mapping[str, Any]) -> str | None:
    """Why ``value`` breaks ``f``'s bound (``env``: limits and earlier fields), or None."""
    lo, hi = _resolve(f.lo, env), _resolve(f.hi, env)
    if f.type is str:
        if not lo <= len(value) <= hi:
            return f"must have {lo} to {hi} characters, got {len(value)}"
        bad = sorted({c for c in value if c in f.forbidden})
        return f"must not contain {' '.join(repr(c) for c in bad)}" if bad else None
    if f.type in (list, dict):
        if hi is not None and len(value) > hi:
            return f"at most {_shown(f.hi, hi)} entries, got {len(value)}"
        ilo, ihi = _resolve(f.item_lo, env), _resolve(f.item_hi, env)
        for item in (value.values() if f.type is dict else value):
            size = len(item) if isinstance(item, str) else item
            if f.item_hi == "vocab_size" and not 0 <= size < ihi:
                return f"token id {item} is outside the vocabulary (vocab_size={ihi})"
            if isinstance(item, str) and not ilo <= size <= ihi:
                return f"each entry must have {ilo} to {ihi} characters, got {size}"
            if not (math.isfinite(size) and size >= ilo and (size < ihi if f.item_hi_open else size <= ihi)):
                return f"each entry must be in {_range(ilo, ihi, False, f.item_hi_open)}, got {item!r:.80}"
        return None
    if f.type is bool or value is None:
        return None
    if f.type is float:
        lo = None if lo is None else float(lo)
        hi = None if hi is None else float(hi)
    ok = math.isfinite(value) and (lo is None or (value > lo if f.lo_open else value >= lo)) \
        and (hi is None or (value < hi if f.hi_open else value <= hi))
    return None if ok else f"must be in {_range(_shown(f.lo, lo), _shown(f.hi, hi), f.lo_open, f.hi_open)}, got {value}"


def check_type(f: Field, value: Any) -> str | None:
    """Why ``value`` (from JSON) is not of ``f``'s type, or None (HTTP; gRPC's are typed)."""
    if f.type is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if f.type is str:
        return None if isinstance(value, str) else "must be a string"
    if isinstance(value, bool):
        return "must be an integer" if f.type is int else "must be a number"
    if f.type is int and not isinstance(value, int):
        return "must be an integer"
    if f.type is float and not isinstance(value, (int, float)):
        return "must be a number"
    return None


def validate(given: Mapping[str, Any], limits: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every table field's value (given, else its default), each checked against
    its bound in table order (so a bound may name an earlier field); raises
    ``ValidationError`` naming ``prefix + name``. ``max_tokens`` must be given."""
    env = dict(limits)
    out: dict[str, Any] = {}
    for name, f in TABLE.items():
        if f.level != "sampling":
            continue
        value = given.get(name, f.default)
        if value is None and name == "max_tokens":
            raise ValidationError(prefix + name, "required")
        why = None if value is None else check_value(f, value, env)
        if why is not None:
            raise ValidationError(prefix + name, why)
        if f.type is float and value is not None:
            value = float(value)  # JSON's 1 is the engine's 1.0
        out[name] = env[name] = value
    return out


def check_field(name: str, value: Any, limits: Mapping[str, Any], prefix: str = "") -> None:
    """One field on its own (the request-level ones: ``cache_salt``); raises ValidationError."""
    why = check_value(TABLE[name], value, limits)
    if why is not None:
        raise ValidationError(prefix + name, why)


def violation(values: Mapping[str, Any], limits: Mapping[str, Any]) -> str | None:
    """The scheduler's admission: the first field of ``values`` (engine form) out of its bound, or None."""
    env = dict(limits)
    for name, f in TABLE.items():
        if name not in values:
            continue
        value = values[name]
        why = None if value is None else check_value(f, value, env)
        if why is not None:
            return f"{name}: {why}"
        env[name] = value
    return None


# ------------------------------------------------------------------ docs
def _bound_text(f: Field) -> str:
    def show(b: Bound) -> str:
        if isinstance(b, str):
            return f"`{b}`"
        if b == MAX_SEED:
            return "2^63 - 1"
        if b == INT32_MAX:
            return "2^31 - 1"
        if b == MIN_POSITIVE:
            return "2^-30"
        return f"{b:g}" if isinstance(b, float) else str(b)

    if f.type is bool:
        return ""
    if f.type is str:
        return f"{show(f.lo)} .. {show(f.hi)} characters"
    if f.type in (list, dict):
        item = _range(show(f.item_lo), show(f.item_hi), False, f.item_hi_open)
        what = "characters each" if f.type is list and f.name == "stop" else "each"
        return f"<= {show(f.hi)} entries, {item} {what}"
    return _range(show(f.lo), show(f.hi), f.lo_open, f.hi_open)


def _default_text(f: Field) -> str:
    d = f.default
    if f.route_defaults:
        names = {"grpc": "gRPC", "completions": "completions", "chat": "chat"}
        routes = ", ".join(f"{names.get(k, k)} {'room left' if v is None else v}" for k, v in f.route_defaults.items())
        return f"{d} ({routes})"
    return "none" if d is None or d == () or d == {} else str(d).lower() if isinstance(d, bool) else str(d)


def render_markdown() -> str:
    """The docs' field list (docs/api.md, between the request-fields markers)."""
    rows = ["| field | vLLM/OpenAI name | type | default | bound | whose bound | notes |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in TABLE.values():
        http = "(gRPC only)" if f.http_name is None else f"`{f.http_name}`"
        rows.append(f"| `{f.name}` | {http} | {f.type.__name__} | {_default_text(f)} | {_bound_text(f)} | "
                    f"{f.source} | {f.doc} |")
    return "\n".join(rows) + "\n"


def write_docs(path: str) -> None:
    """Rewrites the field list between the request-fields markers of ``path`` (docs/api.md)."""
    with open(path) as f:
        text = f.read()
    start, end = "<!-- request-fields:start -->\n", "<!-- request-fields:end -->"
    a, b = text.index(start) + len(start), text.index(end)
    with open(path, "w") as f:
        f.write(text[:a] + render_markdown() + text[b:])


if __name__ == "__main__":  # python -m pagedserve.common.request_fields [--write docs/api.md]
    import sys

    if sys.argv[1:2] == ["--write"]:
        write_docs(sys.argv[2])
    else:
        print(render_markdown(), end="")
