"""The OpenAI server's flags, spelled and meant as vLLM 0.32's (``FrontendArgs``
and the engine's ``--generation-config``): ``pagedserve serve`` parses them,
checks them before anything loads (``check_openai_args``) and hands them to the
frontend as its own flags (``openai_argv``); the frontend turns them into one
``OpenAIOptions`` once its tokenizer is loaded (``build_options``). A container
sets them on the frontend's command line (no variable mirrors them)."""
from __future__ import annotations

import argparse
import codecs
import json
import os
from typing import Any

from pagedserve.common.config import helptext, json_object
from pagedserve.frontend.openai_api.openai_options import OpenAIOptions
from pagedserve.frontend.core.tokenizer_files import generation_file_values
from pagedserve.frontend.openai_api.tool_parsers import PARSERS

TOOL_CALL_PARSERS = tuple(PARSERS)  # frontend/openai_api/tool_parsers
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
# generation_config.json fields that become sampling defaults (vLLM's get_diff_sampling_param).
SAMPLING_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                   "min_p", "max_new_tokens")
MAX_CHAT_TEMPLATE_CHARS = 1 << 20
MAX_LIST_ITEMS, MAX_ITEM_CHARS = 64, 256  # --allowed-origins/-methods/-headers
MAX_LOGPROBS_LIMIT = 1 << 20


def json_list(text: str) -> tuple[str, ...]:
    """vLLM's json.loads type for --allowed-origins/-methods/-headers: a JSON list of strings."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}; e.g. '[\"https://example.com\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("a JSON list of strings expected, e.g. '[\"https://example.com\"]'")
    if len(value) > MAX_LIST_ITEMS or any(len(v) > MAX_ITEM_CHARS for v in value):
        raise argparse.ArgumentTypeError(f"at most {MAX_LIST_ITEMS} entries of {MAX_ITEM_CHARS} characters")
    return tuple(value)


def add_openai_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI server (vLLM's flags)")

    def arg(*flags: str, default: Any, text: str, **kw: Any) -> None:
        g.add_argument(*flags, default=default, help=helptext(text, None), **kw)

    arg("--response-role", default="assistant",
        text="role of the generated chat message when the request's last message does not ask for one")
    arg("--chat-template", default=None,
        text="a Jinja chat template file, or the template itself inline; replaces the tokenizer's for "
             "every API (chat, /tokenize, gRPC); none: the tokenizer's")
    arg("--max-logprobs", default=20, type=int,
        text="most logprobs / top_logprobs / prompt_logprobs a request may ask for; -1: the vocabulary size")
    arg("--generation-config", default="auto",
        text="sampling defaults: auto: the model folder's generation_config.json (temperature, top_p, top_k, "
             "min_p, repetition/presence/frequency penalties, max_new_tokens as max_tokens); vllm: none; "
             "or a folder with a generation_config.json")
    arg("--override-generation-config", default=None, type=json_object,
        text="JSON object over --generation-config's, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 64}'")
    arg("--enable-log-requests", default=False,
        action=argparse.BooleanOptionalAction, text="log each request's id and sampling parameters")
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   default=False,
                   help=helptext("same as --no-enable-log-requests (vLLM's earlier spelling); "
                                 "--enable-log-requests", None))
    arg("--disable-log-stats", default=False,
        action="store_true", text="no periodic engine stats lines (every 10 s while busy) in the log")
    arg("--uvicorn-log-level", default="info", choices=list(LOG_LEVELS),
        text="level of the HTTP server's own log (aiohttp here; trace: debug)")
    arg("--trust-request-chat-template",
        default=False, action="store_true",
        text="let a request's own chat_template (or chat_template_kwargs' one) render its prompt; off: 400")
    arg("--allowed-origins", default=(), type=json_list,
        text="CORS: a JSON list of origins browsers may call from, '[\"*\"]' for any; none: no CORS")
    arg("--allowed-methods", default=("*",), type=json_list,
        text="CORS: a JSON list of methods")
    arg("--allowed-headers", default=("*",), type=json_list,
        text="CORS: a JSON list of request headers")
    arg("--allow-credentials", default=False,
        action="store_true", text="CORS: allow credentials (cookies, Authorization) on cross-origin calls")
    arg("--root-path", default="",
        text="path prefix a proxy in front strips (e.g. /llm); also accepted on the requests themselves")
    arg("--enable-auto-tool-choice",
        default=False, action="store_true",
        text="tool_choice \"auto\": the model decides, its tool calls parsed by --tool-call-parser (required)")
    arg("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
        text="how tool calls are read from the model's text, as vLLM's parser of the same name")


def load_chat_template(value: str) -> str:
    """vLLM's rule: a file that opens is read; otherwise text with any of ``{}``
    or a newline is the template itself (its backslash escapes decoded), and
    anything else is a path that failed to open."""
    try:
        with open(value) as f:
            text = f.read(MAX_CHAT_TEMPLATE_CHARS + 1)
    except OSError as e:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template: {value!r} looks like a file path, but it failed to be opened: "
                             f"{e.strerror}") from None
        text = codecs.decode(value, "unicode_escape")
    if len(text) > MAX_CHAT_TEMPLATE_CHARS:
        raise ValueError(f"--chat-template: at most {MAX_CHAT_TEMPLATE_CHARS} characters")
    return text


def check_openai_args(args: argparse.Namespace) -> None:
    """Before anything loads; a ValueError names the flag (vLLM's validate_parsed_serve_args, and our bounds)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if not 1 <= len(args.response_role) <= 64 or not args.response_role.isprintable():
        raise ValueError(f"--response-role: 1 to 64 printable characters, got {args.response_role!r}")
    if not -1 <= args.max_logprobs <= MAX_LOGPROBS_LIMIT:
        raise ValueError(f"--max-logprobs must be in [-1, {MAX_LOGPROBS_LIMIT}], got {args.max_logprobs}")
    root = args.root_path
    if root and (not root.startswith("/") or len(root) > 256 or any(c in root for c in "?#% \t\n")):
        raise ValueError(f"--root-path: a path such as /llm (at most 256 characters), got {root!r}")
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(args.generation_config):
        raise ValueError(f"--generation-config: auto, vllm or a folder, got {args.generation_config!r} "
                         "(no such folder)")
    if args.chat_template is not None:
        load_chat_template(args.chat_template)


def openai_argv(args: argparse.Namespace) -> list[str]:
    """The flags that rebuild these options in the frontend process."""
    out = ["--response-role", args.response_role, "--max-logprobs", str(args.max_logprobs),
           "--generation-config", args.generation_config, "--uvicorn-log-level", args.uvicorn_log_level,
           "--allowed-origins", json.dumps(list(args.allowed_origins)),
           "--allowed-methods", json.dumps(list(args.allowed_methods)),
           "--allowed-headers", json.dumps(list(args.allowed_headers)), "--root-path", args.root_path,
           "--enable-log-requests" if args.enable_log_requests else "--no-enable-log-requests"]
    for flag, value in (("--chat-template", args.chat_template), ("--tool-call-parser", args.tool_call_parser),
                        ("--override-generation-config", args.override_generation_config)):
        if value is not None:
            out += [flag, value]
    for flag, on in (("--disable-log-stats", args.disable_log_stats), ("--allow-credentials", args.allow_credentials),
                     ("--enable-auto-tool-choice", args.enable_auto_tool_choice),
                     ("--trust-request-chat-template", args.trust_request_chat_template)):
        if on:
            out.append(flag)
    return out


def _from_model_config(folder: str, trust_remote_code: bool) -> dict[str, Any]:
    """No generation_config.json: what config.json says (as vLLM), through transformers."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return {}
    from transformers import AutoConfig, GenerationConfig
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its "flags are not valid" note: sampling fields with do_sample off
    try:
        return dict(GenerationConfig.from_model_config(
            AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)).to_diff_dict())
    except OSError:
        return {}
    finally:
        hf_logging.set_verbosity(level)


def generation_defaults(source: str, model_dir: str, override: str | None, trust_remote_code: bool = False
                        ) -> dict[str, Any]:
    """Sampling defaults as vLLM's ModelConfig.get_diff_sampling_param: the
    generation config's fields that differ from transformers' defaults (auto:
    the model's; vllm: none; else that folder's), the override on top, the
    sampling ones kept, max_new_tokens renamed max_tokens."""
    config: dict[str, Any] = {}
    if source != "vllm":
        folder = model_dir if source == "auto" else source
        # generation_config.json read as transformers reads it, without importing transformers
        # (and so torch) into the frontend; only a folder without one takes transformers' rules.
        found = generation_file_values(folder, SAMPLING_FIELDS)
        config = found if found is not None else _from_model_config(folder, trust_remote_code)
    if override is not None:
        config.update(json.loads(override))
    out = {k: config[k] for k in SAMPLING_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def build_options(args: argparse.Namespace, model_dir: str, vocab_size: int) -> OpenAIOptions:
    defaults = generation_defaults(args.generation_config, model_dir, args.override_generation_config,
                                   args.trust_remote_code)
    # vLLM's OpenAIServingCompletion/Chat.override_max_tokens.
    if args.generation_config not in ("auto", "vllm"):
        cap = defaults.get("max_tokens")
    else:
        cap = json.loads(args.override_generation_config or "{}").get("max_new_tokens")
    return OpenAIOptions(
        response_role=args.response_role,
        chat_template=load_chat_template(args.chat_template) if args.chat_template is not None else None,
        max_logprobs=vocab_size if args.max_logprobs == -1 else args.max_logprobs,
        default_sampling=defaults, override_max_tokens=cap,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        log_requests=args.enable_log_requests, allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers),
        allow_credentials=args.allow_credentials, root_path=args.root_path.rstrip("/"),
        trust_request_chat_template=args.trust_request_chat_template)
