"""``qwen3_coder`` and ``qwen3_xml`` (Qwen3-Coder, Qwen3.5): vLLM 0.32 reads both
with its Qwen3 parser engine; each call is XML::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Arguments become a JSON object of the parameters (one leading and one trailing
newline of each value trimmed), strings unless the request's tool schema types
a parameter (``coerce``). Text around the calls is content; whitespace-only
content beside calls is dropped, and the content of a whole output is stripped
and ends at its first call (vLLM defers the text after a call and, in a whole
output, never sends it; a stream sends it). ``<function=`` without
``<tool_call>`` also starts a call. A stream sends a call's name once known and
its arguments as the JSON grows (``args``); a string value streams as it
comes, other values once complete."""
from __future__ import annotations

from typing import Any

from pagedserve.frontend.openai_api.tool_parsers.base import Call, Delta, ToolParser, tool_call_id
from pagedserve.frontend.openai_api.tool_parsers.qwen3_xml_args import fixed_types, safe_prefix, string_keys, to_json

TOOL_START, TOOL_END, FUNC, FUNC_END = "<tool_call>", "</tool_call>", "<function=", "</function>"
PARAM, PARAM_END, CLOSE = "<parameter=", "</parameter>", ">"
TERMINALS = ("<think>", "</think>", TOOL_START, TOOL_END, FUNC, FUNC_END, PARAM, PARAM_END, CLOSE)
TOOL_STATES = ("preamble", "name", "args", "between")
_LONGEST = max(map(len, TERMINALS))


class Slot:
    def __init__(self) -> None:
        self.id, self.name, self.args, self.name_sent, self.streamed = "", "", "", False, ""
        self.keys: set[str] | None = None


class Qwen3XmlParser(ToolParser):
    name = "qwen3_xml"
    engine_based = True
    keeps_special_tokens = True  # vLLM's engine parsers turn skip_special_tokens off

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.tools = tools
        self._state = "content"
        self._buf = ""  # text that may still be the start of a terminal
        self._slots: list[Slot] = []
        self._deferred = ""
        self._has_text = False  # content other than whitespace was sent

    # ------------------------------------------------------------ lexing
    def _lex(self, text: str, final: bool) -> list[tuple[str | None, str]]:
        """[(terminal or None, text)] of the held text plus ``text``; a possible terminal start stays held."""
        s, out, pos, i = self._buf + text, [], 0, 0
        while i < len(s):
            hit = next((t for t in TERMINALS if s.startswith(t, i)), None)
            if hit is not None:
                if i > pos:
                    out.append((None, s[pos:i]))
                out.append((hit, hit))
                i = pos = i + len(hit)
            elif not final and len(s) - i < _LONGEST and any(t.startswith(s[i:]) for t in TERMINALS):
                break  # may still grow into a terminal
            else:
                i += 1
        if i > pos:
            out.append((None, s[pos:i]))
        self._buf = s[i:]
        return out

    # ------------------------------------------------------------ the state machine
    def _events(self, pieces: list[tuple[str | None, str]]) -> list[tuple[str, str]]:
        ev: list[tuple[str, str]] = []
        for term, text in pieces:
            st = self._state
            if st == "content" and term == "</think>" and not self.reasoning_markup_is_text:
                continue  # a reasoning parser ran before: a repeated end marker is dropped
            if term is None or (st == "content" and term in ("<think>", "</think>", TOOL_END, FUNC_END, PARAM,
                                                                 PARAM_END, CLOSE)):
                ev += self._plain(text)
            elif term in (TOOL_START, FUNC) and st in ("content", "between"):
                self._state = "preamble" if term == TOOL_START else "name"
                ev.append(("start", ""))
            elif st == "preamble" and term == TOOL_END:
                self._state = "content"
                ev.append(("end", ""))
            elif st == "preamble" and term == FUNC:
                self._state = "name"
            elif st == "name" and term == CLOSE:
                self._state = "args"
            elif st in ("name", "args") and term == FUNC_END:
                self._state = "between"
                ev.append(("end", ""))
            elif st == "args" and term in (PARAM, PARAM_END):
                ev.append(("arg", text))
            elif st == "between" and term == TOOL_END:
                self._state = "content"
            else:
                ev += self._plain(text)
        return ev

    def _plain(self, text: str) -> list[tuple[str, str]]:
        kind = {"content": "text", "name": "name", "args": "arg"}.get(self._state)
        return [(kind, text)] if kind else []

    def _finish_events(self) -> list[tuple[str, str]]:
        ev = self._events(self._lex("", True))
        if self._state in TOOL_STATES:
            if self._slots:
                ev.append(("end", ""))
            self._state = "content"
        return ev

    # ------------------------------------------------------------ events to a delta
    def _props(self, name: str) -> dict[str, Any]:
        for t in self.tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and fn.get("name") == name:
                params = fn.get("parameters") or {}
                return params.get("properties", {}) if isinstance(params, dict) else {}
        return {}

    def _json(self, slot: Slot, partial: bool, name: str | None = None) -> str:
        name = slot.name if name is None else name
        return fixed_types(to_json(slot.args, partial), self._props(name)) if name else to_json(slot.args, partial)

    def _name_delta(self, i: int, out: list[Delta], args: str | None = None) -> None:
        slot = self._slots[i]
        slot.name_sent, slot.keys = True, string_keys(self._props(slot.name))
        slot.id = slot.id or tool_call_id()
        fn: dict[str, Any] = {"name": slot.name}
        if args is not None:
            fn["arguments"] = args
        out.append({"index": i, "id": slot.id, "type": "function", "function": fn})

    def _to_delta(self, events: list[tuple[str, str]], finished: bool) -> Delta | None:
        calls: list[Delta] = []
        content: list[str] = []
        carried, seen_tool = self._deferred, False
        for kind, value in events:
            if kind == "text":
                if seen_tool:
                    self._deferred += value
                else:
                    content.append(value)
                continue
            seen_tool = True
            i = len(self._slots) - 1
            if kind == "start":
                self._slots.append(Slot())
            elif kind == "name":
                self._slots[i].name += value
            elif kind == "arg":
                slot = self._slots[i]
                slot.args += value
                if not slot.name_sent:
                    if slot.name:
                        self._name_delta(i, calls)
                elif value and (diff := self._arg_delta(slot)):
                    calls.append({"index": i, "function": {"arguments": diff}})
            elif kind == "end" and i >= 0:
                slot = self._slots[i]
                rest = self._flush(slot)
                if not slot.name_sent and slot.name:
                    self._name_delta(i, calls, rest or "")
                    rest = None
                if rest and slot.name_sent:
                    calls.append({"index": i, "function": {"arguments": rest}})
        calls = _coalesce(calls)
        if self._deferred and (not seen_tool or not calls):
            now = self._deferred[len(carried):]
            content = ([carried] if carried else []) + content + ([now] if now else [])
            self._deferred = ""
        text = "".join(content)
        if not self._has_text and text:
            if text.strip():
                self._has_text = True
            elif self._slots:
                text = ""
            elif not finished:
                self._deferred, text = text, ""
        if not text and not calls:
            return None
        out: Delta = {}
        if text:
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
        return out

    def _arg_delta(self, slot: Slot) -> str | None:
        safe = safe_prefix(self._json(slot, True), slot.keys)
        if not safe or safe == slot.streamed or (slot.streamed and not safe.startswith(slot.streamed)):
            return None
        diff, slot.streamed = safe[len(slot.streamed):], safe
        return diff or None

    def _flush(self, slot: Slot) -> str | None:
        final = self._json(slot, False)
        if len(final) > len(slot.streamed) and final.startswith(slot.streamed):
            diff, slot.streamed = final[len(slot.streamed):], final
            return diff
        return None

    # ------------------------------------------------------------ ToolParser
    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        d = self._to_delta(self._events(self._lex(text, False)) + self._finish_events(), True)
        calls = [_call(s, self._json(s, False, s.name.strip())) for s in self._slots if s.name.strip() or s.args]
        calls = [c for c in calls if c is not None]
        content = (d or {}).get("content")
        if content and calls:
            content = content.strip()
        return content or None, calls

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        try:  # vLLM: a parser without calls answers its own content (incomplete call markup dropped)
            return self.extract(text)
        except Exception:
            return text, []

    def feed(self, delta: str, finished: bool) -> Delta | None:
        out = self._to_delta(self._events(self._lex(delta, False)), False)
        if finished:  # vLLM flushes the engine after the last delta, as a delta of its own (merged)
            events = self._finish_events()
            if events or self._deferred:
                rest = self._to_delta(events, True) or {}
                out = dict(out or {})
                if rest.get("content"):
                    out["content"] = out.get("content", "") + rest["content"]
                if rest.get("tool_calls"):
                    out["tool_calls"] = out.get("tool_calls", []) + rest["tool_calls"]
                out = out or None
        return out


class Qwen3CoderParser(Qwen3XmlParser):
    name = "qwen3_coder"


def _call(slot: Slot, args: str) -> Call | None:
    name = slot.name.strip()
    if not name:
        return None
    return {"id": slot.id or tool_call_id(), "type": "function",
            "function": {"name": name, "arguments": args if slot.args.strip() else "{}"}}


def _coalesce(calls: list[Delta]) -> list[Delta]:
    merged: dict[int, Delta] = {}
    for c in calls:
        m = merged.get(c["index"])
        if m is None:
            merged[c["index"]] = c
            continue
        for k in ("id", "type"):
            if k in c and k not in m:
                m[k] = c[k]
        fn, mf = c.get("function", {}), m.setdefault("function", {})
        if "name" in fn and "name" not in mf:
            mf["name"] = fn["name"]
        if "arguments" in fn:
            mf["arguments"] = mf.get("arguments", "") + fn["arguments"] if "arguments" in mf else fn["arguments"]
    return list(merged.values())
