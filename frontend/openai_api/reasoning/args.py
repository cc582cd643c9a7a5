"""``--reasoning-parser``, spelled and meant as vLLM 0.32's: ``pagedserve
serve`` parses it and hands it to the frontend as its own flag."""
from __future__ import annotations

import argparse

from pagedserve.common.config import helptext
from pagedserve.frontend.openai_api.reasoning import NAMES

# The issue's and gpt-oss users' name for harmony; vLLM 0.32 itself knows only openai_gptoss.
ALIASES = {"openai": "openai_gptoss"}


def add_reasoning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reasoning-parser", default=None, choices=[*NAMES, *ALIASES],
                   help=helptext("split the model's thinking into the answer's reasoning field, as vLLM's "
                                 "parser of the same name (openai_gptoss, or openai: gpt-oss's harmony)", None))


def reasoning_argv(args: argparse.Namespace) -> list[str]:
    value = getattr(args, "reasoning_parser", None)
    return [] if value is None else ["--reasoning-parser", ALIASES.get(value, value)]
