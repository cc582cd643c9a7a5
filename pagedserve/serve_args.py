"""``pagedserve serve``'s command line, spelled as vLLM's ``vllm serve``:
the model positionally or with ``--model`` (a folder or a hub id from the
local cache), ``--host``/``--port`` for the OpenAI HTTP API (default
127.0.0.1:8000), ``--grpc-port`` for gRPC (50051), ``--api-key``,
``--served-model-name``, plus every engine flag. Each flag's help states its
default and environment variable."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass

from pagedserve.common.config import (DEFAULT_SHUTDOWN_TIMEOUT_S, EngineConfig, add_engine_args,  # noqa: F401
                                      config_from_args, env, helptext, shutdown_timeout_default)
from pagedserve.common.default_model import DEFAULT_MODEL_ID
from pagedserve.common.hub_cache import is_hub_id
from pagedserve.common.version import version

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
                   help="the model, as with --model (a folder or a hub id org/name)")
    p.add_argument("--version", action="version", version=f"pagedserve {version()}",
                   help="print the version and exit")
    add_engine_args(p)
    p.set_defaults(shutdown_timeout=shutdown_timeout_default())
    p.add_argument("--served-model-name", nargs="+", default=env("SERVED_MODEL_NAME"), metavar="NAME",
                   help=helptext("names the OpenAI API accepts in 'model' (the variable: space-separated); the "
                                 "first is reported by /v1/models and in the model_name metrics label; none: "
                                 "the model as given", "SERVED_MODEL_NAME"))
    p.add_argument("--revision", default=env("REVISION", "main"),
                   help=helptext("of a hub id: a ref under refs/ in the cache, or a commit hash", "REVISION"))
    p.add_argument("--host", default=env("HOST", "127.0.0.1"),
                   help=helptext("address the HTTP and gRPC APIs listen on; 0.0.0.0 exposes them", "HOST"))
    p.add_argument("--port", "--http-port", dest="port", type=_port, default=env("HTTP_PORT", DEFAULT_HTTP_PORT),
                   help=helptext("port of the OpenAI-compatible HTTP API (/v1/..., /metrics, /health)",
                                 "HTTP_PORT"))
    p.add_argument("--grpc-port", type=_port, default=env("GRPC_PORT", DEFAULT_GRPC_PORT),
                   help=helptext("port of the gRPC API pagedserve.v1.Generation", "GRPC_PORT"))
    p.add_argument("--api-key", default=env("API_KEY"),
                   help=helptext("require 'Authorization: Bearer KEY' on both APIs; handed to the frontend in "
                                 "its environment, never on a command line", "API_KEY"))
    p.add_argument("--api-key-file", default=env("API_KEY_FILE"),
                   help=helptext("accepted keys, one per line", "API_KEY_FILE"))
    p.add_argument("--start-timeout", type=float, default=env("START_TIMEOUT", 1800.0),
                   help=helptext("seconds to wait for the engine to load and answer", "START_TIMEOUT"))
    return p


@dataclass(frozen=True)
class ServeArgs:
    cfg: EngineConfig
    served_model_names: list[str]
    host: str
    http_port: int
    grpc_port: int
    api_key: str | None
    api_key_file: str | None
    start_timeout: float
    revision: str = "main"


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
    names = (served.split() if isinstance(served, str) else served) or [args.model or DEFAULT_MODEL_ID]
    if any(not n or len(n) > 256 for n in names):
        p.error("--served-model-name: each name must have 1 to 256 characters")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    if not re.fullmatch(r"[\w.-]{1,128}", args.revision):
        p.error(f"--revision: a ref name or commit hash of at most 128 characters of [A-Za-z0-9_.-], "
                f"got {args.revision!r}")
    if args.revision != "main" and not (args.model and is_hub_id(args.model) and not os.path.isdir(args.model)):
        p.error("--revision: only a hub id (org/name) has revisions")
    return ServeArgs(cfg, names, args.host, args.port, args.grpc_port, args.api_key, args.api_key_file,
                     args.start_timeout, args.revision)
