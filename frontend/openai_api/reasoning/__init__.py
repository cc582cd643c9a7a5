"""Reasoning parsers (``--reasoning-parser NAME``), one module each, with
vLLM 0.32's outputs for the same text: the reasoning goes to the message's
``reasoning`` field (and ``reasoning_content``), streaming and not, and the
tool-call parser reads the content after it (``compose``, ``chat``)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedserve.frontend.openai_api.reasoning.base import ReasoningParser
from pagedserve.frontend.openai_api.reasoning.deepseek_r1 import DeepSeekR1Parser
from pagedserve.frontend.openai_api.reasoning.harmony import HarmonyParser
from pagedserve.frontend.openai_api.reasoning.qwen3 import Qwen3Parser

# vLLM 0.32's names; openai_gptoss is its name for gpt-oss (harmony) models.
THINK_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}
NAMES = (*THINK_PARSERS, HarmonyParser.name)


def needs_tokens(name: str) -> tuple[str, ...]:
    return HarmonyParser.needs_tokens if name == HarmonyParser.name else THINK_PARSERS[name].needs_tokens


def keeps_special_tokens(name: str) -> bool:
    return HarmonyParser.keeps_special_tokens if name == HarmonyParser.name else \
        THINK_PARSERS[name].keeps_special_tokens


def check(name: str, vocab: Mapping[str, int], model: str, tool_parser: str | None = None) -> None:
    """Start-up check of ``--reasoning-parser``: ValueError with one line when it cannot serve."""
    if name not in NAMES:
        raise ValueError(f"--reasoning-parser {name!r} is not one of: {', '.join(sorted(NAMES))}")
    missing = [t for t in needs_tokens(name) if t not in vocab]
    if missing:
        raise ValueError(f"--reasoning-parser {name} cannot be used with the tokenizer of {model!r}: "
                         f"it has no {missing[0]!r} token")
    if (name == HarmonyParser.name) != (tool_parser == "openai") and tool_parser is not None:
        raise ValueError(f"--reasoning-parser {name} and --tool-call-parser {tool_parser} do not go together: "
                         "gpt-oss (harmony) output needs both set to openai_gptoss / openai")


def make_think(name: str, vocab: Mapping[str, int], specials: Sequence[str], thinking: bool) -> ReasoningParser:
    return THINK_PARSERS[name](vocab, specials, thinking)
