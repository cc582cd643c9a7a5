"""Tools in ``/v1/chat/completions``: ``tools`` + ``tool_choice`` enforced with
structured outputs, ``tool_calls`` in the answer, and assistant ``tool_calls`` /
``tool`` messages rendered into the prompt.

* ``tool_choice`` ``{"type": "function", "function": {"name": X}}``: the output
  follows X's ``parameters`` schema and is returned as one tool call of X;
* ``"required"``: the output is a JSON array (at least one item; one with
  ``parallel_tool_calls: false``) of ``{"name", "parameters"}`` items, one
  schema per tool (vLLM's form), returned as that many tool calls;
* ``"none"``: free text (the tools are still rendered into the prompt);
* ``"auto"`` (the default when tools are sent): free text, read afterwards by
  the server's tool-call parser (``--enable-auto-tool-choice --tool-call-parser
  NAME``, ``tool_parsers``), streamed as its deltas; without one it is refused
  with vLLM's 400 message.

``finish_reason`` is ``"tool_calls"`` when the call is complete; an output cut by
``max_tokens`` keeps ``"length"`` and returns its raw text as content.

With a tool-call parser that has a vLLM structural tag (``hermes``), named and
"required" go vLLM's way instead: the output follows the parser's grammar of
``<tool_call>`` blocks (``tool_grammar``) and the parser reads the calls
(``openai_tools_auto``).

Rendering: a chat template that mentions ``tool_calls`` or ``tools`` gets the
messages as transformers expects them (``arguments`` as objects) and
``tools=``. One that mentions neither (e.g. SmolLM2's) gets what vLLM's
rendering gives it: no tool list, and a call's message with its content only
(``as_vllm_renders``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from pagedserve.frontend.core.errors import ApiError
from pagedserve.frontend.openai_api.openai_options import OpenAIOptions
from pagedserve.frontend.openai_api import openai_tools_auto, tool_grammar
from pagedserve.frontend.openai_api.openai_structured import TOOL_FIELDS
from pagedserve.frontend.core.outputs import Chunk
from pagedserve.frontend.openai_api.tool_parsers import PARSERS
from pagedserve.frontend.openai_api.tool_parsers.base import tool_call_id
from pagedserve.frontend.core.validation import ValidationError
from pagedserve.v1 import generation_pb2 as pb

MAX_TOOLS = 128
MAX_TOOL_CALLS_IN_MESSAGE = 64
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# vLLM's words, for "auto" on a server started without a parser
AUTO_REFUSED = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ToolMode:
    name: str | None  # a named function; None: "required" or "auto"
    schema: str | None  # JSON schema text the output follows; None: free text ("auto")
    parser: str | None = None  # "auto": the tool-call parser that reads the output
    parallel: bool | None = None  # parallel_tool_calls; False: only the first call is kept
    grammar: str | None = None  # EBNF the output follows (a parser's structural tag: tool_grammar)
    choice: str = "auto"  # "auto", "required" or "named": how a parser's calls are finished
    tools: Any = None  # the request's tools, for a parser that types arguments by their schema


def _tool_list(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise ValidationError("tools", f"must be a list of 1 to {MAX_TOOLS} tools")
    out: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValidationError("tools", 'each tool must be {"type": "function", "function": {...}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValidationError("tools", "each function name must be 1 to 64 letters, digits, _ or -")
        if name in out:
            raise ValidationError("tools", f"function {name!r} is defined twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValidationError("tools", f"function {name!r}: parameters must be a JSON schema object")
        out[name] = params
    return out


def take_tools(body: dict[str, Any], opts: OpenAIOptions | None = None
               ) -> tuple[ToolMode | None, list[dict[str, Any]] | None, dict[str, Any]]:
    """(the enforced or parsed mode, the tools to render, the body without tool fields)."""
    rest = {k: v for k, v in body.items() if k not in TOOL_FIELDS}
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ValidationError("parallel_tool_calls", "must be true or false")
    if tools is None:
        if choice not in (None, "none"):
            raise ValidationError("tool_choice", "needs tools")
        return None, None, rest
    funcs = _tool_list(tools)
    auto = opts is not None and opts.enable_auto_tool_choice and opts.tool_call_parser in PARSERS
    if choice is None or choice == "auto":
        if not auto or opts is None:
            raise ApiError(400, AUTO_REFUSED, param="tool_choice")
        return _tagged(opts.tool_call_parser, tools, choice, parallel), tools, rest
    if choice == "none":
        return None, tools, rest
    if auto and opts is not None and PARSERS[opts.tool_call_parser].structural_tag is not None and \
            (choice == "required" or (isinstance(choice, dict) and _named(choice) in funcs)):
        return _tagged(opts.tool_call_parser, tools, choice, parallel), tools, rest
    if choice == "required":
        items = [{"properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                  "required": ["name", "parameters"]} for n, p in funcs.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolMode(None, json.dumps(schema)), tools, rest
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict):
        raise ValidationError("tool_choice", 'must be "none", "required", "auto" or '
                                             '{"type": "function", "function": {"name": ...}}')
    name = fn.get("name")
    if name not in funcs:
        raise ValidationError("tool_choice", f"function {name!r} is not among the tools")
    return ToolMode(name, json.dumps(funcs[name])), tools, rest


def _named(choice: dict[str, Any]) -> Any:
    fn = choice.get("function")
    return fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None


def _tagged(parser: str, tools: list[dict[str, Any]], choice: Any, parallel: bool | None) -> ToolMode:
    """A parser-read mode; with a structural-tag parser (hermes), vLLM's grammar of its calls."""
    kind = "auto" if choice in (None, "auto") else "required" if choice == "required" else "named"
    grammar = None
    model = PARSERS[parser].structural_tag
    if model is not None:
        tag = tool_grammar.structural_tag(tools, choice, parallel, model)
        grammar = None if tag is None else tool_grammar.to_ebnf(tag)
    return ToolMode(None, None, parser, parallel, grammar, kind, tools)


def enforce(mode: ToolMode, sp: pb.SamplingParams) -> None:
    if mode.schema is None and mode.grammar is None:  # "auto": the model writes what it likes
        return
    if sp.HasField("structured_outputs"):
        if mode.choice == "auto":  # vLLM keeps the request's own (it ORs in strict tools' calls: not here)
            return
        if mode.schema is None:  # vLLM: a forced call's grammar replaces the request's structured output
            sp.ClearField("structured_outputs")
        else:
            raise ValidationError("tool_choice", "cannot be combined with response_format or another "
                                                 "structured-output field")
    if mode.grammar is not None:
        sp.structured_outputs.grammar = mode.grammar
    else:
        sp.structured_outputs.json = mode.schema or ""


# ------------------------------------------------------------------ messages
def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> template messages (text content; tool calls kept)."""
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages", "must be a non-empty list")
    conv: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValidationError("messages", "each message needs a role and content")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValidationError("messages", "only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        calls = m.get("tool_calls")
        if calls is not None and m["role"] != "assistant":
            raise ValidationError("messages.tool_calls", "only assistant messages carry tool calls")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ValidationError("messages", "content must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if calls is not None:
            msg["tool_calls"] = _calls(calls)
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise ValidationError("messages.tool_call_id", "must be a string")
            msg["tool_call_id"] = m["tool_call_id"]
        conv.append(msg)
    return conv


def as_vllm_renders(conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: Any
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """vLLM hands tools and tool calls to the chat template as they are: a template
    that names neither (SmolLM2's) renders no tool list and an empty assistant
    content for a call. So for such a template they are left out here, and
    render_chat's plain tool form (for templates without tool support) is not used."""
    text = str(template or "")
    if "tool_calls" in text or "tools" in text:
        return conv, tools
    return [{k: v for k, v in m.items() if k != "tool_calls"} for m in conv], None


def _calls(calls: Any) -> list[dict[str, Any]]:
    p = "messages.tool_calls"
    if not isinstance(calls, list) or len(calls) > MAX_TOOL_CALLS_IN_MESSAGE:
        raise ValidationError(p, f"must be a list of at most {MAX_TOOL_CALLS_IN_MESSAGE} calls")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or c.get("type", "function") != "function":
            raise ValidationError(p, 'each call must be {"type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ValidationError(p, f"arguments of {fn['name']!r} are not valid JSON") from None
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


# ------------------------------------------------------------------ answers
def tool_calls(mode: ToolMode, text: str) -> list[dict[str, Any]] | None:
    """The calls an output spells, or None when it is not complete JSON."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if mode.name is not None:
        pairs = [(mode.name, value)]
    else:
        if not isinstance(value, list) or not all(isinstance(v, dict) and "name" in v for v in value):
            return None
        pairs = [(str(v["name"]), v.get("parameters", {})) for v in value]
    return [{"id": tool_call_id(), "type": "function",
             "function": {"name": n, "arguments": json.dumps(a)}} for n, a in pairs]


def choice_formatter(mode: ToolMode, logprobs: Callable[..., Any], send_ids: bool = False
                     ) -> Callable[[Chunk, dict[str, Any] | None], dict[str, Any] | None]:
    """The gateway's chat choice builder for a tool-enforced or auto request."""
    if mode.parser is not None:
        return openai_tools_auto.formatter(mode.parser, mode.parallel, logprobs, mode.choice, send_ids, mode.tools)

    def finish(c: Chunk, calls: list[dict[str, Any]] | None) -> str | None:
        if c.finish_reason == "stop" and calls is not None:
            return "tool_calls"
        return c.finish_reason

    def build(c: Chunk, acc: dict[str, Any] | None) -> dict[str, Any]:
        if acc is None:  # non-streaming
            calls = tool_calls(mode, c.text) if c.finish_reason == "stop" else None
            msg: dict[str, Any] = {"role": "assistant", "content": None if calls else c.text}
            if calls:
                msg["tool_calls"] = calls
            return {"index": c.index, "message": msg, "logprobs": logprobs(c),
                    "finish_reason": finish(c, calls), "stop_reason": c.stop_reason}
        delta: dict[str, Any] = {}
        if not acc.get("role_sent"):
            acc["role_sent"] = True
            delta["role"] = "assistant"
        acc["text"] = acc.get("text", "") + c.text
        calls = None
        if mode.name is not None:  # the name is known: stream the arguments as they come
            call: dict[str, Any] = {"index": 0, "function": {"arguments": c.text}}
            if "role" in delta:
                call.update(id=tool_call_id(), type="function")
                call["function"]["name"] = mode.name
            if c.text or "role" in delta:
                delta["tool_calls"] = [call]
            calls = [call] if c.finish_reason == "stop" else None
        elif c.finish_reason is not None:  # "required": the calls are known once the array is complete
            calls = tool_calls(mode, acc["text"]) if c.finish_reason == "stop" else None
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            else:
                delta["content"] = acc["text"]
        return {"index": c.index, "delta": delta, "logprobs": logprobs(c, acc.setdefault("lp_context", [])),
                "finish_reason": finish(c, calls)}

    return build
