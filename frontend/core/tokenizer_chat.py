"""Chat templates rendered as transformers 5.x renders them
(transformers/utils/chat_template_utils.py: ``_cached_compile_jinja_template``
and ``render_jinja_template``), without importing transformers: the same
sandboxed Jinja environment (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, the ``{% generation %}`` tag), its ``tojson``
filter, ``raise_exception``, ``strftime_now``, ``dict`` and ``namespace``
globals, and the same message handling (None-valued keys dropped, plain JSON
data only, reasoning fields aliased, ``continue_final_message``)."""
from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: rendered as its body (transformers
    tracks the span only for return_assistant_tokens_mask, which the frontend never asks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """``dict`` for templates, without attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace refusing underscore-prefixed names (transformers' TemplateNamespace)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(text)


def plain(value: Any) -> Any:
    """transformers' _plain_template_data: only JSON-like data reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def render(template: str, conversation: list[dict[str, Any]], tools: list[Any] | None,
           documents: list[Any] | None, add_generation_prompt: bool, continue_final_message: bool | str,
           kwargs: dict[str, Any]) -> str:
    """One conversation's text; ``kwargs``: the special tokens map, then the caller's template variables."""
    compiled = compile_template(template)
    for t in tools or []:
        if not isinstance(t, dict):
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                             "and a docstring suitable for auto-conversion to a schema.")
    for d in documents or []:
        if not isinstance(d, dict):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = []
    for m in conversation:
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {m!r}.")
        chat.append({k: v for k, v in m.items() if v is not None})  # transformers' _normalize_chat_messages
    chat = _alias_reasoning(plain(chat))
    final: Any = None
    if continue_final_message:
        key = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(key)
        if final is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{key}" to continue!')
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if key in _REASONING_FIELDS else [key]
        if not any(f in template for f in fields):
            raise ValueError(f'continue_final_message is set to "{key}" but this is not an accepted field in '
                             "the chat_template")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in "
                                 "the final message!")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = compiled.render(messages=chat, tools=plain(tools), documents=plain(documents),
                           add_generation_prompt=add_generation_prompt, **plain(kwargs))
    if continue_final_message:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                             "after applying the chat template!")
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
