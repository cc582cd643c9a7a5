"""Chat answers with ``--reasoning-parser`` (and gpt-oss's ``--tool-call-parser
openai``), as vLLM 0.32's chat server builds them:

* whole answer: the message's ``reasoning`` (vLLM 0.32's field; also sent as
  ``reasoning_content``, the earlier name that clients of older vLLM and of
  DeepSeek's API read), ``content`` (None when nothing is left) and, with
  ``tool_choice: "auto"``, the ``tool_calls`` parsed from the content after the
  reasoning; ``finish_reason`` ``"tool_calls"`` when a call was parsed;
* stream: one parser per choice; deltas carry ``reasoning`` (and
  ``reasoning_content``), ``content`` and ``tool_calls``; a delta with nothing
  to send is skipped unless it carries logprobs, token ids or the finish.

A request whose output follows a grammar from its first token (a named or
"required" tool choice, ``response_format``, ``structured_outputs``) is not
read for reasoning: vLLM lets the model think before its grammar applies,
which this engine cannot, so such an output has no reasoning to find.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Callable

from pagedserve.frontend.openai_api import reasoning
from pagedserve.frontend.core.outputs import Chunk
from pagedserve.frontend.openai_api.reasoning.compose import Composer
from pagedserve.frontend.openai_api.reasoning.harmony import HarmonyParser
from pagedserve.frontend.openai_api.tool_parsers import PARSERS

Choice = dict[str, Any]
Build = Callable[[Chunk, dict[str, Any] | None], Choice | None]
HARMONY_TOOLS = "openai"  # vLLM's --tool-call-parser name for gpt-oss


def applies(reasoning_parser: str | None, tool_call_parser: str | None) -> bool:
    return reasoning_parser is not None or tool_call_parser == HARMONY_TOOLS


def keeps_special_tokens(reasoning_parser: str | None, tool_call_parser: str | None) -> bool:
    if reasoning_parser is not None:
        return reasoning.keeps_special_tokens(reasoning_parser)
    return tool_call_parser == HARMONY_TOOLS


def _with_both(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("reasoning") is not None:
        d["reasoning_content"] = d["reasoning"]
    return d


def formatter(reasoning_parser: str | None, tool_parser: str | None, parallel: bool | None,
              vocab: Mapping[str, int], specials: Sequence[str], thinking: bool,
              prompt_ids: Sequence[int] | None, logprobs: Callable[..., Any], send_ids: bool = False,
              tools: Any = None, include: bool = True) -> Build:
    """``tool_parser``: the parser that reads ``tool_choice: "auto"`` answers; None: no tools.
    ``include``: the request's ``include_reasoning``; false drops the reasoning and, as vLLM,
    the logprobs and token ids that would spell it."""
    if not include:
        logprobs, send_ids = (lambda *a: None), False
    harmony = reasoning_parser == HarmonyParser.name or (reasoning_parser is None and tool_parser == HARMONY_TOOLS)

    def make() -> Any:
        if harmony:
            return HarmonyParser(reasoning=reasoning_parser is not None, tools=tool_parser == HARMONY_TOOLS)
        assert reasoning_parser is not None
        parser = None
        if tool_parser is not None:
            parser = PARSERS[tool_parser]()
            parser.tools = tools
            parser.reasoning_markup_is_text = False  # vLLM's skip_reasoning_parsing is off after a reasoning parser
        return Composer(reasoning.make_think(reasoning_parser, vocab, specials, thinking), parser, prompt_ids)

    def whole(c: Chunk) -> Choice:
        text_reasoning, content, calls = make().parse(c.text)
        if tool_parser is None:
            calls = []
        if parallel is False:
            calls = calls[:1]
        msg = _with_both({"role": "assistant", "content": content, "reasoning": text_reasoning if include else None})
        if calls:
            msg["tool_calls"] = calls
        finish = "tool_calls" if calls else c.finish_reason
        return {"index": c.index, "message": msg, "logprobs": logprobs(c), "finish_reason": finish,
                "stop_reason": c.stop_reason}

    def build(c: Chunk, acc: dict[str, Any] | None) -> Choice | None:
        if acc is None:
            return whole(c)
        if "parser" not in acc:
            acc["parser"] = make()
        finished = c.finish_reason is not None
        p = acc["parser"]
        msg = p.feed(c.text, finished) if harmony else p.feed(c.text, c.token_ids, finished)
        if msg is not None and not include:
            msg.pop("reasoning", None)
        if msg is not None and msg.get("tool_calls"):
            if tool_parser is None:
                del msg["tool_calls"]
            else:
                acc["called"] = True
                if parallel is False:
                    msg["tool_calls"] = [t for t in msg["tool_calls"] if t["index"] == 0]
                    if not msg["tool_calls"]:
                        del msg["tool_calls"]
        lp = logprobs(c, acc.setdefault("lp_context", []))
        if not msg and not finished and lp is None and not (send_ids and c.token_ids):
            return None
        finish = c.finish_reason
        if finish == "stop" and acc.get("called"):
            finish = "tool_calls"
        return {"index": c.index, "delta": _with_both(dict(msg or {})), "logprobs": lp, "finish_reason": finish}

    return build


_VOCABS: dict[int, tuple[Any, Mapping[str, int], tuple[str, ...]]] = {}


def _vocab(tok: Any) -> tuple[Mapping[str, int], tuple[str, ...]]:
    """The tokenizer's vocabulary and special tokens, read once per tokenizer."""
    hit = _VOCABS.get(id(tok))
    if hit is None or hit[0] is not tok:
        hit = _VOCABS[id(tok)] = (tok, tok.get_vocab(), tuple(getattr(tok, "all_special_tokens", ())))
    return hit[1], hit[2]


def extras(opts: Any, x: Any) -> Any:
    """The request's extras with special tokens kept where the parser reads them (vLLM's adjust_request)."""
    if applies(opts.reasoning_parser, opts.tool_call_parser) and \
            keeps_special_tokens(opts.reasoning_parser, opts.tool_call_parser):
        return replace(x, skip_special_tokens=False)
    return x


def choice(opts: Any, tok: Any, tool_mode: Any, x: Any, prompt_ids: Sequence[int], body: dict[str, Any],
           structured: bool, logprobs: Callable[..., Any], fallback: Build) -> Build:
    """The gateway's chat choice builder: ``fallback`` unless a reasoning (or harmony) parser reads the answer."""
    if not applies(opts.reasoning_parser, opts.tool_call_parser):
        return fallback
    if tool_mode is None:
        if structured:  # a grammar from the first token: no room to think (docs/api.md)
            return fallback
        tool_parser = None
    elif tool_mode.parser is not None and tool_mode.choice == "auto":
        tool_parser = tool_mode.parser
    else:
        return fallback
    vocab, specials = _vocab(tok)
    thinking = (x.template_kwargs or {}).get("enable_thinking", True) is not False
    return formatter(opts.reasoning_parser, tool_parser, None if tool_mode is None else tool_mode.parallel,
                     vocab, specials, thinking, prompt_ids, logprobs, x.return_token_ids,
                     None if tool_mode is None else tool_mode.tools, body.get("include_reasoning") is not False)
