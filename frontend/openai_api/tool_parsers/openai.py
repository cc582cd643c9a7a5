"""``openai``: vLLM's name for gpt-oss models, whose tool calls are harmony
messages (``<|channel|>commentary to=functions.NAME <|constrain|>json``);
read by the harmony reader (``reasoning/harmony.py``), which the chat server
also uses with ``--reasoning-parser openai_gptoss``. Without it the analysis
(reasoning) messages are dropped, as vLLM's HarmonyParser drops them."""
from __future__ import annotations

from pagedserve.frontend.openai_api.reasoning.harmony import HarmonyParser
from pagedserve.frontend.openai_api.tool_parsers.base import Call, Delta, ToolParser


class OpenAIParser(ToolParser):
    name = "openai"
    needs_token = "<|channel|>"
    keeps_special_tokens = True  # harmony's markers are special tokens

    def __init__(self) -> None:
        super().__init__()
        self._harmony = HarmonyParser(reasoning=False, tools=True)

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        _, content, calls = HarmonyParser(reasoning=False, tools=True).parse(text)
        return content, calls

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        return self.extract(text)

    def feed(self, delta: str, finished: bool) -> Delta | None:
        return self._harmony.feed(delta, finished)
