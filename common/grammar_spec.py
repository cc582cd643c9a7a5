"""How a structured-output spec becomes an xgrammar ``Grammar``: the same
grammar vLLM 0.32's xgrammar backend builds (vllm/v1/structured_output/
backend_xgrammar.py, utils.py), so the same model under the same greedy
decoding writes the same tokens:

* a JSON schema in xgrammar's strict mode (properties a schema does not name
  are refused; ``additionalProperties: true`` lets them in), with any
  whitespace between tokens unless ``disable_any_whitespace`` (then compact,
  separators "," and ":"); ``json_object`` is the schema ``{"type": "object"}``
  under the same rules;
* a regex through ``Grammar.from_regex``;
* a grammar in Lark syntax when no line defines a rule with ``::=``
  (vLLM's ``grammar_is_likely_lark``), else xgrammar's EBNF;
* choices as vLLM's ``choice_as_grammar`` EBNF text, character for character.

One difference, on purpose: xgrammar 0.2.9's JSON string characters let
through raw control characters (strings with minLength/maxLength) and UTF-8
encoded surrogates, neither valid JSON (a surrogate also breaks maxLength);
those classes are replaced by a strict one (``_json_strings_fixed``). It
changes the mask only for those bytes.

No torch here: xgrammar imports it, so it is imported inside the functions."""
from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.common.messages.types import StructuredSpec

JSON_KINDS = ("json", "json_object")


def grammar_is_likely_lark(text: str) -> bool:
    """vLLM's test: Lark unless a line (comments removed) holds ``::=``."""
    for line in text.split("\n"):
        if "::=" in re.sub(r"(#|//).*$", "", line).strip():
            return False
    return True


_EBNF_ESCAPES = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def ebnf_literal(text: str) -> str:
    """A quoted EBNF literal, escaped as vLLM escapes choices (C0 controls and DEL as \\uXXXX)."""
    return '"' + "".join(_EBNF_ESCAPES.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch)
                         for ch in text) + '"'


def choice_grammar(choices: list[str]) -> str:
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


def grammar_source(spec: StructuredSpec) -> tuple[str, str]:
    """(method, argument) for ``xgrammar.Grammar``: json_schema, regex, lark or ebnf."""
    if spec.kind == "json":
        return "json_schema", spec.spec
    if spec.kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if spec.kind == "regex":
        return "regex", spec.spec
    if spec.kind == "choice":
        return "ebnf", choice_grammar(json.loads(spec.spec))
    if spec.kind == "grammar":
        return ("lark" if grammar_is_likely_lark(spec.spec) else "ebnf"), spec.spec
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


def parse_grammar(spec: StructuredSpec, disable_any_whitespace: bool = False) -> Any:
    """The xgrammar ``Grammar`` of a spec (no tokenizer); raises on a bad one.
    ``disable_any_whitespace``: the server's setting (--structured-outputs-config),
    or-ed with the request's."""
    import xgrammar as xgr

    method, arg = grammar_source(spec)
    if method == "json_schema":
        compact = disable_any_whitespace or spec.disable_any_whitespace
        # vLLM: any_whitespace=not disable_any_whitespace, separators (",", ":") when disabled.
        return _json_strings_fixed(xgr.Grammar.from_json_schema(
            arg, any_whitespace=not compact, separators=(",", ":") if compact else None))
    if method == "regex":
        return xgr.Grammar.from_regex(arg)
    if method == "lark":
        return xgr.Grammar.from_lark(arg)
    return xgr.Grammar.from_ebnf(arg)


_LOOSE_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_CHARS = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


def json_strings_fixed_text(text: str) -> str:
    """A JSON grammar's text with the strict string class (also for tests that compare with vLLM's)."""
    for c in _LOOSE_CHARS:
        text = text.replace(c, _JSON_CHARS)
    return text


def _json_strings_fixed(grammar: Any) -> Any:
    text = str(grammar)
    if not any(c in text for c in _LOOSE_CHARS):
        return grammar
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(json_strings_fixed_text(text))


# ------------------------------------------------------------------ what xgrammar cannot honour
# vLLM's has_xgrammar_unsupported_json_features (backend_xgrammar.py): its
# xgrammar backend refuses these schemas rather than ignore a keyword.
STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _pattern_and_length(node: dict[str, Any]) -> bool:
    return ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node)


def _unsupported_here(node: dict[str, Any]) -> str | None:
    types = _types(node)
    if types & {"integer", "number"} and "multipleOf" in node:
        return "multipleOf"
    if "array" in types:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in node:
                return key
    if "string" in types and "format" in node and node["format"] not in STRING_FORMATS:
        return f"format {node['format']!r}"
    if "string" in types and _pattern_and_length(node):
        return "a string pattern or format with minLength/maxLength"
    if "object" in types and "propertyNames" in node:
        names = node["propertyNames"]
        if isinstance(names, dict) and _pattern_and_length(names):
            return "propertyNames with a pattern or format and a length"
        for key in ("patternProperties", "properties"):
            if key in node:
                return f"propertyNames with {key}"
        if node.get("unevaluatedProperties", True) is not True:
            return "propertyNames with unevaluatedProperties"
    pattern_props = node.get("patternProperties")
    if "object" in types and isinstance(pattern_props, dict):
        if "properties" in node:
            return "patternProperties with properties"
        if len(pattern_props) > 1:
            return "more than one patternProperties"
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) >= 2:
        return "allOf with more than one branch"
    return None


def unsupported_json_feature(schema: Any) -> str | None:
    """The first schema feature xgrammar cannot enforce (vLLM's list), or None
    (an explicit stack: the frontend's bounds already limit the size)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        why = _unsupported_here(node)
        if why is not None:
            return why
        for value in node.values():
            if isinstance(value, dict):
                stack.append(value)
            elif isinstance(value, list):
                stack.extend(x for x in value if isinstance(x, dict))
    return None
