"""Validation of ``sampling_params.structured_outputs`` (gRPC) and the specs the
HTTP gateway maps onto it. A spec is parsed here with xgrammar exactly as the
worker will compile it (``gpuworker.structured.parse_grammar``), so a bad
schema, regex or grammar is INVALID_ARGUMENT / 400 naming the field, never a
failed engine step."""
from __future__ import annotations

import functools
import json

from pagedserve.common.messages.types import StructuredSpec
from pagedserve.frontend.validation import ValidationError
from pagedserve.gpuworker.structured import parse_grammar
from pagedserve.v1 import generation_pb2 as pb

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
FIELD = "sampling_params.structured_outputs"


def spec_from_proto(so: pb.StructuredOutputs) -> StructuredSpec | None:
    """The engine spec of a validated ``StructuredOutputs`` (None when unset)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    field = f"{FIELD}.{kind}"
    if kind == "json_object":
        if not so.json_object:
            raise ValidationError(field, "must be true when set (leave structured_outputs unset for free text)")
        spec = StructuredSpec("json_object")
    elif kind == "choice":
        choices = list(so.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise ValidationError(field, f"between 1 and {MAX_CHOICES} choices are required, got {len(choices)}")
        if any(not 1 <= len(c) <= MAX_CHOICE_CHARS for c in choices):
            raise ValidationError(field, f"each choice must have 1 to {MAX_CHOICE_CHARS} characters")
        spec = StructuredSpec("choice", json.dumps(choices))
    else:
        text = str(getattr(so, kind))
        if not text:
            raise ValidationError(field, "must not be empty")
        if len(text) > MAX_SPEC_CHARS:
            raise ValidationError(field, f"longer than {MAX_SPEC_CHARS} characters")
        if kind == "json":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValidationError(field, f"not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValidationError(field, "a JSON schema must be an object or a boolean")
        spec = StructuredSpec(kind, text)
    check_grammar(spec, field)
    return spec


def check_grammar(spec: StructuredSpec, field: str) -> None:
    error = _parse_error(spec)
    if error is not None:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}.get(spec.kind, spec.kind)
        raise ValidationError(field, f"invalid {what}: {error}")


@functools.lru_cache(maxsize=256)
def _parse_error(spec: StructuredSpec) -> str | None:
    try:
        parse_grammar(spec)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/InvalidJSONError
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message.
        msg = lines[0].split(": ", 1)[-1] if lines and lines[0].startswith("[") else (lines[0] if lines else type(e).__name__)
        return msg[:300]
    return None


def check_combination(spec: StructuredSpec | None, beam_width: int, ignore_eos: bool, min_tokens: int) -> None:
    """What a constrained output cannot be combined with."""
    if spec is None:
        return
    if beam_width > 1:
        raise ValidationError(FIELD, "not supported with beam search (beam_width > 1)")
    if ignore_eos:
        raise ValidationError(FIELD, "not supported with ignore_eos: a complete output ends with EOS")
    if min_tokens:
        raise ValidationError(FIELD, "not supported with min_tokens: the grammar decides when the output ends")
