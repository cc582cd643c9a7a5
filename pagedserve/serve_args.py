"""``pagedserve serve``'s command line, spelled as vLLM's ``vllm serve``:
the model positionally or with ``--model`` (a folder or a hub id from the
local cache), ``--host``/``--port`` for the OpenAI HTTP API (default
127.0.0.1:8000), ``--grpc-port`` for gRPC (50051), ``--api-key``,
``--served-model-name``, plus every engine flag and vLLM's OpenAI server flags
(frontend/openai_api/openai_args.py, frontend/openai_api/server_flags.py). Each flag's help states its
default and environment variable. Every other flag of vLLM 0.32's parser is
accepted with one log line saying it has no effect here, or refused
(pagedserve/vllm_flags.py); the command line is read as vLLM reads it
(``--config`` YAML, underscores, ``-O3``: pagedserve/vllm_argv.py). A flag we
cannot honour, and any error in the command line, is one stderr line that names
it (exit status 2), never a usage text, before anything loads."""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import NoReturn

from pagedserve.common.config import (DEFAULT_SHUTDOWN_TIMEOUT_S, EngineConfig, add_engine_args,  # noqa: F401
                                      config_from_args, env, helptext, shutdown_timeout_default)
from pagedserve.common.device import resolve_device
from pagedserve.common.default_model import is_gguf, served_name
from pagedserve.common.hub_cache import is_hub_id
from pagedserve.common.version import version
from pagedserve.frontend.openai_api.openai_args import add_openai_args, check_openai_args, openai_argv
from pagedserve.frontend.openai_api.reasoning.args import add_reasoning_args, reasoning_argv
from pagedserve.frontend.openai_api.server_flags import add_server_flags
from pagedserve.frontend.openai_api.tool_parsers import PARSERS
from pagedserve.vllm_argv import ArgvError, human_readable_int, model_len, normalize
from pagedserve.vllm_flags import VLLM_TOOL_CALL_PARSERS, add_vllm_flags, answer_vllm_flags

DEFAULT_HTTP_PORT = 8000  # vLLM's
DEFAULT_GRPC_PORT = 50051


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port must be in [1, 65535], got {v}")
    return v


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """argparse's errors (an unknown flag, a bad value) as one line: no usage text."""
        if message.startswith("unrecognized arguments"):
            message += " (a flag of neither pagedserve serve nor vLLM 0.32's serve)"
        refuse(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pagedserve serve",
                description="Start all four components locally and serve the OpenAI-compatible "
                            "HTTP API and the gRPC API.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as with --model (a folder, a hub id org/name, or a .gguf file)")
    p.add_argument("--version", action="version", version=f"pagedserve {version()}",
                   help="print the version and exit")
    add_engine_args(p)
    p.set_defaults(shutdown_timeout=shutdown_timeout_default())
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help=helptext("names the OpenAI API accepts in 'model'; the first is reported by /v1/models "
                                 "and in the model_name metrics label; none: the model as given (a .gguf file: "
                                 "its name less .gguf)", None))
    p.add_argument("--revision", default="main",
                   help=helptext("of a hub id: a ref under refs/ in the cache, or a commit hash", None))
    p.add_argument("--host", default=env("HOST", "127.0.0.1"),
                   help=helptext("address the HTTP and gRPC APIs listen on; 0.0.0.0 exposes them", "HOST"))
    p.add_argument("--port", "--http-port", dest="port", type=_port, default=env("HTTP_PORT", DEFAULT_HTTP_PORT),
                   help=helptext("port of the OpenAI-compatible HTTP API (/v1/..., /metrics, /health)",
                                 "HTTP_PORT"))
    p.add_argument("--grpc-port", type=_port, default=env("GRPC_PORT", DEFAULT_GRPC_PORT),
                   help=helptext("port of the gRPC API pagedserve.v1.Generation", "GRPC_PORT"))
    # No default shown from the variable: --help would print the key (it is read after parsing).
    p.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help=helptext("require 'Authorization: Bearer KEY' on both APIs, any of these keys (the "
                                 "variable: space-separated); handed to the frontend in its environment, never "
                                 "on a command line or in a log", "API_KEY"))
    p.add_argument("--api-key-file", default=env("API_KEY_FILE"),
                   help=helptext("accepted keys, one per line", "API_KEY_FILE"))
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help=helptext("seconds to wait for the engine to load and answer", None))
    p.add_argument("--ssl-certfile", default=env("TLS_CERT"),
                   help=helptext("PEM certificate chain: serve HTTP and gRPC over TLS", "TLS_CERT"))
    p.add_argument("--ssl-keyfile", default=env("TLS_KEY"), help=helptext("PEM private key of --ssl-certfile",
                                                                          "TLS_KEY"))
    add_openai_args(p)
    add_reasoning_args(p)  # --reasoning-parser (frontend/openai_api/reasoning)
    add_server_flags(p)
    p.add_argument("--config", metavar="FILE.yaml",
                   help="vLLM's config file: a YAML mapping of flag names (without dashes) to values; the "
                        "command line's own flags win (default: none)")
    p.add_argument("--download-dir", default=None,
                   help="a Hugging Face cache folder where a hub id org/name is looked up (instead of "
                        "$HF_HUB_CACHE); nothing is downloaded (default: none)")
    for a in p._actions:  # vLLM's values: every name answered in one line (_refusals, _vllm_values)
        if a.dest == "tool_call_parser":
            a.choices = None
            a.metavar = "{" + ",".join(sorted(PARSERS)) + "}"
        elif a.dest == "attention_backend":
            a.choices = None
        elif a.dest in ("max_model_len", "max_num_batched_tokens"):  # vLLM's 32k, 1K, auto
            a.type = model_len if a.dest == "max_model_len" else human_readable_int
    g = p.add_argument_group("accepted for vLLM's command lines; other values are refused")
    g.add_argument("--quantization", "-q", default=None,
                   help=helptext("none, or gguf for a .gguf model (its blocks stay quantized: Q4_0, Q4_1, "
                                 "Q5_0, Q5_1, Q8_0, Q4_K, Q6_K); other methods are refused", None))
    g.add_argument("--enable-lora", action="store_true", default=False,
                   help=helptext("refused: LoRA adapters are not supported", None))
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help=helptext("1 only (shard over GPUs with --tensor-parallel-size)", None))
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help=helptext("1 only: one engine per serve; for N replicas see docs/deployment.md "
                                 "(scale-out)", None))
    add_vllm_flags(p)
    return p


def refuse(message: str) -> NoReturn:
    """A flag we cannot honour: one line on stderr, argparse's exit status, no usage text."""
    print(f"pagedserve serve: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _refusals(args: argparse.Namespace) -> None:
    parser = args.tool_call_parser
    if parser is not None and parser not in PARSERS:
        refuse(f"--tool-call-parser {parser}: " + (
            "vLLM's parser of that name is not implemented here" if parser in VLLM_TOOL_CALL_PARSERS
            else "no such parser (nor in vLLM 0.32)") + f"; implemented: {', '.join(sorted(PARSERS))}")
    if args.quantization == "gguf":  # vLLM's flag for a .gguf model; its blocks stay quantized (gpuworker)
        if not (args.model and is_gguf(args.model)):
            refuse("--quantization gguf: the model must be a .gguf file")
    elif args.quantization not in (None, "none", "None"):
        refuse(f"--quantization {args.quantization}: not supported (quantized kernels serve GGUF blocks only); "
               "serve the unquantized model, or a .gguf file (its blocks stay quantized)")
    if args.enable_lora:
        refuse("--enable-lora: LoRA adapters are not supported")
    if args.pipeline_parallel_size != 1:
        refuse(f"--pipeline-parallel-size {args.pipeline_parallel_size}: only 1 (shard one model over GPUs "
               "with --tensor-parallel-size)")
    if args.data_parallel_size != 1:
        refuse(f"--data-parallel-size {args.data_parallel_size}: one engine per serve; for "
               f"{args.data_parallel_size} replicas routed by their KV caches run `pagedserve ray-serve "
               f"--num-replicas {args.data_parallel_size}` (pip install 'pagedserve[ray]'), or replicas behind "
               "the Gateway API Inference Extension (docs/deployment.md)")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        refuse("--ssl-certfile and --ssl-keyfile go together")
    for key in args.api_key or ():
        # Never the key itself in the message: it would reach the terminal and logs.
        if not 8 <= len(key) <= 512 or any(c.isspace() or not c.isprintable() for c in key):
            refuse("--api-key: each key needs 8 to 512 printable characters without spaces")


@dataclass(frozen=True)
class ServeArgs:
    cfg: EngineConfig
    served_model_names: list[str]
    host: str
    http_port: int
    grpc_port: int
    api_keys: tuple[str, ...]
    api_key_file: str | None
    start_timeout: float
    revision: str = "main"
    openai: argparse.Namespace | None = None  # the OpenAI server's flags (frontend/openai_api/openai_args.py)
    frontend_flags: tuple[str, ...] = ()  # those flags again, for the frontend's command line
    tls_cert: str | None = None
    tls_key: str | None = None
    download_dir: str | None = None  # where hub ids are looked up (vLLM's --download-dir)
    notes: tuple[str, ...] = ()  # the lines serve logs at start: the device, flags without effect


def parse_serve_args(argv: list[str]) -> ServeArgs:
    p = build_parser()
    try:
        argv = normalize(argv, {o for o in p._option_string_actions if o.startswith("--no-")})
    except ArgvError as e:
        refuse(str(e))
    args = p.parse_args(argv)
    refused, notes = answer_vllm_flags(args)
    if refused:
        refuse(refused)
    if args.attention_backend not in ("auto", "torch", "triton"):  # vLLM's backend names (FLASH_ATTN, ...)
        notes.append(f"--attention-backend {args.attention_backend}: accepted, without effect here: this "
                     "engine picks its attention kernels (auto, or torch / triton)")
        args.attention_backend = "auto"
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            p.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.port == args.grpc_port:
        p.error(f"--port (HTTP) and --grpc-port are both {args.port}")
    served = args.served_model_name
    names = served or [served_name(args.model)]
    if any(not n or len(n) > 256 for n in names):
        p.error("--served-model-name: each name must have 1 to 256 characters")
    if args.api_key is None and env("API_KEY"):
        args.api_key = env("API_KEY").split()
    _refusals(args)
    try:
        args.device, why = resolve_device(args.device)
        cfg = config_from_args(args)
        check_openai_args(args)
    except ValueError as e:
        refuse(str(e))
    if not re.fullmatch(r"[\w.-]{1,128}", args.revision):
        p.error(f"--revision: a ref name or commit hash of at most 128 characters of [A-Za-z0-9_.-], "
                f"got {args.revision!r}")
    if args.revision != "main" and not (args.model and is_hub_id(args.model) and not os.path.isdir(args.model)):
        p.error("--revision: only a hub id (org/name) has revisions")
    notes.insert(0, f"device {cfg.device} ({why})")
    return ServeArgs(cfg, names, args.host, args.port, args.grpc_port, tuple(args.api_key or ()), args.api_key_file,
                     args.start_timeout, args.revision, args, tuple(openai_argv(args) + reasoning_argv(args)),
                     args.ssl_certfile, args.ssl_keyfile, args.download_dir, tuple(notes))
