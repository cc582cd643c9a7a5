"""Bounds for every field a client sends. A broken bound raises
``ValidationError`` naming the field and the bound; the gRPC server answers
INVALID_ARGUMENT, the HTTP gateway a 400 in the OpenAI error shape. The
sampling fields' bounds and defaults are common/request_fields.py's table;
``validate`` applies it to either protocol's decoded fields."""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.common import request_fields
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.request_fields import ValidationError
from pagedserve.v1 import generation_pb2 as pb

MAX_REQUEST_BYTES = 4 * 1024 * 1024  # one GenerateRequest, serialized
MAX_REQUEST_ID_LEN = 128
MAX_ABORT_IDS = 1024
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]+$")


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_prompt_chars: int = 1_000_000
    kv_slots: int | None = None  # token slots in the whole KV pool
    max_n: int = 16
    max_beam_width: int = 8
    max_stop_ids: int = 64


def check_request_id(rid: str, field: str = "request_id") -> None:
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise ValidationError(field, f"longer than {MAX_REQUEST_ID_LEN} characters")
    if rid and not _REQUEST_ID.match(rid):
        raise ValidationError(field, "only letters, digits and . _ : - are allowed")


MAX_CHAT_MESSAGES = 256
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


def check_request_size(req: pb.GenerateRequest) -> None:
    size = req.ByteSize()
    if size > MAX_REQUEST_BYTES:
        raise ValidationError("request", f"{size} bytes exceeds the limit of {MAX_REQUEST_BYTES} bytes")


def check_prompt_text(req: pb.GenerateRequest, limits: Limits) -> None:
    which = req.WhichOneof("input")
    if which is None:
        raise ValidationError("prompt", "one of prompt, prompt_token_ids or messages is required")
    if which == "prompt":
        check_text(req.prompt, limits, "prompt")
    elif which == "messages":
        msgs = req.messages.messages
        if not msgs or len(msgs) > MAX_CHAT_MESSAGES:
            raise ValidationError("messages", f"between 1 and {MAX_CHAT_MESSAGES} messages are required")
        for m in msgs:
            if m.role not in CHAT_ROLES:
                raise ValidationError("messages.role", f"must be one of {', '.join(sorted(CHAT_ROLES))}")
        if sum(len(m.content) for m in msgs) > limits.max_prompt_chars:
            raise ValidationError("messages", f"longer than {limits.max_prompt_chars} characters in all")


def check_text(text: str, limits: Limits, field: str) -> None:
    if not text:
        raise ValidationError(field, "must not be empty")
    if len(text) > limits.max_prompt_chars:
        raise ValidationError(field, f"longer than {limits.max_prompt_chars} characters")


def check_token_ids(ids: list[int] | tuple[int, ...], limits: Limits, field: str) -> None:
    # Negative ids cannot come over gRPC (uint32) but can from HTTP JSON or in-process callers.
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ValidationError(field, f"token id {bad} is outside the vocabulary (vocab_size={limits.vocab_size})")


def check_prompt_ids(ids: list[int], limits: Limits, field: str) -> None:
    if not ids:
        raise ValidationError(field, "must not be empty")
    if len(ids) >= limits.max_model_len:
        raise ValidationError(field, f"{len(ids)} tokens leaves no room to generate within "
                                     f"max_model_len={limits.max_model_len}")
    if limits.kv_slots is not None and len(ids) + 1 > limits.kv_slots:
        raise ValidationError(field, f"{len(ids)} tokens do not fit in the KV cache ({limits.kv_slots} token slots)")
    check_token_ids(ids, limits, field)


def check_cache_salt(salt: str) -> None:
    if salt:  # gRPC's empty string: no salt
        request_fields.check_field("cache_salt", salt, {})


@dataclass(frozen=True)
class Prepared:
    """A validated request: engine params plus what only the frontend acts on."""

    params: SamplingParams
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    detokenize: bool = True  # false: ids only, no text (vLLM's SamplingParams.detokenize)
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's default)
    spaces_between_special_tokens: bool = True


def limits_env(limits: Limits) -> dict[str, int]:
    """The limits a table bound may name (common/request_fields.py)."""
    return {"vocab_size": limits.vocab_size, "max_model_len": limits.max_model_len, "max_n": limits.max_n,
            "max_beam_width": limits.max_beam_width, "max_stop_ids": limits.max_stop_ids}


def _max_tokens(given: Mapping[str, Any], room: int, env: dict[str, int], prefix: str, route: str,
                fallback: int | None) -> int:
    """vLLM's get_max_tokens, on both protocols: the asked max_tokens (in its bound) or the
    route's default (``fallback``: the generation config's), lowered to the room the prompt leaves."""
    asked = given.get("max_tokens")
    if asked is None:
        d = fallback if fallback is not None else request_fields.default("max_tokens", route)
        return room if d is None else max(1, min(d, room))
    why = request_fields.check_value(request_fields.TABLE["max_tokens"], asked, env)
    if why is not None:
        raise ValidationError(prefix + "max_tokens", why)
    return int(min(asked, room))


def validate(given: Mapping[str, Any], prompt_len: int, limits: Limits, prefix: str = "sampling_params.",
             route: str = "grpc", default_max_tokens: int | None = None) -> Prepared:
    """The one validation of a request's sampling fields, for both protocols: ``given`` holds
    the fields the client sent (table names; ``structured_outputs`` as the proto message),
    decoded from gRPC (grpc_decode.sampling_values) or read from JSON (http_fields)."""
    env = limits_env(limits)
    room = limits.max_model_len - prompt_len
    v = request_fields.validate({**given, "max_tokens": _max_tokens(given, room, env, prefix, route,
                                                                     default_max_tokens)}, env, prefix)
    if v["top_k"] == -1 or v["top_k"] >= limits.vocab_size:
        v["top_k"] = 0  # vLLM's -1, and a k past the vocabulary: no top-k
    v["beam_width"] = max(1, v["beam_width"])
    if v["beam_width"] > 1 and v["n"] > v["beam_width"]:
        raise ValidationError(prefix + "n", f"{v['n']} exceeds beam_width={v['beam_width']} (n beams are returned)")
    if not v["detokenize"] and v["stop"]:
        raise ValidationError(prefix + "detokenize", "stop strings are matched on the text: they need detokenize")
    check_token_ids(list(v["logit_bias"]), limits, prefix + "logit_bias")
    from pagedserve.frontend.core.structured import check_combination, spec_from_proto  # imports this module

    so = given.get("structured_outputs")
    structured = None if so is None else spec_from_proto(so)
    check_combination(structured, v["beam_width"], v["ignore_eos"], v["min_tokens"])
    engine = {k: v[k] for k in request_fields.SAMPLING if k not in _FRONTEND_ONLY}
    params = SamplingParams(**{**engine, "stop_token_ids": tuple(v["stop_token_ids"]),
                               "logit_bias": dict(v["logit_bias"])}, structured=structured)
    return Prepared(params, tuple(v["stop"]), v["include_stop_str_in_output"], v["detokenize"])


_FRONTEND_ONLY = frozenset({"stop", "include_stop_str_in_output", "detokenize"})  # the frontend acts on these


def sampling_params(sp: pb.SamplingParams, prompt_len: int, limits: Limits) -> Prepared:
    """A gRPC request's sampling fields, validated."""
    from pagedserve.frontend.grpc_api.grpc_decode import sampling_values

    return validate(sampling_values(sp), prompt_len, limits)
