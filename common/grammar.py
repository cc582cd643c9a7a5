"""Structured-output specs, shared by the frontend (validation) and the worker
(compilation): the cost bounds the frontend checks before a spec reaches the
engine (issue 19: a costly spec compiled or matched inside a worker step
stalls every stream of the batch). How a spec becomes an xgrammar ``Grammar``
is in ``grammar_spec``. No torch here: xgrammar 0.2.9 imports it, and
``check_bounds`` never needs it. The limits come from timings on the 2-core
CPU VM with SmolLM2's 49,152-token vocabulary (docs/benchmarks.md, "Hostile
structured-output specs")."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pagedserve.common.grammar_spec import parse_grammar  # noqa: F401 - its home before grammar_spec
from pagedserve.common.messages.types import StructuredSpec

MAX_SPEC_CHARS = 64 * 1024  # a JSON schema's text
MAX_GRAMMAR_CHARS = 8 * 1024  # a regex or an EBNF grammar: compile time grows with literal text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024  # one choice
MAX_CHOICES_TOTAL_CHARS = 8 * 1024  # all choices: 256 x 1,024 characters compiled for 12 s
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in the schema document (~30 nested objects)
MAX_SCHEMA_NODES = 5000  # JSON values in the schema document
MAX_ENUM_VALUES = 1000  # enum entries plus const values, whole schema
MAX_OBJECT_PROPERTIES = 128  # in one object: optional ones cost quadratically (256: 0.1 s, 1,650: 8.8 s)
MAX_SCHEMA_PROPERTIES = 1024  # in the whole schema: 9 objects of 256 optional ones compiled for 2.6 s
MAX_SCHEMA_COUNT = 100_000  # minLength, maxLength, minItems, maxItems, ... values
MAX_REPEAT = 1000  # one counted repetition {m,n} (regex, EBNF, a schema's pattern)
MAX_REPEAT_TOTAL = 2000  # counted repetitions summed, each times the counts around it
MAX_PATTERN_REPEAT_TOTAL = 128  # in a schema's pattern: two {1,128} compiled 1.6 s, two {1,200} 1.7 s/token
MAX_NESTED_REPEAT = 8  # counts multiplied along repetitions of repeated bodies: ([a-z]+){1,16} stalls 5 s/token
MAX_LOOPS = 64  # unbounded repetitions (* + {m,} recursive rules), times the counts around them
MAX_ADJACENT_LOOPS = 3  # side by side, splitting the same text: 4 cost 0.2-0.3 s a token, 16 1.6 s
MAX_NESTING = 64  # groups nested in an EBNF grammar (xgrammar's own limit is 1,000)

_LENGTH_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                "minContains", "maxContains")


class GrammarBoundError(ValueError):
    """A spec over a cost bound; ``bound`` names the constant."""

    def __init__(self, bound: str, limit: int, detail: str, message: str | None = None) -> None:
        super().__init__(message or f"too costly: {detail} (bound {bound}={limit})")
        self.bound = bound


# ------------------------------------------------------------------ bounds before parsing
def check_bounds(spec: StructuredSpec) -> None:
    """The cost bounds a spec's text must meet (no xgrammar, milliseconds);
    raises ``GrammarBoundError``. Run before ``parse_grammar``."""
    if spec.kind == "json":
        check_schema_text(spec.spec)
    elif spec.kind == "regex":
        _over("MAX_GRAMMAR_CHARS", MAX_GRAMMAR_CHARS, len(spec.spec), "a regex of {} characters")
        check_regex(spec.spec)
    elif spec.kind == "grammar":
        _over("MAX_GRAMMAR_CHARS", MAX_GRAMMAR_CHARS, len(spec.spec), "a grammar of {} characters")
    elif spec.kind == "choice":
        choices = json.loads(spec.spec)
        _over("MAX_CHOICES", MAX_CHOICES, len(choices), "{} choices")
        _over("MAX_CHOICE_CHARS", MAX_CHOICE_CHARS, max(map(len, choices), default=0), "a choice of {} characters")
        _over("MAX_CHOICES_TOTAL_CHARS", MAX_CHOICES_TOTAL_CHARS, sum(map(len, choices)),
              "choices of {} characters in all")


def _over(bound: str, limit: int, value: float, detail: str) -> None:
    if value > limit:
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        raise GrammarBoundError(bound, limit, detail.replace("{}", shown))


# An unterminated string runs to the end: each quote starts at most one match, the scan stays linear.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.S)


def json_depth(text: str) -> int:
    """Nesting of objects and arrays in JSON text, without parsing it (so a
    deep document never reaches json.loads' recursion)."""
    depth = deepest = 0
    for ch in re.findall(r"[\[\]{}]", _JSON_STRING.sub("", text)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def check_schema_text(text: str) -> None:
    _over("MAX_SPEC_CHARS", MAX_SPEC_CHARS, len(text), "a JSON schema of {} characters")
    _over("MAX_SCHEMA_DEPTH", MAX_SCHEMA_DEPTH, json_depth(text), "a JSON schema nested {} levels deep")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError):
        return  # not JSON: the caller's parse says so
    check_schema(schema)


def check_schema(schema: Any) -> None:
    """Depth, size, enum values, counts and patterns of a parsed schema (an
    iterative walk: no recursion, whatever the depth)."""
    nodes = enums = properties = 0
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        nodes += 1
        _over("MAX_SCHEMA_NODES", MAX_SCHEMA_NODES, nodes, "a JSON schema of more than {} values")
        if isinstance(node, (list, dict)):
            _over("MAX_SCHEMA_DEPTH", MAX_SCHEMA_DEPTH, depth + 1, "a JSON schema nested {} levels deep")
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
        if isinstance(node, dict):
            enums += _schema_keywords(node)
            _over("MAX_ENUM_VALUES", MAX_ENUM_VALUES, enums, "{} enum/const values")
            if isinstance(node.get("properties"), dict):
                count = len(node["properties"])
                properties += count
                _over("MAX_OBJECT_PROPERTIES", MAX_OBJECT_PROPERTIES, count, "an object of {} properties")
                _over("MAX_SCHEMA_PROPERTIES", MAX_SCHEMA_PROPERTIES, properties, "{} properties in all")


def _schema_keywords(node: dict[str, Any]) -> int:
    """Checks one schema object's keywords; returns its enum/const values."""
    for key in _LENGTH_KEYS:
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _over("MAX_SCHEMA_COUNT", MAX_SCHEMA_COUNT, value, key + " {}")
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], "pattern", _PATTERN_TOTAL)
    if isinstance(node.get("patternProperties"), dict):
        for pattern in node["patternProperties"]:
            check_regex(pattern, "patternProperties", _PATTERN_TOTAL)
    values = node.get("enum")
    return (len(values) if isinstance(values, list) else 0) + ("const" in node)


# ------------------------------------------------------------------ regex scan
# Character sets, approximate: bit c for an ASCII character c, bit 128 for all others.
ANY_CHAR = (1 << 129) - 1
_ESCAPES = {"d": "0-9", "w": "a-zA-Z0-9_", "s": " \t\n\r\f\v", "n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v"}


def char_set(body: str) -> int:
    """The characters a class body (``^a-z\\d``, without brackets) matches;
    anything unusual (\\p{..}, \\x41, \\W) counts as any character."""
    negated = body.startswith("^")
    bits, i, prev = 0, int(negated), -1
    while i < len(body):
        c, i = body[i], i + 1
        if c == "\\" and i < len(body):
            c, i = body[i], i + 1
            if c in "dws":
                bits, prev = bits | char_set(_ESCAPES[c]), -1
                continue
            if c.isalnum() and c not in _ESCAPES:
                return ANY_CHAR
            c = _ESCAPES.get(c, c)
        elif c == "-" and prev >= 0 and i < len(body):  # a range prev-hi
            hi, i = min(ord(body[i]), 128), i + 1
            bits, prev = bits | ((1 << (hi + 1)) - (1 << prev)), -1
            continue
        prev = min(ord(c), 128)
        bits |= 1 << prev
    return ANY_CHAR & ~bits if negated else bits


# (first, last, head, tail) of a piece: the characters it can start and end with,
# and those of the loops it can start and end with.
Ends = tuple[int, int, int, int]


@dataclass
class _Cost:
    """What a piece of a regex costs (a piece: an atom, a group, a repetition)."""
    ends: Ends = (0, 0, 0, 0)
    nullable: bool = False  # it can match nothing
    loops: int = 0  # unbounded repetitions, times the counts around them
    total: int = 0  # counts of counted repetitions, times the counts around them
    quantified: bool = False  # holds a repetition: repeating it is ambiguous
    nested: int = 1  # largest product of counts along repetitions of quantified bodies

    def add(self, other: "_Cost") -> None:
        self.loops += other.loops
        self.total += other.total
        self.quantified |= other.quantified
        self.nested = max(self.nested, other.nested)


def seq_ends(pieces: list[tuple[Ends, bool]]) -> Ends:
    """The ends of pieces in sequence (each with whether it can match nothing)."""
    first = last = head = tail = 0
    for (f, _, h, _), empty in pieces:
        first, head = first | f, head | h
        if not empty:
            break
    for (_, l, _, t), empty in reversed(pieces):
        last, tail = last | l, tail | t
        if not empty:
            break
    return first, last, head, tail


class LoopRun:
    """Pieces with loops side by side where a loop can take the other's first
    or last character: a+a+a+a+ splits "aaaa..." many ways and the matcher
    follows every split (16 of them stalled 1.6 s a token)."""

    def __init__(self, what: str) -> None:
        self.what, self.length, self.last, self.tail = what, 0, 0, 0

    def add(self, ends: Ends, loops: bool, nullable: bool) -> None:
        first, last, head, tail = ends
        if loops:
            self.length = self.length + 1 if self.tail & first or self.last & head else 1
            self.last, self.tail = last, tail
            _over("MAX_ADJACENT_LOOPS", MAX_ADJACENT_LOOPS, self.length,
                  f"{self.what}{{}} unbounded repetitions side by side that can split the same text")
        elif not nullable:
            self.length, self.last, self.tail = 0, 0, 0


_Bound = tuple[str, int]
_REGEX_TOTAL: _Bound = ("MAX_REPEAT_TOTAL", MAX_REPEAT_TOTAL)
_PATTERN_TOTAL: _Bound = ("MAX_PATTERN_REPEAT_TOTAL", MAX_PATTERN_REPEAT_TOTAL)


def _repeated(body: _Cost, lo: int, hi: int | None, counted: bool, what: str, total: _Bound) -> _Cost:
    """The cost of ``body`` repeated lo..hi times (hi None: unbounded); raises
    at the first bound broken, so the products stay small."""
    shown = ("{%d}" % lo if lo == hi else f"{{{lo},{'' if hi is None else hi}}}") if counted else \
        {(0, None): "*", (1, None): "+"}.get((lo, hi), "?")
    for v in (lo, hi):
        if v is not None:
            _over("MAX_REPEAT", MAX_REPEAT, v, f"{what}a repetition {shown}")
    count = max(lo, 1) if hi is None else hi
    f, la = body.ends[:2]
    cost = _Cost((f, la, f, la) if hi is None else body.ends, lo == 0 or body.nullable,
                 loops=body.loops * count + (hi is None),
                 total=body.total * count + count * counted, quantified=True, nested=body.nested)
    if counted and body.quantified:  # (x+){n}: the matcher tracks every split of the text
        cost.nested = count * body.nested
        _over("MAX_NESTED_REPEAT", MAX_NESTED_REPEAT, cost.nested,
              f"{what}{shown} repeats a repeated group ({{}} times along the nesting)")
    _check_cost(cost, what, total)
    return cost


def _check_cost(cost: _Cost, what: str, total: _Bound) -> None:
    _over("MAX_LOOPS", MAX_LOOPS, cost.loops, f"{what}{{}} unbounded repetitions (* + {{m,}}) with their repeats")
    _over(*total, cost.total, f"{what}counted repetitions of {{}} in all")


_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")
_ESCAPE = re.compile(r"\\(?:[pPux]\{[^}]*\}?|.)", re.S)  # \p{L}, \u{1F600}, or one character
_CLASS = re.compile(r"\[\^?\]?(?:\\.|\[:\w+:\]|[^\]\\])*\]?", re.S)  # a leading ] is a literal; [[:alpha:]]
_GROUP_PREFIX = re.compile(r"\?(?:[:=!>]|<[=!]|P?<[^>]*>)")


class _Group:
    """An open group: its alternatives so far, the one being read, and the
    piece a quantifier would apply to."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.cost = _Cost()
        self.branch: list[_Cost] = []
        self.run = LoopRun(what)
        self.piece: _Cost | None = None

    def push(self, piece: _Cost | None) -> None:
        p, self.piece = self.piece, piece
        if p is not None:
            self.branch.append(p)
            self.run.add(p.ends, p.loops > 0, p.nullable)

    def alternative(self) -> None:
        self.push(None)
        for p in self.branch:
            self.cost.add(p)
        ends = seq_ends([(p.ends, p.nullable) for p in self.branch])
        self.cost.ends = tuple(a | b for a, b in zip(self.cost.ends, ends))  # type: ignore[assignment]
        self.cost.nullable |= all(p.nullable for p in self.branch)
        self.branch, self.run = [], LoopRun(self.what)

    def close(self) -> _Cost:
        self.alternative()
        return self.cost


def check_regex(pattern: str, what: str = "", total: _Bound = _REGEX_TOTAL) -> None:
    """A tokenizer-level scan (escapes, classes, groups, quantifiers) of a
    regex's repetition costs; raises ``GrammarBoundError``. Syntax errors are
    left to xgrammar's parse. ``what``: where the regex is, for the message."""
    what = f"{what}: " if what else ""
    groups = [_Group(what)]
    i, n = 0, len(pattern)
    while i < n:
        c, group = pattern[i], groups[-1]
        if c in "\\[":
            m = (_ESCAPE if c == "\\" else _CLASS).match(pattern, i)
            j = m.end() if m else n
            bits = char_set(pattern[i:j]) if c == "\\" else char_set(pattern[i + 1:j].removesuffix("]"))
            group.push(_Cost((bits, bits, 0, 0)))
            i = j
        elif c == "(":
            groups.append(_Group(what))
            m = _GROUP_PREFIX.match(pattern, i + 1)
            i = m.end() if m else i + 1
        elif c == ")" and len(groups) > 1:
            piece = groups.pop().close()
            groups[-1].push(piece)
            i += 1
        elif c == "|":  # alternatives add up: an over-estimate for loops, exact enough for bounds
            group.alternative()
            i += 1
        elif c in "*+?" or (c == "{" and _COUNT.match(pattern, i)):
            m = _COUNT.match(pattern, i) if c == "{" else None
            if m:
                lo, hi = count_of(m.group(1)), (None if m.group(3) == "" else count_of(m.group(3) or m.group(1)))
                i = m.end()
            else:
                lo, hi = (0 if c != "+" else 1), (1 if c == "?" else None)
                i += 1
            if i < n and pattern[i] in "?+":  # lazy or possessive: the same cost
                i += 1
            if group.piece is not None:
                group.piece = _repeated(group.piece, lo, hi, m is not None, what, total)
        else:
            bits = ANY_CHAR if c == "." else 1 << min(ord(c), 128)
            group.push(_Cost(nullable=True) if c in "^$" else _Cost((bits, bits, 0, 0)))  # anchors match no text
            i += 1
    while len(groups) > 1:  # unclosed groups: xgrammar refuses them, but cost them anyway
        piece = groups.pop().close()
        groups[-1].push(piece)
    _check_cost(groups[0].close(), what, total)


def count_of(digits: str) -> int:
    """A count from the text (int() refuses over 4,300 digits; any such count is over the bounds)."""
    return int(digits) if len(digits) <= 9 else 10**9
