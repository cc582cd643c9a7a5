"""OpenAI / vLLM structured-output fields of the HTTP gateway, mapped onto
``sampling_params.structured_outputs`` (the gRPC field, validated there):

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* ``structured_outputs`` (vLLM >= 0.10): exactly one of ``json``, ``json_object``,
  ``regex``, ``choice``, ``grammar``, with vLLM's options ``disable_any_whitespace``
  (compact JSON), ``disable_additional_properties`` and ``whitespace_pattern``;
* vLLM's older extras ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (``guided_decoding_backend`` only "xgrammar"/"auto").

As in vLLM 0.32, ``response_format`` overrides the kind of ``structured_outputs``
(its options stay), and two different kinds are a 400. guided_* fields go with
neither (vLLM 0.32 no longer reads them at all; here they still constrain).
Differences from vLLM, on purpose: a request's ``disable_any_whitespace`` is
honoured (vLLM's xgrammar backend reads only the server's setting);
``disable_additional_properties`` changes nothing, as in vLLM's xgrammar
backend (strict mode already refuses properties a schema does not name);
``whitespace_pattern`` is accepted and, as there, not applied. Anything else
in this family (``guided_whitespace_pattern``, ``functions``, ...) is refused
with 400 naming it. Tools (``tools``, ``tool_choice``) are in ``openai_tools``.
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.common.grammar import GrammarBoundError, check_schema
from pagedserve.frontend.core.structured import spec_from_proto
from pagedserve.frontend.core.validation import ValidationError
from pagedserve.v1 import generation_pb2 as pb

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_BACKENDS = ("xgrammar", "auto")
_SO_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_SO_FLAGS = ("disable_any_whitespace", "disable_additional_properties")
MAX_WHITESPACE_PATTERN_CHARS = 1024
_REFUSED = {
    "functions": "the legacy functions field is not supported; send tools",
    "function_call": "the legacy function_call field is not supported; send tool_choice",
}
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value  # JSON text, checked by the gRPC validation
    if isinstance(value, (dict, bool)):
        try:  # the cost bounds first: json.dumps recurses, and a deep schema would make it fail
            check_schema(value)
            return json.dumps(value)
        except GrammarBoundError as e:
            raise ValidationError(param, f"JSON schema {e}") from None
        except (ValueError, RecursionError) as e:
            raise ValidationError(param, f"not a JSON schema ({e})") from None
    raise ValidationError(param, "must be a JSON schema (an object, or its JSON text)")


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ValidationError(param, "must be a string")
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise ValidationError(param, "must be a list of strings")
    return value


def _set(so: pb.StructuredOutputs, kind: str, value: Any, param: str) -> None:
    if kind == "json":
        so.json = _schema_text(value, param)
    elif kind == "json_object":
        if value is not True:
            raise ValidationError(param, "must be true")
        so.json_object = True
    elif kind == "regex":
        so.regex = _string(value, param)
    elif kind == "choice":
        so.choice.choices.extend(_choices(value, param))
    else:
        so.grammar = _string(value, param)


def _response_format(rf: Any, so: pb.StructuredOutputs) -> bool:
    """True when it asks for a constraint."""
    p = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ValidationError(p, "must be an object with a type: text, json_object or json_schema")
    kind = rf["type"]
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise ValidationError(f"{p}.{extra[0]}", "not supported")
    if kind == "text":
        return False
    if kind == "json_object":
        so.json_object = True
        return True
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ValidationError(f"{p}.json_schema", "must be an object with a schema")
        extra = sorted(set(js) - {"name", "schema", "strict", "description"})
        if extra:
            raise ValidationError(f"{p}.json_schema.{extra[0]}", "not supported")
        if not isinstance(js.get("name"), str):  # vLLM requires it too
            raise ValidationError(f"{p}.json_schema.name", "a string is required")
        so.json = _schema_text(js["schema"], f"{p}.json_schema.schema")
        return True
    raise ValidationError(f"{p}.type", f"must be text, json_object or json_schema, got {kind!r}")


def _structured_outputs(sob: Any, so: pb.StructuredOutputs) -> None:
    p = "structured_outputs"
    if not isinstance(sob, dict):
        raise ValidationError(p, f"must be an object with one of {', '.join(_SO_KINDS)}")
    unknown = sorted(k for k, v in sob.items() if v is not None and k not in (*_SO_KINDS, *_SO_FLAGS,
                                                                               "whitespace_pattern"))
    if unknown:
        raise ValidationError(f"{p}.{unknown[0]}", "not supported")
    for flag in _SO_FLAGS:
        if sob.get(flag) is not None and not isinstance(sob[flag], bool):
            raise ValidationError(f"{p}.{flag}", "must be a boolean")
    pattern = sob.get("whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or len(pattern) > MAX_WHITESPACE_PATTERN_CHARS):
        raise ValidationError(f"{p}.whitespace_pattern", f"must be a string of at most "
                                                         f"{MAX_WHITESPACE_PATTERN_CHARS} characters")
    given = [k for k in _SO_KINDS if sob.get(k) is not None and not (k == "json_object" and sob[k] is False)]
    if len(given) != 1:
        raise ValidationError(p, f"exactly one of {', '.join(_SO_KINDS)} is required")
    _set(so, given[0], sob[given[0]], f"{p}.{given[0]}")
    so.disable_any_whitespace = sob.get("disable_any_whitespace") is True


def apply_structured(body: dict[str, Any], sp: pb.SamplingParams) -> None:
    """Sets ``sp.structured_outputs`` from the body's structured-output fields;
    raises ``ValidationError`` naming the OpenAI field. Tool fields must have
    been taken out by the chat route (``openai_tools.take_tools``): here they
    are refused (``/v1/completions`` takes no tools)."""
    for name, why in _REFUSED.items():
        if body.get(name) is not None:
            raise ValidationError(name, why)
    for name in TOOL_FIELDS:
        if body.get(name) is not None:
            raise ValidationError(name, "only /v1/chat/completions takes tools")
    for name in body:
        if name.startswith("guided_") and body[name] is not None and name not in GUIDED \
                and name != "guided_decoding_backend":
            raise ValidationError(name, "not supported (guided_json, guided_regex, guided_choice and "
                                        "guided_grammar are)")
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in _BACKENDS:
        raise ValidationError("guided_decoding_backend", f"only {' or '.join(_BACKENDS)} (xgrammar) is available")
    so = pb.StructuredOutputs()
    sources: list[str] = []
    sob = body.get("structured_outputs")
    if sob is not None:
        _structured_outputs(sob, so)
        sources.append("structured_outputs")
    rf = body.get("response_format")
    if rf is not None:
        own = so.WhichOneof("kind")
        kind = pb.StructuredOutputs()
        if _response_format(rf, kind):
            # vLLM: response_format replaces that kind; another kind beside it is two constraints.
            if own is not None and own != kind.WhichOneof("kind"):
                raise ValidationError("response_format", f"only one kind of structured output per request "
                                                         f"(structured_outputs.{own} is set)")
            so.MergeFrom(kind)
            sources = ["response_format"]  # the kind is its: errors name it
    for name in GUIDED:
        if body.get(name) is not None:
            _set(so, name.removeprefix("guided_"), body[name], name)
            sources.append(name)
    if len(sources) > 1:
        raise ValidationError(sources[1], f"only one structured-output field per request ({sources[0]} is set)")
    if sources:
        try:  # checked here too, so the error names the field the client sent
            spec_from_proto(so)
        except ValidationError as e:
            raise ValidationError(sources[0], str(e).split(": ", 1)[-1]) from None
        sp.structured_outputs.CopyFrom(so)
