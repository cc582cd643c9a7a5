"""``mistral`` with a Hugging Face tokenizer (vLLM's "pre-v11" path: the
vocabulary has ``[TOOL_CALLS]`` but no ``[ARGS]``): the calls follow the
marker as a JSON array (or one object) of ``{"name", "arguments"}``, text
before it is content. Call ids are 9 random letters and digits, as Mistral's
chat format requires."""
from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from pagedserve.frontend.openai_api.tool_parsers.base import Call, Delta, ToolParser, call, dumps

BOT = "[TOOL_CALLS]"
_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)
_ALNUM = string.ascii_letters + string.digits


def mistral_id() -> str:
    return "".join(random.choices(_ALNUM, k=9))


def _functions(parsed: Any) -> list[Call]:
    """A bare object is one call; items that are not calls are skipped; a bad name is ""."""
    if isinstance(parsed, dict):
        parsed = [parsed]
    if not isinstance(parsed, list):
        return []
    out = []
    for c in parsed:
        if not isinstance(c, dict) or not ("name" in c or "arguments" in c):
            continue
        name, args = c.get("name"), c.get("arguments")
        args = "{}" if args is None else args if isinstance(args, str) else dumps(args)
        out.append(call(name if isinstance(name, str) else "", args, mistral_id()))
    return out


class MistralParser(ToolParser):
    name = "mistral"
    needs_token = BOT

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        if BOT not in text:
            return text, []
        # repeated markers with nothing between count as one; text after a later marker is dropped
        content, *segments = text.split(BOT)
        body = next((s.strip() for s in segments if s.strip()), "")
        try:
            parsed, _ = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            try:
                parsed = json.loads(_ARRAY.findall(body)[0])
            except (IndexError, json.JSONDecodeError):
                parsed = None
        calls = _functions(parsed)
        if not calls:
            return body, []  # vLLM answers the text after the marker
        return (content if content and content.strip() else None), calls

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        content, calls = super().parse(text)
        return (content or None), calls  # an engine-based parser in vLLM: "" content is None

    def extract_streaming(self, previous: str, current: str, delta: str) -> Delta | None:
        # Content streams as vLLM's until the marker; the calls after it are sent whole at the
        # finish (vLLM streams them in pieces: not built yet).
        if BOT in previous:
            return None
        if BOT in current:
            before = current[:current.index(BOT)][len(previous):]
            return {"content": before} if before else None
        return {"content": delta}

    def feed(self, delta: str, finished: bool) -> Delta | None:
        msg = super().feed(delta, finished)
        if not finished or BOT not in self._text:
            return msg
        _, calls = self.extract(self._text)
        if not calls:
            return msg
        out: Delta = dict(msg or {})
        out["tool_calls"] = [{"id": c["id"], "type": "function", "index": i, "function": dict(c["function"])}
                             for i, c in enumerate(calls)]
        return out
