"""Tool-call parsers for ``tool_choice: "auto"`` (``--enable-auto-tool-choice
--tool-call-parser NAME``), one module each, with vLLM 0.32's outputs for the
same text: ``PARSERS[name]()`` per generated sequence (see ``base``)."""
from __future__ import annotations

from collections.abc import Mapping

from pagedserve.frontend.openai_api.tool_parsers.base import ToolParser, check_vocab
from pagedserve.frontend.openai_api.tool_parsers.hermes import HermesParser
from pagedserve.frontend.openai_api.tool_parsers.llama3_json import Llama3JsonParser
from pagedserve.frontend.openai_api.tool_parsers.llama4_pythonic import Llama4PythonicParser
from pagedserve.frontend.openai_api.tool_parsers.mistral import MistralParser
from pagedserve.frontend.openai_api.tool_parsers.openai import OpenAIParser
from pagedserve.frontend.openai_api.tool_parsers.pythonic import PythonicParser
from pagedserve.frontend.openai_api.tool_parsers.qwen3_xml import Qwen3CoderParser, Qwen3XmlParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, OpenAIParser,
                        Llama4PythonicParser, Qwen3CoderParser, Qwen3XmlParser)}


def check(name: str, vocab: Mapping[str, int], model: str) -> None:
    """Start-up check of ``--tool-call-parser``: ValueError with one line when it cannot serve this model."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"--tool-call-parser {name!r} is not one of: {', '.join(sorted(PARSERS))}")
    why = check_vocab(cls, vocab)
    if why is not None:
        raise ValueError(f"--tool-call-parser {name} cannot be used with the tokenizer of {model!r}: {why}")
