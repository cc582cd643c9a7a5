"""vLLM 0.32's request fields on ``/v1/completions`` and ``/v1/chat/completions``
(``CompletionRequest`` / ``ChatCompletionRequest`` in vllm/entrypoints/openai),
read with vLLM's meaning and refused where vLLM refuses (400, OpenAI shape).

A field outside vLLM's models is ignored and logged at debug level, as vLLM's
``OpenAIBaseModel`` (``extra="allow"``) does. A vLLM field we cannot honour
without engine support (``logprob_token_ids``, ``prompt_embeds``,
``repetition_detection``) is a 400 naming it rather than an answer that
silently differs. ``allowed_token_ids`` and ``bad_words`` reach the worker's
sampler (HTTP only: they are not in the gRPC API). Sampling fields proper
(``temperature``, ``top_k``, ...) are read by ``http_fields.sampling_values``
and bounded by the one table (common/request_fields.py), as over gRPC.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.request_fields import TABLE, check_type, check_value
from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.openai_api.openai_options import OpenAIOptions

log = logging.getLogger("pagedserve.frontend")

_COMMON = frozenset({
    "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "ec_transfer_params", "echo",
    "frequency_penalty", "ignore_eos", "include_stop_str_in_output", "kv_transfer_params", "length_penalty",
    "logit_bias", "logprob_token_ids", "logprobs", "max_tokens", "min_p", "min_tokens", "mm_payload", "model", "n",
    "presence_penalty", "priority", "prompt_logprobs", "repetition_detection", "repetition_penalty", "request_id",
    "response_format", "return_mm_kwargs", "return_token_ids", "return_token_offsets", "return_tokens_as_token_ids",
    "routed_experts_prompt_start", "seed", "session_id", "skip_special_tokens", "spaces_between_special_tokens",
    "stop", "stop_token_ids", "stream", "stream_interval", "stream_options", "structured_outputs", "temperature",
    "thinking_token_budget", "top_k", "top_p", "truncate_prompt_tokens", "truncation_side", "use_beam_search",
    "user", "vllm_xargs", "watermarking"})
VLLM_COMPLETION_FIELDS = _COMMON | {"prompt", "prompt_embeds", "suffix"}
VLLM_CHAT_FIELDS = _COMMON | {
    "add_generation_prompt", "chat_template", "chat_template_kwargs", "continue_final_message", "documents",
    "include_reasoning", "max_completion_tokens", "media_io_kwargs", "messages", "mm_processor_kwargs",
    "parallel_tool_calls", "reasoning_effort", "return_prompt_text", "tool_choice", "tools", "top_logprobs"}
# Not vLLM's, given a meaning here (docs/api.md): our beam search knobs, and the structured
# output code's guided_* (vLLM 0.32 ignores those; our structured-output code honours them).
OURS = frozenset({"beam_width", "early_stopping", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "guided_decoding_backend"})
# vLLM fields that need engine support we lack: refused unless at their default.
_NEEDS_ENGINE = {"logprob_token_ids": "logprobs of chosen token ids",
                 "prompt_embeds": "prompt embeddings", "repetition_detection": "repetition detection"}
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_INT64 = (-(2**63), 2**63 - 1)
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})  # vLLM refuses these in chat_template_kwargs


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, "must be true or false")
    return v


def _int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, "must be an integer")
    if not lo <= v <= hi:
        raise _bad(key, f"must be in [{lo}, {hi}], got {v}")
    return v


def _dict(body: dict[str, Any], key: str) -> dict[str, Any] | None:
    v = body.get(key)
    if v is not None and not isinstance(v, dict):
        raise _bad(key, "must be an object")
    return v


@dataclass(frozen=True)
class Extras:
    """What a request's vLLM extras ask of the gateway (the defaults are vLLM's)."""

    chat: bool
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every chunk (vLLM: only with include_usage)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    add_special_tokens: bool = True
    truncate: int | None = None  # truncate_prompt_tokens (-1: max_model_len - 1)
    truncate_left: bool = True  # vLLM's generation tokenizers truncate on the left (keep the last tokens)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    return_prompt_text: bool = False
    echo: bool = False
    request_id: str | None = None
    priority: int = 0  # accepted; there is no priority scheduling (first come, first served)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None  # completions: logprobs; chat: top_logprobs when logprobs is true
    prompt_logprobs: int | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()  # deduplicated, in order (vLLM's)


def _allowed_and_bad(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """vLLM's checks of allowed_token_ids (non-empty, inside the vocabulary) and bad_words (non-empty strings)."""
    ids = body.get("allowed_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise _bad("allowed_token_ids", "must be a list of integers")
        if not ids:
            raise _bad("allowed_token_ids", "allowed_token_ids is not None and empty!")
        if any(not 0 <= t < vocab_size for t in ids):
            raise _bad("allowed_token_ids", "allowed_token_ids contains out-of-vocab token id!")
    words = body.get("bad_words")
    if words is not None and (not isinstance(words, list) or not all(isinstance(w, str) for w in words)):
        raise _bad("bad_words", "must be a list of strings")
    words = list(dict.fromkeys(words or []))
    if any(not w for w in words):
        raise _bad("bad_words", f"bad_words cannot contain an empty string. Got bad_words={words}")
    return (None if ids is None else tuple(ids)), tuple(words)


def _unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    extra = sorted(k for k in body if k not in known and k not in OURS)
    if extra:  # as vLLM's OpenAIBaseModel: accepted, ignored, logged
        log.debug("The following fields were present in the request but ignored: %s", extra[:32])


def _refuse_engine_only(body: dict[str, Any]) -> None:
    for key, what in _NEEDS_ENGINE.items():
        v = body.get(key)
        if v is not None and v != [] and v != {}:
            raise ApiError(400, f"{key}: {what} is not supported by pagedserve", param=key, code="unsupported_field")


def _stream_usage(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise _bad("stream_options", "must be an object")
    if opts and not stream:
        raise _bad("stream_options", "Stream options can only be defined when `stream=True`.")
    include = _bool(opts, "include_usage", False)
    continuous = _bool(opts, "continuous_usage_stats", False)
    return include, include and continuous


def _logprob_count(body: dict[str, Any], key: str, opts: OpenAIOptions, vocab_size: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(key, "must be an integer")
    if v < 0 and v != -1:
        raise _bad(key, f"must be a positive value or -1, got {v}")
    asked = vocab_size if v == -1 else v
    if asked > opts.max_logprobs:
        raise _bad(key, f"Requested {key} of {asked}, which is greater than max allowed: {opts.max_logprobs}")
    return asked


def check_sampling(body: dict[str, Any]) -> None:
    """vLLM's refusals beyond the sampling fields' bounds (those are the table's,
    common/request_fields.py, checked by validation for both protocols)."""
    salt = body.get("cache_salt")
    if salt is not None:  # the table's bound (validation checks it again on the request, as gRPC's)
        why = check_type(TABLE["cache_salt"], salt) or check_value(TABLE["cache_salt"], salt, {})
        if why is not None:
            raise _bad("cache_salt", why)
    if body.get("use_beam_search") and body.get("stream") and not body.get("messages"):
        raise _bad("use_beam_search", "Streaming is not currently supported with beam search")


def greedy_n_check(n: int, temperature: float | None) -> None:
    """vLLM refuses several samples of a greedy (temperature 0) request: they would be equal."""
    if n > 1 and temperature is not None and temperature < 1e-5:
        raise _bad("n", f"n must be 1 when using greedy sampling, got {n}.")


def _template(body: dict[str, Any], opts: OpenAIOptions) -> tuple[str | None, dict[str, Any]]:
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise _bad("chat_template", "must be a string")
    kwargs = _dict(body, "chat_template_kwargs") or {}
    if (template is not None or kwargs.get("chat_template") is not None) and not opts.trust_request_chat_template:
        raise _bad("chat_template", "Chat template is passed with request, but --trust-request-chat-template "
                                    "is not set. Refused request with untrusted chat template.")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise _bad("chat_template_kwargs", f"Found unexpected chat template kwargs from request: {reserved}")
    docs = body.get("documents")
    if docs is not None and (not isinstance(docs, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in docs)):
        raise _bad("documents", "must be a list of objects of strings")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise _bad("reasoning_effort", f"must be one of {', '.join(_REASONING_EFFORTS)}")
    # vLLM's merge: the request's own fields (when set) override chat_template_kwargs.
    merged = dict(kwargs)
    for key in ("add_generation_prompt", "continue_final_message"):
        if body.get(key) is not None:
            merged[key] = body[key]
    if docs is not None:
        merged["documents"] = docs
    if effort is not None:
        merged["reasoning_effort"] = effort
        merged.setdefault("enable_thinking", effort != "none")
    return template, merged


def parse(body: dict[str, Any], chat: bool, opts: OpenAIOptions, vocab_size: int,
          header_request_id: str | None = None) -> Extras:
    """Reads and checks every vLLM extra of ``body`` (raises ApiError 400)."""
    _unknown(body, VLLM_CHAT_FIELDS if chat else VLLM_COMPLETION_FIELDS)
    _refuse_engine_only(body)
    check_sampling(body)
    stream = _bool(body, "stream", False)
    include_usage, continuous = _stream_usage(body, stream)
    for key in ("kv_transfer_params", "ec_transfer_params", "vllm_xargs", "media_io_kwargs", "mm_processor_kwargs"):
        _dict(body, key)  # accepted, no effect: no KV transfer, extensions or media here
    for key in ("watermarking", "include_reasoning", "return_token_offsets", "return_mm_kwargs"):
        _bool(body, key, False)
    _int(body, "stream_interval", 1, _INT64[1])
    _int(body, "routed_experts_prompt_start", 0, _INT64[1])
    _int(body, "thinking_token_budget", -1, _INT64[1])
    if body.get("mm_payload") not in (None, "tensors", "none"):
        raise _bad("mm_payload", "must be 'tensors' or 'none'")
    if body.get("session_id") is not None and not isinstance(body["session_id"], str):
        raise _bad("session_id", "must be a string")
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise _bad("request_id", "must be a string")
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise _bad("truncation_side", "`truncation_side` must be either 'left' or 'right'.")
    truncate = _int(body, "truncate_prompt_tokens", -1, _INT64[1])
    priority = _int(body, "priority", *_INT64) or 0
    allowed, bad_words = _allowed_and_bad(body, vocab_size)
    prompt_logprobs = _logprob_count(body, "prompt_logprobs", opts, vocab_size)
    if prompt_logprobs is not None and stream and body["prompt_logprobs"] != 0:
        raise _bad("prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")
    common: dict[str, Any] = dict(
        chat=chat, stream=stream, include_usage=include_usage, continuous_usage=continuous,
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        spaces_between_special_tokens=_bool(body, "spaces_between_special_tokens", True),
        add_special_tokens=_bool(body, "add_special_tokens", not chat),
        truncate=truncate, truncate_left=side != "right",
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False),
        return_token_ids=_bool(body, "return_token_ids", False),
        echo=_bool(body, "echo", False), request_id=header_request_id or rid, priority=priority,
        prompt_logprobs=prompt_logprobs, allowed_token_ids=allowed, bad_words=bad_words)
    if not chat:
        return Extras(logprobs=_logprob_count(body, "logprobs", opts, vocab_size), **common)
    if body.get("continue_final_message") and _bool(body, "add_generation_prompt", True):
        raise _bad("continue_final_message", "Cannot set both `continue_final_message` and "
                                             "`add_generation_prompt` to True.")
    want = _bool(body, "logprobs", False)
    top = _logprob_count(body, "top_logprobs", opts, vocab_size)
    if top and not want:
        raise _bad("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true.")
    template, kwargs = _template(body, opts)
    return Extras(add_generation_prompt=_bool(body, "add_generation_prompt", True),
                  continue_final_message=_bool(body, "continue_final_message", False),
                  chat_template=template, template_kwargs=kwargs,
                  return_prompt_text=_bool(body, "return_prompt_text", False),
                  logprobs=(top or 0) if want else None, **common)


def with_defaults(body: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """vLLM's precedence: the request's field, else the server's default (generation config),
    else the OpenAI default. Default stop_token_ids are added to the request's."""
    out = dict(body)
    for key, value in defaults.items():
        if key == "max_tokens":
            continue  # the routes read it: a fallback for an absent max_tokens
        if key == "stop_token_ids":
            mine = out.get("stop_token_ids") or []
            if isinstance(mine, list):
                out[key] = list(dict.fromkeys([*mine, *value]))
        elif out.get(key) is None:
            out[key] = value
    return out
