"""``hermes`` (Hermes 2 Pro, Qwen 2.5/3, SmolLM2...): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text before the
first tag is content. Streaming re-reads the whole text each delta and sends
what is new: content up to a tag (holding back a partial tag), a call's name
once complete, then its arguments as the raw JSON text the model wrote."""
from __future__ import annotations

import json
import re

from pagedserve.frontend.openai_api.tool_parsers.base import (Call, Delta, ToolParser, call, dumps, is_complete_json,
                                                   partial_tag_overlap, tool_call_id)

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGS = re.compile(r'"arguments"\s*:\s*')


class HermesParser(ToolParser):
    name = "hermes"
    structural_tag = "hermes"
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._sent_content = 0

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        if START not in text:
            return text, []
        try:
            found = [json.loads(a or b) for a, b in _CALLS.findall(text)]
            calls = [call(f["name"], dumps(f["arguments"])) for f in found]
        except Exception:  # malformed JSON or a missing key: the whole text is content
            return text, []
        content = text[:text.find(START)]
        return content or None, calls

    def _content(self, text: str) -> str | None:
        end = text.index(START) if START in text else len(text) - partial_tag_overlap(text, START)
        if end > self._sent_content:
            out, self._sent_content = text[self._sent_content:end], end
            return out
        return None

    @staticmethod
    def _bodies(text: str) -> list[tuple[str, bool]]:
        """(JSON text, complete) of each <tool_call> region so far."""
        out: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            body = start + len(START)
            end = text.find(END, body)
            if end != -1:
                out.append((text[body:end].strip(), True))
                pos = end + len(END)
                continue
            raw = text[body:]
            if k := partial_tag_overlap(raw, END):
                raw = raw[:-k]
            raw = raw.strip()
            out.append((raw, is_complete_json(raw) if raw else False))  # JSON whole, tag not yet
            break
        return out

    @staticmethod
    def _args(body: str, complete: bool) -> str | None:
        m = _ARGS.search(body)
        if not m:
            return None
        raw = body[m.end():]
        if complete:  # drop the brace that closes the outer object
            raw = raw.rstrip()
            if raw.endswith("}"):
                raw = raw[:-1].rstrip()
        return raw

    def extract_streaming(self, previous: str, current: str, delta: str) -> Delta | None:
        content = self._content(current)
        deltas: list[Delta] = []
        for i, (body, complete) in enumerate(self._bodies(current)):
            if i >= len(self.prev_tool_call_arr):
                self.prev_tool_call_arr.append({})
                self.streamed_args_for_tool.append("")
            if "name" not in self.prev_tool_call_arr[i]:
                m = _NAME.search(body)
                if not m:
                    break  # call i+1 waits for call i's name
                self.prev_tool_call_arr[i]["name"] = m.group(1)
                deltas.append({"id": tool_call_id(), "type": "function", "index": i,
                               "function": {"name": m.group(1)}})
            args = self._args(body, complete)
            if args is not None and len(args) > len(self.streamed_args_for_tool[i]):
                diff = args[len(self.streamed_args_for_tool[i]):]
                self.streamed_args_for_tool[i] = args
                self.prev_tool_call_arr[i]["arguments"] = args
                deltas.append({"index": i, "function": {"arguments": diff}})
        if content or deltas:
            out: Delta = {"content": content}
            if deltas:
                out["tool_calls"] = deltas
            return out
        return None
