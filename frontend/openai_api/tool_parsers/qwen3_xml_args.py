"""Arguments of Qwen3's XML tool calls as vLLM 0.32 builds them: the
``<parameter=NAME>VALUE</parameter>`` tags to a JSON object (``to_json``),
values typed by the tool's schema (``fixed_types``: vLLM's
coerce_to_schema_type), and the part of a growing object that is safe to
stream (``safe_prefix``: it cannot change as more text arrives)."""
from __future__ import annotations

import json
import math
import re
from typing import Any

_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)
_PARTIAL = re.compile(r"<\s*parameter\s*=\s*([^>]+)>(.*)$", re.DOTALL)
_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
            "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
            "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
            "float": "number", "float32": "number", "float64": "number", "double": "number",
            "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array"}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def _trim(value: str) -> str:
    """One leading and one trailing newline (the chat template's layout)."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def to_json(raw: str, partial: bool) -> str:
    params: dict[str, Any] = {m.group(1): _trim(m.group(2)) for m in _PARAM.finditer(raw)}
    if partial:
        m = _PARTIAL.search(_PARAM.sub("", raw))
        if m and m.group(1):
            params[m.group(1)] = _trim(m.group(2))
    return json.dumps(params, ensure_ascii=False)


def schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return ["string"]
    types: set[str] = set()
    t = schema.get("type")
    types.update([t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else [])
    enum = schema.get("enum")
    if isinstance(enum, list):
        for v in enum:
            types.add("null" if v is None else next((n for k, n in _ENUM_TYPES if isinstance(v, k)), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for s in schema[key]:
                types.update(schema_types(s))
    return list(types) if types else ["string"]


def _finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, list):
        return all(_finite(x) for x in v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    return True


def coerce(value: str, types: list[str]) -> Any:
    wanted = {_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types}
    for t in _ORDER:
        if t not in wanted:
            continue
        if t == "null" and value.lower() == "null":
            return None
        if t == "string":
            return value
        if t == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if t == "number":
            try:
                f = float(value)
            except ValueError:
                continue
            if math.isfinite(f):
                return f if f != int(f) else int(f)
        if t == "boolean":
            low = value.lower().strip()
            if low in ("true", "1", "false", "0"):
                return low in ("true", "1")
        if t in ("object", "array"):
            try:
                parsed = json.loads(value)
            except ValueError:
                continue
            if _finite(parsed):
                return parsed
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if _finite(parsed) else value


def _coerce_value(value: Any, schema: dict[str, Any]) -> tuple[Any, bool]:
    if isinstance(value, str):
        new = coerce(value, schema_types(schema))
        return new, new is not value
    if isinstance(value, dict):
        props = schema.get("properties")
        return value, isinstance(props, dict) and _coerce_dict(value, props)
    if isinstance(value, list):
        items, changed = schema.get("items"), False
        if isinstance(items, dict):
            for i, item in enumerate(value):
                new, ch = _coerce_value(item, items)
                if ch:
                    value[i], changed = new, True
        return value, changed
    new = coerce(json.dumps(value, ensure_ascii=False), schema_types(schema))
    return (new, True) if type(new) is not type(value) or new != value else (value, False)


def _coerce_dict(args: dict[str, Any], props: dict[str, Any]) -> bool:
    changed = False
    for k, v in args.items():
        if isinstance(props.get(k), dict):
            new, ch = _coerce_value(v, props[k])
            if ch:
                args[k], changed = new, True
    return changed


def fixed_types(args_json: str, props: dict[str, Any]) -> str:
    """The arguments with values typed by the tool's ``properties`` (unchanged without them)."""
    if not props:
        return args_json
    try:
        args = json.loads(args_json)
    except ValueError:
        return args_json
    if not isinstance(args, dict) or not _coerce_dict(args, props):
        return args_json
    return json.dumps(args, ensure_ascii=False)


def string_keys(props: dict[str, Any]) -> set[str] | None:
    """Parameters whose string values stream before they close (None: no schema, all)."""
    if not props:
        return None
    return {k for k, s in props.items() if set(schema_types(s)) == {"string"}}


def safe_prefix(text: str, keys: set[str] | None) -> str:
    """``text`` up to its last top-level value: a string of a streamable key up to its
    closing quote, any other value not at all (its typed form may still change)."""
    last_colon, last_key, pending, in_str, esc, start, depth = -1, None, None, False, False, -1, 0
    for i, c in enumerate(text):
        if esc:
            esc = False
        elif in_str:
            if c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 1 and start >= 0:
                    pending = text[start + 1:i]
        elif c == '"':
            in_str, start = True, i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        elif c == ":" and depth == 1:
            last_colon, last_key, pending = i, pending, None
    if last_colon < 0:
        return ""
    end = last_colon + 1
    while end < len(text) and text[end] in " \t\n\r":
        end += 1
    if end >= len(text) or text[end] != '"' or (keys is not None and last_key not in keys):
        return text[:end]
    esc = False
    for i in range(end + 1, len(text)):
        if esc:
            esc = False
        elif text[i] == "\\":
            esc = True
        elif text[i] == '"':
            return text[:i]
    return text
