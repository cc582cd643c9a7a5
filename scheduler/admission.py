"""The scheduler's own check of an ``AddRequest``.

The frontend validates every field against the documented bounds; this is
the engine's boundary: whatever reaches the scheduler socket (a bug, or a
stray peer) must not make the worker fail a step that holds other users'
requests. So the fields a step depends on are checked again, cheaply, and a
request that breaks one is refused with an error delta of its own. The
sampling fields' bounds are the frontend's, from the one table
(common/request_fields.py); the caps on n and beam_width are the frontend's
flags, which the scheduler does not see: it holds them to ``MAX_N``.
"""
from __future__ import annotations

import math

from pagedserve.common import request_fields
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import ModelInfo

MAX_N = 256  # far above the frontend's caps; bounds per-request work only
MAX_STOP_IDS = 1 << 16  # above any --max-stop-ids an operator sets; bounds per-step work only
MAX_ID_LEN = 1024


def check_add(req: AddRequest, model: ModelInfo) -> str | None:
    """None when the scheduler can run ``req``; otherwise why not."""
    p = req.params
    vocab = model.vocab_size
    if not req.request_id or len(req.request_id) > MAX_ID_LEN:
        return "request_id: empty or too long"
    if req.cache_salt is not None and (why := request_fields.violation({"cache_salt": req.cache_salt}, {})):
        return why
    ids = req.prompt_token_ids
    if not ids or len(ids) >= model.max_model_len:
        return f"prompt: {len(ids)} tokens; must be 1 .. {model.max_model_len - 1}"
    if min(ids) < 0 or max(ids) >= vocab:
        return f"prompt: token ids must be in [0, {vocab})"
    if not 0 <= req.num_output_tokens < len(ids) or (req.num_output_tokens and (p.n > 1 or p.beam_width > 1)):
        return "num_output_tokens: out of range (resuming needs n = 1 and no beam search)"
    if not 0 <= p.top_k <= vocab:  # the engine's form: the frontend maps -1 and k past the vocabulary to 0
        return f"top_k: must be in [0, {vocab}], got {p.top_k}"
    if p.beam_width > 1 and p.n > p.beam_width:
        return "n/beam_width: n exceeds beam_width"
    limits = {"vocab_size": vocab, "max_model_len": model.max_model_len, "max_n": MAX_N, "max_beam_width": MAX_N,
              "max_stop_ids": MAX_STOP_IDS}
    values = {name: getattr(p, name) for name in request_fields.TABLE if hasattr(p, name)}
    why = request_fields.violation(values, limits)
    if why is not None:
        return why
    if any(not 0 <= t < vocab for t in p.stop_token_ids):
        return "stop_token_ids: outside the vocabulary"
    if any(not 0 <= t < vocab or not math.isfinite(v) for t, v in p.logit_bias.items()):
        return "logit_bias: outside the vocabulary or not finite"
    return None
