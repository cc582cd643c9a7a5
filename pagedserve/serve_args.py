"""``pagedserve serve``'s command line, spelled as vLLM's ``vllm serve``:
the model positionally or with ``--model`` (a folder or a hub id from the
local cache), ``--host``/``--port`` for the OpenAI HTTP API (default
127.0.0.1:8000), ``--grpc-port`` for gRPC (50051), ``--api-key``,
``--served-model-name``, plus every engine flag and vLLM's OpenAI server flags
(frontend/openai_args.py). Each flag's help states its default and environment
variable. A flag we cannot honour is refused in one stderr line that names it
(exit status 2) before anything loads."""
from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import NoReturn

from pagedserve.common.config import (DEFAULT_SHUTDOWN_TIMEOUT_S, EngineConfig, add_engine_args,  # noqa: F401
                                      config_from_args, env, helptext, shutdown_timeout_default)
from pagedserve.common.env import env_flag
from pagedserve.common.default_model import is_gguf, served_name
from pagedserve.common.hub_cache import is_hub_id
from pagedserve.common.version import version
from pagedserve.frontend.openai_args import add_openai_args, check_openai_args, openai_argv

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve serve",
                                description="Start all four components locally and serve the OpenAI-compatible "
                                            "HTTP API and the gRPC API.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as with --model (a folder, a hub id org/name, or a .gguf file)")
    p.add_argument("--version", action="version", version=f"pagedserve {version()}",
                   help="print the version and exit")
    add_engine_args(p)
    p.set_defaults(shutdown_timeout=shutdown_timeout_default())
    p.add_argument("--served-model-name", nargs="+", default=env("SERVED_MODEL_NAME"), metavar="NAME",
                   help=helptext("names the OpenAI API accepts in 'model' (the variable: space-separated); the "
                                 "first is reported by /v1/models and in the model_name metrics label; none: "
                                 "the model as given (a .gguf file: its name less .gguf)", "SERVED_MODEL_NAME"))
    p.add_argument("--revision", default=env("REVISION", "main"),
                   help=helptext("of a hub id: a ref under refs/ in the cache, or a commit hash", "REVISION"))
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
    p.add_argument("--start-timeout", type=float, default=env("START_TIMEOUT", 1800.0),
                   help=helptext("seconds to wait for the engine to load and answer", "START_TIMEOUT"))
    p.add_argument("--ssl-certfile", default=env("TLS_CERT"),
                   help=helptext("PEM certificate chain: serve HTTP and gRPC over TLS", "TLS_CERT"))
    p.add_argument("--ssl-keyfile", default=env("TLS_KEY"), help=helptext("PEM private key of --ssl-certfile",
                                                                          "TLS_KEY"))
    add_openai_args(p)
    g = p.add_argument_group("accepted for vLLM's command lines; other values are refused")
    g.add_argument("--quantization", "-q", default=env("QUANTIZATION"),
                   help=helptext("none, or gguf for a .gguf model (its weights are dequantized): there are no "
                                 "quantized kernels",
                                 "QUANTIZATION"))
    g.add_argument("--enable-lora", action="store_true", default=env_flag("ENABLE_LORA", False),
                   help=helptext("refused: LoRA adapters are not supported", "ENABLE_LORA"))
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=env("PIPELINE_PARALLEL_SIZE", 1),
                   help=helptext("1 only (shard over GPUs with --tensor-parallel-size)", "PIPELINE_PARALLEL_SIZE"))
    g.add_argument("--data-parallel-size", "-dp", type=int, default=env("DATA_PARALLEL_SIZE", 1),
                   help=helptext("1 only: one engine per serve; for N replicas see docs/deployment.md "
                                 "(scale-out)", "DATA_PARALLEL_SIZE"))
    return p


def refuse(message: str) -> NoReturn:
    """A flag we cannot honour: one line on stderr, argparse's exit status, no usage text."""
    print(f"pagedserve serve: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _refusals(args: argparse.Namespace) -> None:
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
    openai: argparse.Namespace | None = None  # the OpenAI server's flags (frontend/openai_args.py)
    frontend_flags: tuple[str, ...] = ()  # those flags again, for the frontend's command line
    tls_cert: str | None = None
    tls_key: str | None = None


def parse_serve_args(argv: list[str]) -> ServeArgs:
    p = build_parser()
    args = p.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            p.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.port == args.grpc_port:
        p.error(f"--port (HTTP) and --grpc-port are both {args.port}")
    served = args.served_model_name
    names = (served.split() if isinstance(served, str) else served) or [served_name(args.model)]
    if any(not n or len(n) > 256 for n in names):
        p.error("--served-model-name: each name must have 1 to 256 characters")
    if args.api_key is None and env("API_KEY"):
        args.api_key = env("API_KEY").split()
    _refusals(args)
    try:
        cfg = config_from_args(args)
        check_openai_args(args)
    except ValueError as e:
        refuse(str(e))
    if not re.fullmatch(r"[\w.-]{1,128}", args.revision):
        p.error(f"--revision: a ref name or commit hash of at most 128 characters of [A-Za-z0-9_.-], "
                f"got {args.revision!r}")
    if args.revision != "main" and not (args.model and is_hub_id(args.model) and not os.path.isdir(args.model)):
        p.error("--revision: only a hub id (org/name) has revisions")
    return ServeArgs(cfg, names, args.host, args.port, args.grpc_port, tuple(args.api_key or ()), args.api_key_file,
                     args.start_timeout, args.revision, args, tuple(openai_argv(args)), args.ssl_certfile,
                     args.ssl_keyfile)
