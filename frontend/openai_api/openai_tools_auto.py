"""Answers read by the server's tool-call parser (``tool_parsers``) as vLLM's
chat server reads them: ``tool_choice: "auto"``, and named or ``"required"``
with a structural-tag parser (hermes: the output then follows vLLM's grammar
of ``<tool_call>`` blocks, ``tool_grammar``).

* Whole answer: ``content`` (None when only whitespace is left beside calls;
  ``""`` for named and required, vLLM's ``content or ""``) and ``tool_calls``;
  ``finish_reason`` is ``"tool_calls"`` for auto whenever a call was parsed
  (even one cut by ``max_tokens``), for required whenever the output stopped,
  never for named (the engine's reason).
* Stream: one parser per choice, fed each text delta; a delta the parser holds
  back sends no chunk (unless it carries logprobs, token ids or the finish);
  ``"tool_calls"`` replaces ``"stop"`` once any call delta was sent (not for named).
* ``parallel_tool_calls: false`` keeps the first call only (index 0).
"""
from __future__ import annotations

from typing import Any, Callable

from pagedserve.frontend.core.outputs import Chunk
from pagedserve.frontend.openai_api.tool_parsers import PARSERS

Choice = dict[str, Any]


def formatter(parser: str, parallel: bool | None, logprobs: Callable[..., Any], choice: str = "auto",
              send_ids: bool = False, tools: Any = None) -> Callable[[Chunk, dict[str, Any] | None], Choice | None]:
    """``choice``: "auto", "required" or "named"; ``send_ids``: the request asked for
    token ids, so a held-back delta still sends its chunk (vLLM's return_token_ids)."""
    cls = PARSERS[parser]

    def make() -> Any:
        p = cls()
        p.tools = tools
        return p

    def whole(c: Chunk) -> Choice:
        content, calls = make().parse(c.text)
        if parallel is False:
            calls = calls[:1]
        if choice != "auto":
            content = content or ""
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
        finish = c.finish_reason
        if (choice == "auto" and calls) or (choice == "required" and finish == "stop"):
            finish = "tool_calls"
        return {"index": c.index, "message": msg, "logprobs": logprobs(c), "finish_reason": finish,
                "stop_reason": c.stop_reason}

    def build(c: Chunk, acc: dict[str, Any] | None) -> Choice | None:
        if acc is None:
            return whole(c)
        if "parser" not in acc:
            acc["parser"] = make()
        finished = c.finish_reason is not None
        msg = acc["parser"].feed(c.text, finished)
        if msg is not None and msg.get("tool_calls"):
            acc["called"] = True
            if parallel is False:
                msg["tool_calls"] = [t for t in msg["tool_calls"] if t["index"] == 0]
                if not msg["tool_calls"]:
                    del msg["tool_calls"]
        lp = logprobs(c, acc.setdefault("lp_context", []))
        first = not acc.get("role_sent")
        if msg is None and not finished and lp is None and not first and not (send_ids and c.token_ids):
            return None  # the parser holds this text back (a tag may be starting)
        delta: dict[str, Any] = dict(msg or {})
        if first:
            acc["role_sent"] = True
            delta = {"role": "assistant", **({"content": ""} if msg is None else {}), **delta}
        finish = c.finish_reason
        if finish == "stop" and acc.get("called") and choice != "named":
            finish = "tool_calls"
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    return build
