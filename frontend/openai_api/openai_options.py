"""The OpenAI API's server-side options: what ``vllm serve`` flags set for its
OpenAI server (``--response-role``, ``--chat-template``, ``--max-logprobs``,
``--generation-config``, ``--enable-auto-tool-choice``, ...). Built once from
the frontend's flags (``service``), read by the HTTP routes; frozen, one owner.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OpenAIOptions:
    response_role: str = "assistant"  # the role of the generated chat message
    chat_template: str | None = None  # Jinja text that replaces the tokenizer's; None: the tokenizer's
    trust_request_chat_template: bool = False  # a request's own chat_template is refused unless set (vLLM)
    max_logprobs: int = 20  # the most logprobs / top_logprobs / prompt_logprobs a request may ask for
    # Sampling defaults a request's own fields override (vLLM's --generation-config auto: the model's
    # generation_config.json; plus --override-generation-config). Keys are SamplingParams names
    # (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens).
    default_sampling: dict[str, Any] = field(default_factory=dict)
    # vLLM's override_max_tokens: a cap on every request's max_tokens (--override-generation-config's
    # max_new_tokens; with a --generation-config folder, that folder's). None: no cap.
    override_max_tokens: int | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a name in tool_parsers.PARSERS
    reasoning_parser: str | None = None  # a name in reasoning.NAMES (--reasoning-parser)
    log_requests: bool = False  # log each request's id and parameters (vLLM's --enable-log-requests)
    allowed_origins: tuple[str, ...] = ()  # CORS; ("*",) allows any
    allowed_methods: tuple[str, ...] = ("*",)  # CORS (vLLM's --allowed-methods)
    allowed_headers: tuple[str, ...] = ("*",)  # CORS (vLLM's --allowed-headers)
    allow_credentials: bool = False  # CORS (vLLM's --allow-credentials)
    root_path: str = ""  # a prefix a proxy strips before us (vLLM's --root-path)
