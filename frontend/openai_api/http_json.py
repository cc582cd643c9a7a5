"""Request bodies of the HTTP gateway as JSON, with bounds a client cannot break.

``json.loads`` alone turns some bodies into a 500: it recurses once per nesting
level (a body 5,000 brackets deep is a RecursionError), it accepts the
non-standard literals ``NaN``, ``Infinity`` and ``-Infinity``, a number such as
``1e999`` becomes ``inf``, and an integer of over 4,300 digits raises a
ValueError of its own. Here the nesting depth is measured first, by a linear
scan of the brackets outside strings (no recursion), and the parse refuses every
non-finite number and every integer too large for any field; each is a 400 in
OpenAI's error shape naming the problem.
"""
from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from pagedserve.frontend.core.errors import ApiError

# Arrays and objects. Chat requests need about 5; a JSON schema nested 10 objects deep (OpenAI's
# structured-output limit) is about 25 inside response_format: 64 leaves room and stays far
# below the ~1,000 at which Python code walking the value (json.dumps, copies) would recurse out.
MAX_JSON_DEPTH = 64
# No field takes an integer of 2**64 or more (seed is < 2**63); bounding the digits also
# keeps clear of Python's own 4,300-digit limit on int(). 20 digits hold every value below 2**64.
MAX_INT_DIGITS = 20
MAX_ABS_INT = 2**64
ON_LOOP_BYTES = 64 * 1024  # bodies above this are scanned and parsed on a thread, off the event loop

# A JSON string, escapes included; an unterminated one runs to the end, so every
# quote starts at most one match and the scan stays linear on hostile input.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JsonLimitError(ValueError):
    """A body (or embedded JSON text) breaks a bound; the message says which."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` outside strings, without parsing
    (unbalanced text is measured all the same; the parser rejects it later)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets), initial=0))


def check_depth(text: str, what: str = "body") -> None:
    """Raises JsonLimitError when ``text`` nests deeper than MAX_JSON_DEPTH."""
    depth = nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise JsonLimitError(f"{what}: JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")


def _constant(name: str) -> Any:
    raise JsonLimitError(f"{name} is not a JSON number: numbers must be finite")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 and the like overflow to inf
        raise JsonLimitError(f"the number {text[:40]} is too large: numbers must be finite")
    return value


def _int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    value = int(text) if digits <= MAX_INT_DIGITS else None
    if value is None or abs(value) >= MAX_ABS_INT:
        shown = text if len(text) <= 40 else f"{text[:20]}... ({digits} digits)"
        raise JsonLimitError(f"the integer {shown} is out of range: integers must be below 2**64 in magnitude")
    return value


def loads(text: str, what: str = "body") -> Any:
    """``json.loads`` within the bounds above; raises JsonLimitError or ValueError
    (json.JSONDecodeError) naming ``what``."""
    check_depth(text, what)
    try:
        return json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except JsonLimitError as e:
        raise JsonLimitError(f"{what}: {e}") from None
    except RecursionError:  # cannot happen below MAX_JSON_DEPTH; kept as a 400 should the scan ever miss
        raise JsonLimitError(f"{what}: JSON nested too deep") from None


def decode_body(raw: bytes, charset: str | None) -> Any:
    """The request body's JSON value; any failure is ApiError(400) with param ``body``."""
    try:
        text = raw.decode(charset or "utf-8")
    except (LookupError, UnicodeDecodeError) as e:
        raise ApiError(400, f"body: not valid {charset or 'utf-8'} text ({e})", param="body") from None
    try:
        return loads(text)
    except JsonLimitError as e:
        raise ApiError(400, str(e), param="body") from None
    except ValueError as e:  # json.JSONDecodeError
        raise ApiError(400, f"body: not valid JSON ({e})", param="body") from None


def check_schema_texts(body: dict[str, Any]) -> None:
    """The JSON schemas a body sends as JSON text rather than as objects
    (``guided_json``, ``structured_outputs.json``, ``response_format``'s schema)
    are bounded like the body, before anything parses them: ApiError(400) naming the field."""
    texts: list[tuple[str, Any]] = [("guided_json", body.get("guided_json"))]
    so = body.get("structured_outputs")
    if isinstance(so, dict):
        texts.append(("structured_outputs.json", so.get("json")))
    rf = body.get("response_format")
    js = rf.get("json_schema") if isinstance(rf, dict) else None
    if isinstance(js, dict):
        texts.append(("response_format.json_schema.schema", js.get("schema")))
    for param, text in texts:
        if isinstance(text, str):
            try:
                check_depth(text, param)
            except JsonLimitError as e:
                raise ApiError(400, str(e), param=param) from None
