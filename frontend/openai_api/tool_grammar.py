"""The grammar vLLM 0.32 puts on a tool request when its tool-call parser has
a structural-tag model (``--tool-call-parser hermes``; ``llama3_json``:
xgrammar's builtin ``llama`` template, built by xgrammar): an xgrammar
structural tag of ``<tool_call>`` blocks (vllm/tool_parsers/
structural_tag_registry.py, ``_hermes_style_structural_tag``), not the JSON
array of its parser-less path.

* named tool choice ("forced") and ``"required"``: one block (named, or
  ``parallel_tool_calls: false``) or one or more blocks, each
  ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`` or the
  same without the two newlines;
* ``ARGS`` follows the tool's ``parameters`` only for a tool marked
  ``strict: true``; otherwise any JSON value (vLLM's
  ``resolve_tool_strictness`` under ``--tool-strict-level auto``);
* ``"auto"``: no grammar unless a tool is strict or ``parallel_tool_calls``
  is false (then text with triggered blocks).

With no strict tool, forced and required are written here as EBNF text equal
to xgrammar's own rendering of that structural tag (checked by
tests/test_tool_grammar.py); the other shapes are rendered by xgrammar itself,
in the grammar-check child (frontend/core/grammar_check.py: it
imports torch, which the frontend process must not)."""
from __future__ import annotations

import json
from typing import Any

from pagedserve.common.grammar_spec import ebnf_literal
from pagedserve.frontend.core import grammar_check

START, END = "<tool_call>", "</tool_call>"
# xgrammar's rendering of a JSON value under the schema ``true`` (any JSON), rule root_0.
_ANY_JSON = r'''basic_escape ::= (([\"\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))
basic_string_sub ::= (("\"") | ([^\0-\x1f\"\\\r\n] basic_string_sub) | ("\\" basic_escape basic_string_sub)) (=([ \n\r\t]* [,}\]:]))
basic_any ::= ((basic_number) | (basic_string) | (basic_boolean) | (basic_null) | (basic_array) | (basic_object))
basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]*))
basic_number ::= ((basic_number_1 basic_number_2 basic_number_3 basic_number_5))
basic_string ::= (("\"" basic_string_sub))
basic_boolean ::= (("true") | ("false"))
basic_null ::= (("null"))
basic_array ::= (("[" [ \n\r\t]* basic_any basic_array_items{0, -1} [ \n\r\t]* "]") | ("[" [ \n\r\t]* "]"))
basic_object ::= (("{" [ \n\r\t]* basic_string [ \n\r\t]* ":" [ \n\r\t]* basic_any basic_object_properties{0, -1} [ \n\r\t]* "}") | ("{" [ \n\r\t]* "}"))
basic_number_digits ::= (([0-9]))
basic_array_items ::= (([ \n\r\t]* "," [ \n\r\t]* basic_any))
basic_object_properties ::= (([ \n\r\t]* "," [ \n\r\t]* basic_string [ \n\r\t]* ":" [ \n\r\t]* basic_any))
root_0 ::= ((basic_number) | (basic_string) | (basic_boolean) | (basic_null) | (basic_array) | (basic_object))
basic_integer_1 ::= ("" | ("-"))
basic_number_1 ::= ("" | ("-"))
basic_number_2 ::= (("0") | ([1-9] [0-9]*))
basic_number_3 ::= ("" | ("." basic_number_digits{1, -1}))
basic_number_4 ::= ("" | ([+\-]))
basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, -1}))'''
_CALL_LISTS = ("triggered_tags", "token_triggered_tags", "tags_with_separator")
_FORMS = ((START + '\n{"name": "', "}\n" + END), (START + '{"name": "', "}" + END))


def _strict(tool: dict[str, Any]) -> bool:
    return (tool.get("function") or {}).get("strict") is True


def _tags(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for t in tools:
        fn = t["function"]
        params = fn.get("parameters") if _strict(t) else True
        for begin, end in _FORMS:
            out.append({"type": "tag", "begin": begin + fn["name"] + '", "arguments": ',
                        "content": {"type": "json_schema", "json_schema": True if params is None else params},
                        "end": end})
    return out


def _single_call(node: Any) -> None:
    """vLLM's limit_to_single_tool_call: every list of calls stops after its first."""
    if isinstance(node, dict):
        if node.get("type") in _CALL_LISTS:
            node["stop_after_first"] = True
        for v in node.values():
            _single_call(v)
    elif isinstance(node, list):
        for v in node:
            _single_call(v)


def _xgrammar_builtin(model: str, tools: list[dict[str, Any]], choice: Any, single: bool) -> dict[str, Any] | None:
    """A tag from xgrammar's own model templates (``llama``), its tools' strictness
    pinned as vLLM's resolve_tool_strictness does (a parallel-off request: level FUNCTION)."""
    if choice in (None, "auto") and not single and not any(_strict(t) for t in tools):
        return None
    pinned = [{**t, "function": {**t["function"], "strict": _strict(t)}} for t in tools]
    # xgrammar imports torch: its builtin templates are read in the grammar-check child
    tag = grammar_check.model_structural_tag(model, pinned, "auto" if choice is None else choice)
    if single:
        _single_call(tag)
    return tag


def structural_tag(tools: list[dict[str, Any]], choice: Any, parallel: bool | None,
                   model: str = "hermes") -> dict[str, Any] | None:
    """vLLM's structural tag for these tools and this tool_choice (None: no grammar);
    ``model``: the parser's structural-tag model ("hermes", or xgrammar's "llama")."""
    single = parallel is False
    if choice == "none" or not tools:
        return None
    if model != "hermes":
        return _xgrammar_builtin(model, tools, choice, single)
    if choice in (None, "auto"):
        if not single and not any(_strict(t) for t in tools):
            return None  # resolve_tool_strictness: no tag for auto without a strict tool
        fmt: dict[str, Any] = {"type": "triggered_tags", "triggers": [START], "tags": _tags(tools),
                               "at_least_one": False, "stop_after_first": single}
        return {"type": "structural_tag", "format": fmt}
    if isinstance(choice, dict):  # named: only that tool, one call
        name = (choice.get("function") or {}).get("name")
        tools, single = [t for t in tools if t["function"]["name"] == name], True
    fmt = {"type": "tags_with_separator", "tags": _tags(tools), "separator": "", "at_least_one": True,
           "stop_after_first": single}
    return {"type": "structural_tag", "format": fmt}


def to_ebnf(tag: dict[str, Any]) -> str:
    """The structural tag as xgrammar EBNF text."""
    fmt = tag["format"]
    plain = fmt["type"] == "tags_with_separator" and all(
        t["type"] == "tag" and t["content"]["json_schema"] is True and t["begin"].startswith(START)
        for t in fmt["tags"])
    if not plain:
        # strict tools or triggered tags need xgrammar's own conversion, in the grammar-check child
        return grammar_check.structural_tag_ebnf(json.dumps(tag))
    names = ["tag"] + [f"tag_{i}" for i in range(1, len(fmt["tags"]))]
    lines = [_ANY_JSON]
    lines += [f'{n} ::= (({ebnf_literal(t["begin"])} root_0 {ebnf_literal(t["end"])}))'
              for n, t in zip(names, fmt["tags"])]
    lines.append("tags_with_separator_tags ::= (" + " | ".join(f"({n})" for n in names) + ")")
    if fmt["stop_after_first"]:
        lines.append("tags_with_separator ::= ((tags_with_separator_tags))")
    else:
        lines.append('tags_with_separator_sub ::= ("" | (tags_with_separator_tags tags_with_separator_sub))')
        lines.append("tags_with_separator ::= ((tags_with_separator_tags tags_with_separator_sub))")
    lines.append("root ::= ((tags_with_separator))")
    return "\n".join(lines) + "\n"
