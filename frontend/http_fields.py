"""The OpenAI body fields each HTTP route understands. Any other field is
refused with 400 naming it, so a client never gets an answer that silently
ignored part of its request. A field sent as null counts as absent (OpenAI's
meaning of null: the default).

Structured outputs and tools (``response_format``, ``tools``, ...) are parsed
by their own code in the gateway; this check leaves them to it.
"""
from __future__ import annotations

from typing import Any

from pagedserve.frontend.errors import ApiError

# Sampling fields both generation routes take (http_gateway._sampling reads them).
_SAMPLING = frozenset({
    "model", "stream", "stream_options", "n", "best_of", "temperature", "top_p", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "max_tokens", "max_completion_tokens",
    # OpenAI's end-user id: accepted and unused (documented in docs/api.md), as vLLM does.
    "user",
    # vLLM-style extras
    "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "stop_token_ids",
    "include_stop_str_in_output", "beam_width", "use_beam_search", "length_penalty", "early_stopping",
    "prompt_logprobs", "cache_salt",
})
COMPLETION_FIELDS = _SAMPLING | {"prompt", "echo", "logprobs", "suffix"}
CHAT_FIELDS = _SAMPLING | {"messages", "logprobs", "top_logprobs"}
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
STREAM_OPTIONS_FIELDS = frozenset({"include_usage"})

# Owned by the structured-outputs code; not judged here.
_DELEGATED = frozenset({"response_format", "tools", "tool_choice", "parallel_tool_calls", "functions",
                        "function_call", "structured_outputs"})
_DELEGATED_PREFIXES = ("guided_",)


def check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """Raises ApiError(400) naming the first field (sorted) that is not understood."""
    unknown = sorted(k for k, v in body.items() if v is not None and k not in allowed and k not in _DELEGATED
                     and not k.startswith(_DELEGATED_PREFIXES))
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not supported by pagedserve (unsupported fields: "
                            f"{', '.join(unknown[:8])})", param=unknown[0], code="unsupported_field")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError(400, "stream_options: must be an object", param="stream_options")
        bad = sorted(k for k, v in opts.items() if v is not None and k not in STREAM_OPTIONS_FIELDS)
        if bad:
            raise ApiError(400, f"stream_options.{bad[0]}: not supported by pagedserve",
                           param=f"stream_options.{bad[0]}", code="unsupported_field")
