"""``llama4_pythonic`` (Llama 4): ``pythonic`` calls, which Llama 4 may wrap in
``<|python_start|>`` ... ``<|python_end|>``; vLLM's parser of the name strips
them (a whole output: the start only at the very beginning, every end)."""
from __future__ import annotations

from pagedserve.frontend.openai_api.tool_parsers.base import Call, Delta
from pagedserve.frontend.openai_api.tool_parsers.pythonic import PythonicParser

PY_START, PY_END = "<|python_start|>", "<|python_end|>"


class Llama4PythonicParser(PythonicParser):
    name = "llama4_pythonic"

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        inner = text[len(PY_START):].replace(PY_END, "") if text.startswith(PY_START) else text
        content, calls = super().extract(inner)
        return (content, calls) if calls else (text, [])  # vLLM answers the raw text when no call

    def extract_streaming(self, previous: str, current: str, delta: str) -> Delta | None:
        if not current.startswith("[") and not current.startswith(PY_START):
            return {"content": delta}
        if current.startswith(PY_START):
            current = current[len(PY_START):]
        if current.endswith(PY_END):
            current = current[:current.rfind(PY_END)]
        return self._stream_calls(current)
