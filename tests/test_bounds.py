"""One home for sampling bounds (common/request_fields.py): every value the frontend
lets through, the scheduler's admission runs, and the edges refused by one
are refused by the other. A tiny top_p or repetition_penalty once passed the
frontend's (0, x] and failed admission's [1e-9, x] (hypothesis found it)."""
from __future__ import annotations

from typing import Any

import pytest

from pagedserve.common.request_fields import MAX_SEED, MIN_POSITIVE, TABLE
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import ModelInfo
from pagedserve.frontend.core.validation import Limits, ValidationError, sampling_params
from pagedserve.scheduler.admission import check_add
from pagedserve.v1 import generation_pb2 as pb

MODEL = ModelInfo("m", 509, 512, (0,), 1, 1, 1, "float32", "cpu")
MAX_REPETITION_PENALTY, MAX_TEMPERATURE = TABLE["repetition_penalty"].hi, TABLE["temperature"].hi
MAX_ABS_PENALTY, MAX_LOGPROBS = TABLE["presence_penalty"].hi, TABLE["logprobs"].hi
assert isinstance(MAX_LOGPROBS, int)
EDGES: list[tuple[str, Any]] = [
    ("top_p", MIN_POSITIVE), ("top_p", 2 * MIN_POSITIVE), ("top_p", MIN_POSITIVE / 10), ("top_p", 1.0), ("top_p", 1.0 + 1e-6),
    ("repetition_penalty", MIN_POSITIVE), ("repetition_penalty", 1.4e-45), ("repetition_penalty", MAX_REPETITION_PENALTY),
    ("repetition_penalty", MAX_REPETITION_PENALTY * 1.01), ("temperature", MAX_TEMPERATURE),
    ("temperature", MAX_TEMPERATURE * 1.01), ("presence_penalty", -MAX_ABS_PENALTY),
    ("frequency_penalty", MAX_ABS_PENALTY * 1.01), ("seed", MAX_SEED), ("logprobs", MAX_LOGPROBS),
    ("logprobs", MAX_LOGPROBS + 1), ("top_k", -1), ("top_k", 10**6), ("max_tokens", 512), ("min_tokens", 4),
]


@pytest.mark.parametrize("field,value", EDGES)
def test_the_frontend_and_admission_agree(field: str, value: Any) -> None:
    sp = pb.SamplingParams(**{"max_tokens": 4, field: value})
    try:
        prep = sampling_params(sp, 3, Limits(vocab_size=509, max_model_len=512))
    except ValidationError as e:
        assert field in e.field
        return  # refused at the door: admission never sees it
    why = check_add(AddRequest("r", [1, 2, 3], prep.params, 0.0), MODEL)
    assert why is None, f"{field}={value!r} passed the frontend but admission says: {why}"


def test_the_edges_fall_on_both_sides() -> None:
    accepted = []
    for field, value in EDGES:
        try:
            sampling_params(pb.SamplingParams(**{"max_tokens": 4, field: value}), 3, Limits(509, 512))
            accepted.append((field, value))
        except ValidationError:
            pass
    # The floor is a power of two: the proto's float32 carries it exactly, so it passes.
    assert ("top_p", MIN_POSITIVE) in accepted and ("top_p", 2 * MIN_POSITIVE) in accepted and ("top_p", MIN_POSITIVE / 10) not in accepted
    assert ("repetition_penalty", 1.4e-45) not in accepted and ("logprobs", MAX_LOGPROBS + 1) not in accepted
    assert ("top_k", -1) in accepted and ("top_k", 10**6) in accepted and ("max_tokens", 512) in accepted
