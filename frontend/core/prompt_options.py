"""The HTTP routes' options for ``GenerationService.prepare`` (vLLM's prompt
truncation, the sampling fields read from the body), and applying them to a
tokenized prompt; ``prepared_sampling`` validates either protocol's fields."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable

import msgspec

from pagedserve.frontend.grpc_api.grpc_decode import sampling_values
from pagedserve.frontend.core.validation import Limits, Prepared, ValidationError, validate
from pagedserve.v1 import generation_pb2 as pb

MAX_BAD_WORDS = 128  # vLLM's VLLM_MAX_NUM_BAD_WORDS default


@dataclass(frozen=True)
class InputOptions:
    """What the HTTP routes ask of ``prepare`` beyond the proto request (vLLM's extras)."""

    add_special_tokens: bool = True
    truncate: int | None = None  # keep this many prompt tokens (truncate_prompt_tokens; -1: max_model_len - 1)
    truncate_left: bool = True  # keep the last ones (vLLM's side for generation)
    # The body's sampling fields (http_fields.sampling_values), in place of the proto's
    # sampling_params; None: the request's own (gRPC).
    sampling: Mapping[str, Any] | None = None
    route: str = "grpc"  # whose max_tokens default applies (common/request_fields.py)
    default_max_tokens: int | None = None  # the generation config's, over the route's
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's, checked (openai_extras)
    bad_words: tuple[str, ...] = ()  # vLLM's, tokenized by the gateway into SamplingParams.bad_words_token_ids


def truncation(opt: InputOptions, limits: Limits) -> int | None:
    if opt.truncate is None:
        return None
    if opt.truncate > limits.max_model_len:
        raise ValidationError("truncate_prompt_tokens", f"truncate_prompt_tokens={opt.truncate} cannot be greater "
                                                        f"than max_model_len = {limits.max_model_len}. Please request "
                                                        "a smaller truncation size.")
    return limits.max_model_len - 1 if opt.truncate < 0 else opt.truncate


def prepared_sampling(sp: pb.SamplingParams, opt: InputOptions, prompt_len: int, limits: Limits) -> Prepared:
    """The one validation (validation.validate) of the HTTP body's fields or the gRPC request's."""
    if opt.sampling is None:
        return validate(sampling_values(sp), prompt_len, limits, route=opt.route,
                        default_max_tokens=opt.default_max_tokens)
    return validate(opt.sampling, prompt_len, limits, prefix="", route=opt.route,
                    default_max_tokens=opt.default_max_tokens)


def bad_words_token_ids(words: tuple[str, ...], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """vLLM's SamplingParams.update_from_tokenizer: each word as it starts the text
    (leading spaces dropped) and, when that makes a new first token of the same
    length, with one leading space (the word inside the text)."""
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = encode(prefix + word.lstrip())
            if not ids:
                if not prefix:
                    raise ValidationError("bad_words", "bad_words entries must tokenize to at least one token.")
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
                if len(out) > MAX_BAD_WORDS:
                    raise ValidationError("bad_words", f"Too many bad words after tokenization: {len(out)}. "
                                                       f"The max number is {MAX_BAD_WORDS}.")
    return tuple(tuple(w) for w in out)


def with_sampler_extras(prepared: Any, opt: InputOptions | None, encode: Callable[[str], list[int]]) -> Any:
    """A prepared request (generation.PreparedRequest) with the options' allowed_token_ids and
    bad_words in its engine params (they have no proto field: the HTTP routes add them here)."""
    if opt is None or (opt.allowed_token_ids is None and not opt.bad_words):
        return prepared
    params = msgspec.structs.replace(prepared.prep.params, allowed_token_ids=opt.allowed_token_ids,
                                     bad_words_token_ids=bad_words_token_ids(opt.bad_words, encode))
    return replace(prepared, prep=replace(prepared.prep, params=params))
