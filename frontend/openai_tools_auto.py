"""``tool_choice: "auto"`` answers: the output read by the server's tool-call
parser (``tool_parsers``) as vLLM's chat server does with it.

* Whole answer: ``content`` (None when only whitespace is left beside calls)
  and ``tool_calls``; ``finish_reason`` is ``"tool_calls"`` whenever a call
  was parsed (even one cut by ``max_tokens``, as vLLM).
* Stream: one parser per choice, fed each text delta; a delta the parser holds
  back sends no chunk (unless it carries logprobs or the finish);
  ``"tool_calls"`` replaces ``"stop"`` once any call delta was sent.
* ``parallel_tool_calls: false`` keeps the first call only (index 0).
"""
from __future__ import annotations

from typing import Any, Callable

from pagedserve.frontend.outputs import Chunk
from pagedserve.frontend.tool_parsers import PARSERS

Choice = dict[str, Any]


def formatter(parser: str, parallel: bool | None,
              logprobs: Callable[[Chunk], Any]) -> Callable[[Chunk, dict[str, Any] | None], Choice | None]:
    cls = PARSERS[parser]

    def whole(c: Chunk) -> Choice:
        content, calls = cls().parse(c.text)
        if parallel is False:
            calls = calls[:1]
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        return {"index": c.index, "message": msg, "logprobs": logprobs(c),
                "finish_reason": "tool_calls" if calls else c.finish_reason, "stop_reason": c.stop_reason}

    def build(c: Chunk, acc: dict[str, Any] | None) -> Choice | None:
        if acc is None:
            return whole(c)
        if "parser" not in acc:
            acc["parser"] = cls()
        finished = c.finish_reason is not None
        msg = acc["parser"].feed(c.text, finished)
        if msg is not None and msg.get("tool_calls"):
            acc["called"] = True
            if parallel is False:
                msg["tool_calls"] = [t for t in msg["tool_calls"] if t["index"] == 0]
                if not msg["tool_calls"]:
                    del msg["tool_calls"]
        lp = logprobs(c)
        first = not acc.get("role_sent")
        if msg is None and not finished and lp is None and not first:
            return None  # the parser holds this text back (a tag may be starting)
        delta: dict[str, Any] = dict(msg or {})
        if first:
            acc["role_sent"] = True
            delta = {"role": "assistant", **({"content": ""} if msg is None else {}), **delta}
        finish = c.finish_reason
        if finish == "stop" and acc.get("called"):
            finish = "tool_calls"
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    return build
