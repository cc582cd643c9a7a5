"""The scheduler's own check of an ``AddRequest``.

The frontend validates every field against the documented bounds; this is
the engine's boundary: whatever reaches the scheduler socket (a bug, or a
stray peer) must not make the worker fail a step that holds other users'
requests. So the fields a step depends on are checked again, cheaply, and a
request that breaks one is refused with an error delta of its own.
"""
from __future__ import annotations

import math

from pagedserve.common.bounds import (MAX_ABS_LENGTH_PENALTY, MAX_ABS_PENALTY, MAX_LOGPROBS, MAX_REPETITION_PENALTY,
                                       MAX_SEED, MAX_TEMPERATURE, MIN_POSITIVE)
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import ModelInfo

MAX_N = 256  # far above the frontend's caps; bounds per-request work only
MAX_ID_LEN = 1024


def _finite_in(x: float, lo: float, hi: float) -> bool:
    return math.isfinite(x) and lo <= x <= hi


def check_add(req: AddRequest, model: ModelInfo) -> str | None:
    """None when the scheduler can run ``req``; otherwise why not."""
    p = req.params
    vocab = model.vocab_size
    if not req.request_id or len(req.request_id) > MAX_ID_LEN:
        return "request_id: empty or too long"
    if req.cache_salt is not None and len(req.cache_salt) > MAX_ID_LEN:
        return "cache_salt: too long"
    ids = req.prompt_token_ids
    if not ids or len(ids) >= model.max_model_len:
        return f"prompt: {len(ids)} tokens; must be 1 .. {model.max_model_len - 1}"
    if min(ids) < 0 or max(ids) >= vocab:
        return f"prompt: token ids must be in [0, {vocab})"
    if not 0 <= req.num_output_tokens < len(ids) or (req.num_output_tokens and (p.n > 1 or p.beam_width > 1)):
        return "num_output_tokens: out of range (resuming needs n = 1 and no beam search)"
    if p.max_tokens < 1 or not 0 <= p.min_tokens <= p.max_tokens:
        return "max_tokens/min_tokens: out of range"
    if not 1 <= p.n <= MAX_N or not 0 <= p.beam_width <= MAX_N or (p.beam_width > 1 and p.n > p.beam_width):
        return "n/beam_width: out of range"
    if not (_finite_in(p.temperature, 0.0, MAX_TEMPERATURE) and _finite_in(p.top_p, MIN_POSITIVE, 1.0)
            and _finite_in(p.min_p, 0.0, 1.0) and 0 <= p.top_k <= vocab):
        return "temperature/top_p/min_p/top_k: out of range"
    if not (_finite_in(p.repetition_penalty, MIN_POSITIVE, MAX_REPETITION_PENALTY)
            and _finite_in(p.presence_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
            and _finite_in(p.frequency_penalty, -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
            and _finite_in(p.length_penalty, -MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY)):
        return "penalties: out of range"
    if p.seed is not None and not 0 <= p.seed <= MAX_SEED:
        return "seed: out of range"
    for name, k in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            return f"{name}: out of range"
    if any(not 0 <= t < vocab for t in p.stop_token_ids):
        return "stop_token_ids: outside the vocabulary"
    if any(not 0 <= t < vocab or not math.isfinite(v) for t, v in p.logit_bias.items()):
        return "logit_bias: outside the vocabulary or not finite"
    return None
