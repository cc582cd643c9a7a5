"""``pythonic`` (Llama 3.2/4, ToolACE): the whole output is a Python list of
calls with keyword arguments, ``[get_weather(city='Paris'), f(x=[1, 2])]``;
argument values are literals (JSON's null/true/false too). Streaming only when
the output starts with ``[``: the text so far is closed into valid Python,
each call's arguments are sent as ``json.dumps`` text, withholding what the
closing added."""
from __future__ import annotations

import ast
import re
from typing import Any

from pagedserve.frontend.openai_api.tool_parsers.base import Call, Delta, ToolParser, call, dumps

# vLLM's TOOL_CALL_REGEX (matched at the start) accepts the same texts as this linear form:
# "[", calls without arguments, then a call whose arguments run to the last ")" before "]".
_LIST = re.compile(r"\[(?:[a-zA-Z]\w*\(\),?\s*)*[a-zA-Z]\w*\((?:[a-zA-Z]\w*=.*)?\)\s*\]", re.DOTALL)
_JSON_NAMES = {"null": None, "true": True, "false": False}
_CLOSE = {"[": "]", "(": ")", "{": "}", "'": "'", '"': '"'}


class BadCall(ValueError):
    pass


def _value(v: ast.expr) -> Any:
    if isinstance(v, ast.Constant):
        if v.value is None or isinstance(v.value, (str, int, float)):
            return v.value
        raise BadCall("arguments must be JSON values")
    if isinstance(v, ast.Dict):
        if not all(isinstance(k, ast.Constant) for k in v.keys):
            raise BadCall("dict keys must be literals")
        return {k.value: _value(x) for k, x in zip(v.keys, v.values)}  # type: ignore[union-attr]
    if isinstance(v, (ast.List, ast.Tuple, ast.Set)):  # JSON has lists only
        return [_value(x) for x in v.elts]
    if isinstance(v, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in v.values):
        return "".join(str(p.value) for p in v.values)  # type: ignore[attr-defined]
    if isinstance(v, ast.Name) and v.id in _JSON_NAMES:
        return _JSON_NAMES[v.id]
    if isinstance(v, ast.UnaryOp) and isinstance(v.op, (ast.USub, ast.UAdd)):
        x = _value(v.operand)
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            return -x if isinstance(v.op, ast.USub) else x
    raise BadCall("arguments must be literals")


def _call(c: ast.Call) -> Call:
    parts: list[str] = []
    f: ast.expr = c.func
    while isinstance(f, ast.Attribute):  # a.b.c(...) keeps its dotted name
        parts.append(f.attr)
        f = f.value
    if not isinstance(f, ast.Name):
        raise BadCall("invalid tool call name")
    parts.append(f.id)
    return call(".".join(reversed(parts)), dumps({k.arg: _value(k.value) for k in c.keywords}))


def _calls(text: str) -> list[Call]:
    parsed = getattr(ast.parse(text).body[0], "value", None)
    if not isinstance(parsed, ast.List) or not all(isinstance(e, ast.Call) for e in parsed.elts):
        raise BadCall("the output must be a list of function calls")
    return [_call(e) for e in parsed.elts]  # type: ignore[arg-type]


def _escaped(text: str, i: int) -> bool:
    n = 0
    while i - 1 - n >= 0 and text[i - 1 - n] == "\\":
        n += 1
    return n % 2 == 1


def close_python(text: str) -> tuple[str, str] | None:
    """(text closed into valid Python, what was added), or None when too partial to close."""
    stack: list[str] = []
    for i, ch in enumerate(text):
        if stack and stack[-1] in "'\"":  # inside a string only its quote counts
            if ch == stack[-1] and not _escaped(text, i):
                stack.pop()
            continue
        if ch in "[({":
            stack.append(ch)
        elif ch in "])}":
            if not stack or stack.pop() != {"]": "[", ")": "(", "}": "{"}[ch]:
                raise BadCall("mismatched brackets")
        elif ch in "'\"":
            stack.append(ch)
    text = text.rstrip()
    if text.endswith("=") or text.endswith(":"):
        return None
    if stack and stack[-1] == "{":
        before = text[:text.rfind("{")]
        if before.count(":") <= before.count(","):
            return None
    if stack and stack[-1] == "(":
        before = text[:text.rfind("(")]
        if before.count("=") <= before.count(","):
            return None
    if text.endswith(","):
        text = text[:-1]
    if stack and stack[-1] == "[" and not text.endswith("[") and not text.endswith(")"):
        return None
    added = "".join(_CLOSE[c] for c in reversed(stack))
    try:
        module = ast.parse(text + added)
    except SyntaxError:
        return None
    if not module.body:
        return None
    if "}" in added and any(isinstance(n, ast.Set) for n in ast.walk(module)):
        return None  # '{"k' closed to a set: a dict still being written
    return text + added, added


class PythonicParser(ToolParser):
    name = "pythonic"

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        if not _LIST.match(text):
            return text, []
        try:
            return None, _calls(text)
        except Exception:  # not Python, or not literals: plain text
            return text, []

    def extract_streaming(self, previous: str, current: str, delta: str) -> Delta | None:
        if not current.startswith("["):
            return {"content": delta}
        return self._stream_calls(current)

    def _stream_calls(self, current: str) -> Delta | None:
        closed = close_python(current)
        if closed is None:
            return None
        valid, added = closed
        deltas: list[Delta] = []
        calls = _calls(valid)
        for index, new in enumerate(calls):
            if index < self.current_tool_id:
                continue
            self.current_tool_id = index
            if len(self.streamed_args_for_tool) == index:
                self.streamed_args_for_tool.append("")
            complete = index < len(calls) - 1 or ")]" not in added
            if complete:
                self.current_tool_id += 1
            withheld = added[:-2] if not complete else ""
            if not complete and added[-2] == ")":
                withheld += "}"  # the arguments object's own close
            withheld = withheld.replace("'", '"')
            args = new["function"]["arguments"]
            if withheld:
                if not args.endswith(withheld):
                    raise BadCall("arguments do not end with the withheld suffix")
                args = args[:-len(withheld)]
            sent = self.streamed_args_for_tool[index]
            if not sent:
                d: Delta = {"id": new["id"], "type": "function", "index": index,
                            "function": {"name": new["function"]["name"], "arguments": args}}
            elif args[len(sent):]:
                d = {"id": None, "index": index, "function": {"arguments": args[len(sent):]}}
            else:
                continue
            deltas.append(d)
            self.streamed_args_for_tool[index] += d["function"]["arguments"]
        if deltas and not self.prev_tool_call_arr:
            self.prev_tool_call_arr = [{"arguments": {}}]  # vLLM's marker that a call was made
        if deltas:
            return {"tool_calls": deltas}
        if not added and self.current_tool_id > 0:
            return {"content": ""}  # all calls done: an empty delta so the finish is sent
        return None
