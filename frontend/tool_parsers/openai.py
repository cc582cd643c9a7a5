"""``openai``: vLLM's name for gpt-oss models, whose tool calls are harmony
messages (``<|channel|>commentary to=functions.NAME``, special tokens parsed
by ``openai_harmony``); vLLM's parser of that name is a stub its harmony
parser drives. There is no plain-text form to parse, so a server started with
it on another model is refused at start-up (``check`` in the registry)."""
from __future__ import annotations

from pagedserve.frontend.tool_parsers.base import Call, Delta, ToolParser


class OpenAIParser(ToolParser):
    name = "openai"
    refusal = ("--tool-call-parser openai parses gpt-oss (harmony) output, which this server does not "
               "support; use hermes, llama3_json, mistral or pythonic")

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        raise NotImplementedError(self.refusal)

    def extract_streaming(self, previous: str, current: str, delta: str) -> Delta | None:
        raise NotImplementedError(self.refusal)
