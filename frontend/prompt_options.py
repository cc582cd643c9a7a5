"""The HTTP routes' options for ``GenerationService.prepare`` (vLLM's prompt
truncation and max_tokens rule), and applying them to a tokenized prompt."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.frontend.validation import Limits, ValidationError
from pagedserve.v1 import generation_pb2 as pb


@dataclass(frozen=True)
class InputOptions:
    """What the HTTP routes ask of ``prepare`` beyond the proto request (vLLM's extras)."""

    add_special_tokens: bool = True
    truncate: int | None = None  # keep this many prompt tokens (truncate_prompt_tokens; -1: max_model_len - 1)
    truncate_left: bool = True  # keep the last ones (vLLM's side for generation)
    # vLLM lowers a max_tokens the prompt leaves no room for (at most max_model_len) to the room
    # left, and an absent one is that room; the gRPC API refuses / uses 256 instead.
    clamp_max_tokens: bool = False
    default_max_tokens: int | None = None  # before the clamp (the generation config's max_tokens)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


def truncation(opt: InputOptions, limits: Limits) -> int | None:
    if opt.truncate is None:
        return None
    if opt.truncate > limits.max_model_len:
        raise ValidationError("truncate_prompt_tokens", f"truncate_prompt_tokens={opt.truncate} cannot be greater "
                                                        f"than max_model_len = {limits.max_model_len}. Please request "
                                                        "a smaller truncation size.")
    return limits.max_model_len - 1 if opt.truncate < 0 else opt.truncate


def clamp_max_tokens(sp: pb.SamplingParams, prompt_len: int, limits: Limits, default: int | None) -> None:
    """vLLM's get_max_tokens: the asked (or default) max_tokens, at most the room the prompt leaves."""
    room = limits.max_model_len - prompt_len
    if sp.HasField("max_tokens"):
        if sp.max_tokens > limits.max_model_len:
            raise ValidationError("sampling_params.max_tokens", f"max_tokens={sp.max_tokens} cannot be greater "
                                                                f"than max_model_len={limits.max_model_len}")
        sp.max_tokens = min(sp.max_tokens, room) if room > 0 else sp.max_tokens
    else:
        sp.max_tokens = max(1, min(room, default) if default is not None else room)
