"""Bounds for every field a client sends. A broken bound raises
``ValidationError`` naming the field and the bound; the gRPC server answers
INVALID_ARGUMENT, the HTTP gateway a 400 in the OpenAI error shape."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pagedserve.common.bounds import (MAX_ABS_LENGTH_PENALTY, MAX_ABS_PENALTY, MAX_LOGPROBS,  # noqa: F401 - re-exported
                                       MAX_REPETITION_PENALTY, MAX_SEED, MAX_TEMPERATURE, MIN_POSITIVE)
from pagedserve.common.messages.types import SamplingParams
from pagedserve.v1 import generation_pb2 as pb

# The request defaults, in one place: vLLM's 256 for gRPC and chat, OpenAI's
# 16 for /v1/completions. (SamplingParams.max_tokens's own default only
# serves in-process callers: the frontend always sets the field.)
DEFAULT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_REQUEST_BYTES = 4 * 1024 * 1024  # one GenerateRequest, serialized
MAX_REQUEST_ID_LEN = 128
MAX_CACHE_SALT_LEN = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABORT_IDS = 1024
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]+$")


class ValidationError(ValueError):
    """A bound was broken; ``field`` names it (dotted, as in the proto)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


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
    if len(salt) > MAX_CACHE_SALT_LEN:
        raise ValidationError("cache_salt", f"longer than {MAX_CACHE_SALT_LEN} characters")


def _finite_in(value: float, lo: float, hi: float, field: str, lo_open: bool = False) -> None:
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        raise ValidationError(field, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")


@dataclass(frozen=True)
class Prepared:
    """A validated request: engine params plus what only the frontend acts on."""

    params: SamplingParams
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    detokenize: bool = True  # false: ids only, no text (vLLM's SamplingParams.detokenize)
    skip_special_tokens: bool = True  # the text leaves special tokens out (vLLM's default)
    spaces_between_special_tokens: bool = True


def sampling_params(sp: pb.SamplingParams, prompt_len: int, limits: Limits) -> Prepared:
    f = "sampling_params."
    room = limits.max_model_len - prompt_len
    if sp.HasField("max_tokens"):
        if sp.max_tokens == 0:
            raise ValidationError(f + "max_tokens", "must be at least 1")
        if sp.max_tokens > room:
            raise ValidationError(f + "max_tokens", f"{sp.max_tokens} plus the prompt's {prompt_len} tokens "
                                                    f"exceeds max_model_len={limits.max_model_len}")
        max_tokens = sp.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    _finite_in(temperature, 0.0, MAX_TEMPERATURE, f + "temperature")
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    _finite_in(top_p, MIN_POSITIVE, 1.0, f + "top_p")
    if sp.top_k < 0 or sp.top_k > limits.vocab_size:
        raise ValidationError(f + "top_k", f"must be in [0, {limits.vocab_size}], got {sp.top_k}")
    _finite_in(sp.min_p, 0.0, 1.0, f + "min_p")
    seed = sp.seed if sp.HasField("seed") else None
    if seed is not None and seed > MAX_SEED:
        raise ValidationError(f + "seed", f"must be at most {MAX_SEED}")
    n = sp.n if sp.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise ValidationError(f + "n", f"must be in [1, {limits.max_n}], got {n}")
    beam_width = max(1, sp.beam_width)
    if beam_width > limits.max_beam_width:
        raise ValidationError(f + "beam_width", f"must be at most {limits.max_beam_width}, got {beam_width}")
    if beam_width > 1 and n > beam_width:
        raise ValidationError(f + "n", f"{n} exceeds beam_width={beam_width} (n beams are returned)")
    length_penalty = sp.length_penalty if sp.HasField("length_penalty") else 1.0
    _finite_in(length_penalty, -MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY, f + "length_penalty")
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise ValidationError(f + "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(sp.stop)}")
    for s in sp.stop:
        if not s or len(s) > MAX_STOP_STRING_LEN:
            raise ValidationError(f + "stop", f"each stop string must have 1 to {MAX_STOP_STRING_LEN} characters")
    detokenize = sp.detokenize if sp.HasField("detokenize") else True
    if not detokenize and sp.stop:
        raise ValidationError(f + "detokenize", "stop strings are matched on the text: they need detokenize")
    if sp.min_tokens > max_tokens:
        raise ValidationError(f + "min_tokens", f"{sp.min_tokens} exceeds max_tokens={max_tokens}")
    if len(sp.stop_token_ids) > limits.max_stop_ids:
        raise ValidationError(f + "stop_token_ids", f"at most {limits.max_stop_ids} ids, got {len(sp.stop_token_ids)}")
    check_token_ids(sp.stop_token_ids, limits, f + "stop_token_ids")
    repetition_penalty = sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0
    _finite_in(repetition_penalty, MIN_POSITIVE, MAX_REPETITION_PENALTY, f + "repetition_penalty")
    _finite_in(sp.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, f + "presence_penalty")
    _finite_in(sp.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY, f + "frequency_penalty")
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        raise ValidationError(f + "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(sp.logit_bias)}")
    check_token_ids(list(sp.logit_bias), limits, f + "logit_bias")
    for v in sp.logit_bias.values():
        _finite_in(v, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS, f + "logit_bias")
    logprobs = sp.logprobs if sp.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise ValidationError(f + "logprobs", f"must be at most {MAX_LOGPROBS}, got {logprobs}")
    prompt_logprobs = sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > MAX_LOGPROBS:
        raise ValidationError(f + "prompt_logprobs", f"must be at most {MAX_LOGPROBS}, got {prompt_logprobs}")
    from pagedserve.frontend.structured import check_combination, spec_from_proto  # imports this module

    structured = spec_from_proto(sp.structured_outputs) if sp.HasField("structured_outputs") else None
    check_combination(structured, beam_width, sp.ignore_eos, sp.min_tokens)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=sp.top_k, min_p=sp.min_p, seed=seed,
        n=n, min_tokens=sp.min_tokens, stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        repetition_penalty=repetition_penalty, presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty, logit_bias=dict(sp.logit_bias), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, beam_width=beam_width, length_penalty=length_penalty,
        early_stopping=sp.early_stopping, structured=structured)
    return Prepared(params, tuple(sp.stop), sp.include_stop_str_in_output, detokenize)
