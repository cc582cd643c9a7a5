"""``llama3_json`` (Llama 3.x/4 with vLLM's JSON tool template): the output is
``{"name": ..., "arguments" | "parameters": {...}}`` objects, optionally after
``<|python_tag|>`` and separated by ``; ``. Whole text: every top-level JSON
object is a call (any other text is dropped; one brace that is not a call makes
it all content). Streaming only when the output starts with ``{`` or the tag:
a call's name once whole, then its arguments as ``json.dumps`` text, each
delta the part that can no longer change."""
from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.frontend.openai_api.tool_parsers import partial_json
from pagedserve.frontend.openai_api.tool_parsers.base import Call, Delta, ToolParser, call, dumps, is_complete_json, tool_call_id

BOT = "<|python_tag|>"


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    structural_tag = "llama"  # xgrammar's builtin template, as vLLM's Llama3JsonToolParser
    needs_token = BOT

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        if BOT not in text and "{" not in text:
            return text, []
        calls: list[Call] = []
        end = -1
        dec = json.JSONDecoder()
        for m in re.finditer(r"\{", text):
            if m.start() <= end:  # inside the previous object
                continue
            try:
                obj, n = dec.raw_decode(text[m.start():])
                end = m.start() + n
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(call(obj["name"], dumps(args)))
            except Exception:  # not JSON, or no name/arguments: all of it is content
                return text, []
        return (None, calls) if calls else (text, [])

    def extract_streaming(self, previous: str, current: str, delta: str) -> Delta | None:
        if not (current.startswith(BOT) or current.startswith("{")):
            return {"content": delta}
        arr: list[dict[str, Any]] = []
        complete: list[bool] = []
        start = len(BOT) if current.startswith(BOT) else 0
        try:
            while start < len(current):
                obj, n = partial_json.loads(current[start:], allow_str=self.current_tool_name_sent)
                complete.append(is_complete_json(current[start:start + n]))
                start += n + len("; ")
                if "parameters" in obj:
                    if "arguments" in obj:
                        return None  # "model generated both parameters and arguments"
                    obj["arguments"] = obj["parameters"]
                arr.append(obj)
        except partial_json.MalformedJSON:
            return None  # not enough text to read yet
        if not arr:
            return None
        cur = arr[self.current_tool_id] if arr else {}
        if len(arr) > self.current_tool_id + 1:  # a new call: first send what the last one still lacks
            out: Delta | None = None
            if self.current_tool_id >= 0 and cur.get("arguments"):
                diff = dumps(cur["arguments"])[len(self.streamed_args_for_tool[self.current_tool_id]):]
                out = {"tool_calls": [{"index": self.current_tool_id, "function": {"arguments": diff}}]}
                self.streamed_args_for_tool[self.current_tool_id] += diff
            self.current_tool_id = len(arr) - 1
            self.current_tool_name_sent = False
            self.streamed_args_for_tool.append("")
            return out  # the parsed calls are not kept this time (as vLLM)
        out = None
        if not self.current_tool_name_sent:
            if cur.get("name"):
                out = {"tool_calls": [{"id": tool_call_id(), "type": "function", "index": self.current_tool_id,
                                       "function": {"name": cur["name"]}}]}
                self.current_tool_name_sent = True
        elif cur.get("arguments"):
            sent = len(self.streamed_args_for_tool[self.current_tool_id])
            now = dumps(cur["arguments"])
            before = self.prev_tool_call_arr[self.current_tool_id].get("arguments")
            diff = None
            if complete[self.current_tool_id]:
                diff = now[sent:]
            elif before:
                was = dumps(before)
                if now != was:
                    diff = _common_prefix(was, now)[sent:]
            if diff is not None:
                out = {"tool_calls": [{"index": self.current_tool_id, "function": {"arguments": diff}}]}
                self.streamed_args_for_tool[self.current_tool_id] += diff
        self.prev_tool_call_arr = arr
        return out
