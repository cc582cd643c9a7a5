"""The bounds of sampling parameters, one home for the frontend's validation
(the user-facing check, answered INVALID_ARGUMENT / 400) and the scheduler's
admission (the engine's own boundary). Both use these numbers, so whatever the
frontend lets through the scheduler runs (a tiny top_p once passed one and
failed the other)."""
from __future__ import annotations

MIN_POSITIVE = 1e-9  # top_p and repetition_penalty must be > 0; below this they are refused
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0  # presence / frequency, as OpenAI
MAX_ABS_LENGTH_PENALTY = 10.0
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
