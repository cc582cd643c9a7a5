"""Loading a JSON prefix as the value it will grow into, with the semantics of
``partial_json_parser`` as vLLM's JSON tool parsers call it: open strings,
arrays and objects are closed, a half-written key or literal is dropped, a
trailing number is kept; with ``allow_str=False`` an open string is dropped
too (a tool name is sent whole). Text after a complete first container
(``{...}; {...}``) gives that first value and where it ends."""
from __future__ import annotations

import json
import re
from typing import Any

_TOKEN = re.compile(r'["\[\]{}]')
_NUM_CHARS = "1234567890.-+eE"
_LITERALS = ("null", "true", "false", "Infinity")


class MalformedJSON(ValueError):
    pass


# A completion: (length of the input kept, text to append, whether the value was already whole);
# None: the value cannot be completed (it is dropped from its container).
Completion = tuple[int, str, bool] | None


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _any(s: str, allow_str: bool, top: bool = False) -> Completion:
    c = s[0]
    if c == '"':
        return _str(s, allow_str)
    if c in "1234567890":
        return _num(s, top)
    if c == "[":
        return _container(s, allow_str, "]")
    if c == "{":
        return _container(s, allow_str, "}")
    for lit in _LITERALS:
        if s.startswith(lit):
            return len(lit), "", True
        if lit.startswith(s):
            return 0, lit, False
    if c == "-":
        if len(s) == 1:
            return None
        if s[1] != "I":
            return _num(s, top)
    for lit in ("-Infinity", "NaN"):
        if s.startswith(lit):
            return len(lit), "", True
        if lit.startswith(s):
            return 0, lit, False
    raise MalformedJSON(f"unexpected character {c!r}")


def _escaped_before(s: str, i: int) -> bool:
    return (i - len(s[:i].rstrip("\\"))) % 2 == 1


def _str(s: str, allow_str: bool) -> Completion:
    i = 1
    while i < len(s):
        if s[i] == "\\":
            if i + 1 == len(s):
                break
            i += 2
            continue
        if s[i] == '"':
            return i + 1, "", True
        i += 1
    if not allow_str:
        return None
    for esc, width in (("\\u", 5), ("\\U", 9), ("\\x", 3)):  # never cut an escape in half
        k = s.rfind(esc, max(0, i - width), i)
        if k != -1 and not _escaped_before(s, k):
            return k, '"', False
    return i, '"', False


def _num(s: str, top: bool) -> Completion:
    i = 1
    while i < len(s) and s[i] in _NUM_CHARS:
        i += 1
    modified = False
    try:
        while s[i - 1] in ".-+eE":  # a number cannot end in these (negative indexes as the original)
            modified = True
            i -= 1
    except IndexError:
        raise MalformedJSON("bad number") from None
    if modified or (i == len(s) and not top):
        return i, "", False
    return i, "", True


def _container(s: str, allow_str: bool, close: str) -> Completion:
    i = j = 1
    try:
        while True:
            j = _skip(s, j)
            if s[j] == close:
                return j + 1, "", True
            if close == "}":
                if s[j] != '"':
                    raise MalformedJSON("expected a key")
                key = _str(s[j:], allow_str)
                if key is None or not key[2]:
                    return i, close, False
                j = _skip(s, j + key[0])
                if s[j] != ":":
                    raise MalformedJSON("expected ':'")
                j = _skip(s, j + 1)
            r = _any(s[j:], allow_str)
            if r is None:
                return i, close, False
            if not r[2]:
                return j + r[0], r[1] + close, False
            i = j = j + r[0]
            j = _skip(s, j)
            if s[j] == ",":
                j += 1
            elif s[j] != close:
                raise MalformedJSON(f"expected ',' or {close!r}")
            else:
                return j + 1, "", True
    except IndexError:
        return i, close, False


def loads(s: str, allow_str: bool = True) -> tuple[Any, int]:
    """(value, characters of ``s`` it spans); MalformedJSON or json.JSONDecodeError if it cannot be read."""
    lead, body = len(s) - len(s.lstrip()), s.strip()
    if not body:
        raise MalformedJSON("empty")
    r = _any(body, allow_str, top=True)
    if r is None:
        raise MalformedJSON("too partial")
    first = _TOKEN.search(s)
    if first is None or first.group() == '"':  # a scalar on top: the original cuts in the stripped text
        return json.loads(s[:r[0]] + r[1]), len(s)
    if r[2] and body[r[0]:].strip():  # a whole value, then more ("; {...}"): the first one
        return json.JSONDecoder().raw_decode(s)
    return json.loads(s[:lead + r[0]] + r[1]), len(s)
