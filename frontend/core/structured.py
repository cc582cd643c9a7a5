"""Validation of ``sampling_params.structured_outputs`` (gRPC) and the specs the
HTTP gateway maps onto it. Every spec first meets the cost bounds of
``common/grammar.py`` (milliseconds, no xgrammar: issue 19, a costly spec
stalled the worker's batch), then is parsed with xgrammar exactly as the
worker will compile it (``common.grammar_spec.parse_grammar``, vLLM 0.32's
xgrammar semantics), in the frontend's grammar-check process
(``grammar_check``: xgrammar imports torch, which stays out of the frontend
process, issue 21). An EBNF grammar's text (a Lark grammar's after xgrammar's
conversion, milliseconds) is also checked for left recursion and repetition
costs. What vLLM's xgrammar backend refuses is refused the same way: a regex
with a NUL, an empty or blank schema or grammar, a schema feature xgrammar
cannot enforce (multipleOf, uniqueItems, ...). So a bad or
too costly schema, regex or grammar is INVALID_ARGUMENT / 400 naming the
field and, for a cost, the bound, never a failed or stalled engine step."""
from __future__ import annotations

import functools
import json
import re

from pagedserve.common.grammar import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_LOOPS,
    MAX_NESTED_REPEAT,
    MAX_NESTING,
    MAX_REPEAT,
    MAX_REPEAT_TOTAL,
    MAX_SPEC_CHARS,
    ANY_CHAR,
    Ends,
    GrammarBoundError,
    LoopRun,
    char_set,
    check_bounds,
    count_of,
    seq_ends,
)
from pagedserve.common.grammar_spec import JSON_KINDS, grammar_is_likely_lark, unsupported_json_feature
from pagedserve.common.graph import strongly_connected
from pagedserve.common.messages.types import StructuredSpec
from pagedserve.frontend.core.grammar_check import GrammarSyntaxError, parse_grammar
from pagedserve.frontend.core.validation import ValidationError
from pagedserve.v1 import generation_pb2 as pb

FIELD = "sampling_params.structured_outputs"
__all__ = ["FIELD", "MAX_CHOICES", "MAX_CHOICE_CHARS", "MAX_SPEC_CHARS", "check_combination", "check_ebnf",
           "check_grammar", "spec_from_proto"]


def spec_from_proto(so: pb.StructuredOutputs) -> StructuredSpec | None:
    """The engine spec of a validated ``StructuredOutputs`` (None when unset)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        return None
    field = f"{FIELD}.{kind}"
    compact = so.disable_any_whitespace and kind in JSON_KINDS  # other kinds have no JSON whitespace
    if kind == "json_object":
        if not so.json_object:
            raise ValidationError(field, "must be true when set (leave structured_outputs unset for free text)")
        spec = StructuredSpec("json_object", "", compact)
    elif kind == "choice":
        choices = list(so.choice.choices)
        if not choices:  # an empty string is a choice, as in vLLM
            raise ValidationError(field, f"between 1 and {MAX_CHOICES} choices of at most {MAX_CHOICE_CHARS} "
                                         "characters are required")
        spec = StructuredSpec("choice", json.dumps(choices))
    else:
        text = str(getattr(so, kind))
        if kind != "regex" and not text.strip():  # vLLM compiles an empty regex (it matches "")
            raise ValidationError(field, "must not be empty")
        if kind == "regex" and "\x00" in text:
            raise ValidationError(field, "must not contain a NUL character ('\\x00')")
        spec = StructuredSpec(kind, text, compact)
    check_grammar(spec, field)
    return spec


def check_grammar(spec: StructuredSpec, field: str) -> None:
    """The cost bounds, then xgrammar's parse; raises ``ValidationError``."""
    error = _spec_error(spec)
    if error is not None:
        raise ValidationError(field, error)


@functools.lru_cache(maxsize=256)
def _spec_error(spec: StructuredSpec) -> str | None:
    """Why ``spec`` is refused, or None (cached: a client may resend one spec often)."""
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}.get(spec.kind, spec.kind)
    lark = spec.kind == "grammar" and grammar_is_likely_lark(spec.spec)
    try:  # before json.loads and xgrammar: both can be slow (or recurse) on hostile input
        check_bounds(spec)
        if spec.kind == "grammar" and not lark:
            check_ebnf(spec.spec)
    except GrammarBoundError as e:
        return f"{what} {e}"
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except (ValueError, RecursionError) as e:
            return f"not valid JSON ({e})"
        if not isinstance(schema, (dict, bool)):
            return "a JSON schema must be an object or a boolean"
        feature = unsupported_json_feature(schema)
        if feature is not None:  # vLLM's xgrammar backend refuses these rather than ignore the keyword
            return f"the JSON schema uses {feature}, which the xgrammar backend cannot enforce"
    try:
        printed = parse_grammar(spec)
        if lark:  # its bounds are read from xgrammar's EBNF of it
            check_ebnf(_printed_ebnf(printed))
    except GrammarBoundError as e:
        return f"{what} {e}"
    except GrammarSyntaxError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        # xgrammar prefixes "[time] /path/file.cc:line: "; keep the message.
        msg = lines[0].split(": ", 1)[-1] if lines and lines[0].startswith("[") else (lines[0] if lines else e.kind)
        return f"invalid {what}: {msg[:300]}"
    return None


def _printed_ebnf(text: str) -> str:
    """xgrammar's printed EBNF, with its repetitions {m, -1} in the form check_ebnf reads."""
    return re.sub(r"\{(\d+), -1\}", lambda m: {"0": "*", "1": "+"}.get(m.group(1), "{%s,}" % m.group(1)), text)


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


# ------------------------------------------------------------------ EBNF costs
# Read from the grammar's text (xgrammar's EBNF: llama.cpp's GBNF plus {m,n},
# lookaheads ``(= ...)`` and calls such as ``TagDispatch(...)``), before any
# parse: a hostile grammar is refused without importing xgrammar (and torch).
# An unterminated string or class runs to the end, so the scan stays linear (xgrammar refuses it later).
_TOKEN = re.compile(r"""#[^\n]*|"(?:[^"\\]|\\.)*(?:"|\\?\Z)|'(?:[^'\\]|\\.)*(?:'|\\?\Z)|"""
                    r"\[(?:[^\]\\]|\\.)*(?:\]|\\?\Z)|"
                    r"\{\s*\d*\s*(?:,\s*\d*\s*)?\}|::=|\(=|[A-Za-z_][\w.\-]*|\S", re.S)
# ("lit", text) ("cls", char_set bits) ("ref", name) ("rep", element, lo, hi: -1 unbounded) ("grp"/"call", alternatives)
Element = tuple


def _rules(text: str) -> dict[str, list[list[Element]]]:
    """Each rule's alternatives, each a sequence of elements (the last
    definition of a name wins; an explicit stack: no recursion)."""
    tokens = [t for t in _TOKEN.findall(text) if not t.startswith("#")]
    rules: dict[str, list[list[Element]]] = {}
    stack: list[tuple[str, list[list[Element]]]] = []
    k = 0
    while k < len(tokens):
        tok = tokens[k]
        nxt = tokens[k + 1] if k + 1 < len(tokens) else ""
        k += 1
        if nxt == "::=" and (tok[0].isalpha() or tok[0] == "_"):
            while len(stack) > 1:  # an unclosed group: xgrammar refuses it, cost it anyway
                kind, alts = stack.pop()
                stack[-1][1][-1].append((kind, alts))
            stack = [("top", [[]])]
            rules[tok] = stack[0][1]
            k += 1
            continue
        if not stack:
            continue
        alts = stack[-1][1]
        seq = alts[-1]
        if tok in ("(", "(="):
            stack.append(("look" if tok == "(=" else "grp", [[]]))
            if len(stack) > MAX_NESTING:  # the checks below recurse along the nesting
                raise GrammarBoundError("MAX_NESTING", MAX_NESTING, f"groups nested {len(stack) - 1} deep")
        elif tok == ")" and len(stack) > 1:
            kind, inner = stack.pop()
            if kind != "look":  # a lookahead consumes nothing
                stack[-1][1][-1].append((kind, inner))
        elif tok == "|":
            alts.append([])
        elif tok[0] in "\"'":
            seq.append(("lit", tok[1:-1]))
        elif tok[0] == "[":
            seq.append(("cls", char_set(tok[1:-1])))
        elif tok[0] == "{" and seq:
            lo, comma, hi = tok[1:-1].replace(" ", "").partition(",")
            low = count_of(lo or "0")
            seq[-1] = ("rep", seq[-1], low, count_of(hi) if hi else (-1 if comma else low))
        elif tok in ("*", "+", "?") and seq:
            seq[-1] = ("rep", seq[-1], int(tok == "+"), 1 if tok == "?" else -1)
        elif tok[0].isalpha() or tok[0] == "_":
            if nxt == "(":  # TagDispatch(...) and the like: opaque, but its rules are reached
                stack.append(("call", [[]]))
                k += 1
                if len(stack) > MAX_NESTING:
                    raise GrammarBoundError("MAX_NESTING", MAX_NESTING, f"groups nested {len(stack) - 1} deep")
            else:
                seq.append(("ref", tok))
    return rules


def _elements(alts: list[list[Element]]) -> list[Element]:
    """Every element, nested ones included."""
    out: list[Element] = []
    todo = [e for seq in alts for e in seq]
    while todo:
        e = todo.pop()
        out.append(e)
        if e[0] == "rep":
            todo.append(e[1])
        elif e[0] in ("grp", "call"):
            todo.extend(x for seq in e[1] for x in seq)
    return out


def _refs(e: Element) -> set[str]:
    return {x[1] for x in _elements([[e]]) if x[0] == "ref"}


def _nullable(e: Element, null: set[str]) -> bool:
    if e[0] == "lit":
        return not e[1]
    if e[0] == "ref":
        return e[1] in null
    if e[0] == "rep":
        return e[2] == 0 or _nullable(e[1], null)
    if e[0] == "grp":
        return any(all(_nullable(x, null) for x in seq) for seq in e[1])
    return False  # a character class, an opaque call


def _first_refs(alts: list[list[Element]], null: set[str]) -> set[str]:
    """Rules a match can start with: up to each sequence's first element that cannot be empty."""
    out: set[str] = set()
    for seq in alts:
        for e in seq:
            inner = e[1] if e[0] == "rep" else e
            if inner[0] == "ref":
                out.add(inner[1])
            elif inner[0] == "grp":
                out |= _first_refs(inner[1], null)
            if not _nullable(e, null):
                break
    return out


def check_ebnf(text: str) -> None:
    """Left recursion, repetition counts and loops of an EBNF grammar's text;
    raises ``GrammarBoundError``. Syntax errors are left to xgrammar's parse."""
    rules = _rules(text)
    null: set[str] = set()
    while True:  # nullable rules, to a fixpoint
        more = {r for r, alts in rules.items() if r not in null and any(all(_nullable(e, null) for e in seq)
                                                                        for seq in alts)}
        if not more:
            break
        null |= more
    _left_recursion({r: _first_refs(alts, null) & rules.keys() for r, alts in rules.items()})
    graph = {r: set().union(*(_refs(e) for seq in alts for e in seq)) & rules.keys() for r, alts in rules.items()}
    loops = total = 0
    quantified: set[str] = set()  # rules whose text is a repetition, or holds or reaches one
    looping: set[str] = set()  # rules that are, hold or reach an unbounded repetition
    ends: dict[str, Ends] = {}  # per rule, the characters it (and its loops) can start and end with
    nested: dict[str, int] = {}  # per rule, the largest product of counts of repeated repetitions
    for comp in strongly_connected(graph):  # callees first
        recursive = len(comp) > 1 or comp[0] in graph[comp[0]]
        loops += len(comp) if recursive else 0
        while True:  # first and last characters within the component, to a fixpoint
            new = {r: _looped(_alts_ends(rules[r], null, ends), recursive) for r in comp}
            if all(ends.get(r) == v for r, v in new.items()):
                break
            ends.update(new)
        for r in comp:
            elems = _elements(rules[r])
            if recursive or any(e[0] == "rep" or (e[0] == "ref" and e[1] in quantified) for e in elems):
                quantified.add(r)
            if recursive or any((e[0] == "rep" and e[3] < 0) or (e[0] == "ref" and e[1] in looping) for e in elems):
                looping.add(r)
            nested[r] = max([1] + [nested.get(e[1], 1) for e in elems if e[0] == "ref"])
            for e in elems:
                if e[0] != "rep":
                    continue
                lo, hi = e[2], e[3]
                for v in (lo, hi):
                    if v > MAX_REPEAT:
                        raise GrammarBoundError("MAX_REPEAT", MAX_REPEAT, f"rule {r}: a repetition {{{lo},{hi}}}")
                count = lo if hi < 0 else hi
                loops += hi < 0
                total += count
                inner = _refs(e[1])
                if inner & quantified or any(x[0] == "rep" for x in _elements([[e[1]]])):
                    product = count * max([1] + [nested.get(x, 1) for x in inner])
                    if product > MAX_NESTED_REPEAT:
                        raise GrammarBoundError("MAX_NESTED_REPEAT", MAX_NESTED_REPEAT,
                                                f"rule {r}: {{{lo},{hi}}} repeats a repeated rule "
                                                f"({product} times along the nesting)")
                    nested[r] = max(nested[r], product)
    if loops > MAX_LOOPS:
        raise GrammarBoundError("MAX_LOOPS", MAX_LOOPS, f"{loops} unbounded repetitions (* + recursive rules)")
    if total > MAX_REPEAT_TOTAL:
        raise GrammarBoundError("MAX_REPEAT_TOTAL", MAX_REPEAT_TOTAL, f"counted repetitions of {total} in all")
    for r, alts in rules.items():
        for seq in alts + [seq for e in _elements(alts) if e[0] in ("grp", "call") for seq in e[1]]:
            run = LoopRun(f"rule {r}: ")
            for e in seq:
                loop = any((x[0] == "rep" and x[3] < 0) or (x[0] == "ref" and x[1] in looping)
                           for x in _elements([[e]]))
                run.add(_ends(e, null, ends), loop, _nullable(e, null))


def _char(text: str) -> int:
    """The char_set bit of the character (or escape) that ``text`` starts with."""
    return char_set(text[:2]) if text.startswith("\\") else 1 << min(ord(text[0]), 128)


def _looped(ends: Ends, loop: bool) -> Ends:
    """A loop starts and ends with itself."""
    return (ends[0], ends[1], ends[0], ends[1]) if loop else ends


def _ends(e: Element, null: set[str], ends: dict[str, Ends]) -> Ends:
    if e[0] == "lit":
        body = e[1]
        return (0, 0, 0, 0) if not body else (_char(body), _char(body[-2:] if body[-2:-1] == "\\" else body[-1]), 0, 0)
    if e[0] == "cls":
        return e[1], e[1], 0, 0
    if e[0] == "ref":
        return ends.get(e[1], (0, 0, 0, 0))
    if e[0] == "rep":
        return _looped(_ends(e[1], null, ends), e[3] < 0)
    if e[0] == "grp":
        return _alts_ends(e[1], null, ends)
    return ANY_CHAR, ANY_CHAR, ANY_CHAR, ANY_CHAR  # a call


def _alts_ends(alts: list[list[Element]], null: set[str], ends: dict[str, Ends]) -> Ends:
    out = (0, 0, 0, 0)
    for seq in alts:
        one = seq_ends([(_ends(e, null, ends), _nullable(e, null)) for e in seq])
        out = (out[0] | one[0], out[1] | one[1], out[2] | one[2], out[3] | one[3])
    return out


def _left_recursion(first: dict[str, set[str]]) -> None:
    """Refuses a rule that can start with itself (through rules that may match nothing)."""
    color: dict[str, int] = {}
    for root in first:
        if root in color:
            continue
        path, work = [root], [iter(sorted(first[root]))]
        color[root] = 1
        while work:
            w = next(work[-1], None)
            if w is None:
                color[path.pop()] = 2
                work.pop()
            elif color.get(w) == 1:
                cycle = path[path.index(w):] + [w]
                raise GrammarBoundError("left recursion", 0, "", "left recursion is refused: rule " +
                                        " -> ".join(cycle) + " can start with itself; write the repetition "
                                        "with * or + (or a right-recursive rule) instead")
            elif w not in color:
                color[w] = 1
                path.append(w)
                work.append(iter(sorted(first[w])))
