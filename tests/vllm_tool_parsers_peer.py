"""Run by the peer venv's Python (vLLM 0.32): vLLM's own tool-call parsers over a
corpus read as JSON on stdin; prints their answers as JSON (tests/test_tool_parsers.py).

stdin: [{"parser": NAME, "vocab": [tokens], "cases": [{"text": ..., "chunks": [[...], ...]}]}, ...]
stdout: one list per job: [{"whole": [content, [[name, arguments], ...]], "streams": [[delta, ...], ...]}, ...]
Deltas are DeltaMessage as the chat server serializes them, ids replaced by "ID"."""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

logging.disable(logging.CRITICAL)


class Tok:
    """Just what the parsers read of a tokenizer: its vocabulary."""

    def __init__(self, vocab: list[str]) -> None:
        self._vocab = {t: i for i, t in enumerate(vocab)}

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def _ids(delta: dict) -> dict:
    for tc in delta.get("tool_calls", []):
        if tc.get("id") is not None:
            tc["id"] = "ID"
    return delta


def _joined(deltas: list) -> list:
    """A stream as its deltas joined: [content, [[name, arguments], ...]]."""
    content, names, args = "", {}, {}
    for d in deltas:
        content += (d or {}).get("content") or ""
        for tc in (d or {}).get("tool_calls") or []:
            fn = tc.get("function") or {}
            if fn.get("name"):
                names[tc["index"]] = fn["name"]
            args[tc["index"]] = args.get(tc["index"], "") + (fn.get("arguments") or "")
    return [content, [[names[i], args.get(i, "")] for i in sorted(names)]]


def main() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = []
    for job in json.load(sys.stdin):  # a job's own "tools": the request's (their schemas type arguments)
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    tools=job.get("tools") or tools, tool_choice="auto")
        out.append(run(job, req))
    json.dump(out, sys.stdout)


def run(job: dict, req: Any) -> list:
    from vllm.parser.parser_manager import ParserManager

    cls = ParserManager.get_parser(tool_parser_name=job["parser"], enable_auto_tools=True)
    tok = Tok(job["vocab"])
    out = []
    for case in job["cases"]:
        _, content, calls = cls(tok, req.tools).parse(case["text"], req, enable_auto_tools=True)
        streams = []
        for chunks in case["chunks"]:
            p = cls(tok, req.tools)
            deltas = []
            for i, ch in enumerate(chunks):
                m = p.parse_delta(ch, [], req, [1], finished=i == len(chunks) - 1)
                deltas.append(None if m is None else _ids(json.loads(m.model_dump_json(exclude_unset=True))))
            streams.append(_joined(deltas) if job.get("joined") else deltas)
        out.append({"whole": [content, [[c.name, c.arguments] for c in calls or []]], "streams": streams})
    return out


if __name__ == "__main__":
    main()
