"""Bounds for every field a client sends. A broken bound raises
``ValidationError`` naming the field; the server answers INVALID_ARGUMENT."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from pagedserve.common.messages.types import SamplingParams
from pagedserve.v1 import generation_pb2 as pb

DEFAULT_MAX_TOKENS = 256
MAX_REQUEST_ID_LEN = 128
MAX_STOP_TOKEN_IDS = 64
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]+$")


class ValidationError(ValueError):
    pass


class UnimplementedError(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_prompt_chars: int = 1_000_000
    kv_slots: int | None = None  # token slots in the whole KV pool


def check_request_id(rid: str) -> None:
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise ValidationError(f"request_id: longer than {MAX_REQUEST_ID_LEN} characters")
    if rid and not _REQUEST_ID.match(rid):
        raise ValidationError("request_id: only letters, digits and . _ : - are allowed")


def check_prompt_text(req: pb.GenerateRequest, limits: Limits) -> None:
    which = req.WhichOneof("input")
    if which is None:
        raise ValidationError("prompt: one of prompt or prompt_token_ids is required")
    if which == "prompt":
        if not req.prompt:
            raise ValidationError("prompt: must not be empty")
        if len(req.prompt) > limits.max_prompt_chars:
            raise ValidationError(f"prompt: longer than {limits.max_prompt_chars} characters")


def check_prompt_ids(ids: list[int], limits: Limits, field: str) -> None:
    if not ids:
        raise ValidationError(f"{field}: must not be empty")
    if len(ids) >= limits.max_model_len:
        raise ValidationError(f"{field}: {len(ids)} tokens leaves no room to generate within "
                              f"max_model_len={limits.max_model_len}")
    if limits.kv_slots is not None and len(ids) + 1 > limits.kv_slots:
        raise ValidationError(f"{field}: {len(ids)} tokens do not fit in the KV cache ({limits.kv_slots} token slots)")
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise ValidationError(f"{field}: token id {bad} is outside the vocabulary (vocab_size={limits.vocab_size})")


def sampling_params(sp: pb.SamplingParams, prompt_len: int, limits: Limits) -> SamplingParams:
    room = limits.max_model_len - prompt_len
    if sp.HasField("max_tokens"):
        if sp.max_tokens == 0:
            raise ValidationError("sampling_params.max_tokens: must be at least 1")
        if sp.max_tokens > room:
            raise ValidationError(f"sampling_params.max_tokens: {sp.max_tokens} plus the prompt's {prompt_len} "
                                  f"tokens exceeds max_model_len={limits.max_model_len}")
        max_tokens = sp.max_tokens
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    temperature = sp.temperature if sp.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0 or temperature > MAX_TEMPERATURE:
        raise ValidationError(f"sampling_params.temperature: must be in [0, {MAX_TEMPERATURE}], got {temperature}")
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    if not math.isfinite(top_p) or not 0 < top_p <= 1:
        raise ValidationError(f"sampling_params.top_p: must be in (0, 1], got {top_p}")
    if sp.top_k < 0 or sp.top_k > limits.vocab_size:
        raise ValidationError(f"sampling_params.top_k: must be in [0, {limits.vocab_size}], got {sp.top_k}")
    n = sp.n if sp.HasField("n") else 1
    if n != 1:
        raise UnimplementedError("sampling_params.n: only n=1 is supported so far")
    if sp.stop:
        raise UnimplementedError("sampling_params.stop: stop strings are not supported yet; use stop_token_ids")
    if sp.min_tokens > max_tokens:
        raise ValidationError(f"sampling_params.min_tokens: {sp.min_tokens} exceeds max_tokens={max_tokens}")
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValidationError(f"sampling_params.stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids")
    bad = next((t for t in sp.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise ValidationError(f"sampling_params.stop_token_ids: token id {bad} is outside the vocabulary "
                              f"(vocab_size={limits.vocab_size})")
    seed = sp.seed if sp.HasField("seed") else None
    if seed is not None and seed > MAX_SEED:
        raise ValidationError(f"sampling_params.seed: must be at most {MAX_SEED}")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=sp.top_k,
                          seed=seed, n=n, min_tokens=sp.min_tokens, stop_token_ids=tuple(sp.stop_token_ids),
                          ignore_eos=sp.ignore_eos)
