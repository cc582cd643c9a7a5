"""The frontend process: the public gRPC server (and the optional OpenAI
HTTP gateway) in front of the scheduler.

Every frontend-only flag also reads a ``PAGEDSERVE_*`` environment variable,
so ``pagedserve serve`` (which hands its children only the engine flags) and
compose can set them."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import sys
from typing import Any

from grpc_health.v1 import health

from pagedserve.common.env import env, env_int
from pagedserve.common.config import (EXIT_PORT_IN_USE, RUN_HEALTH_PREFIX, add_address_args, add_engine_args,
                                       addresses_from_args, bind_error, check_addresses, config_from_args,
                                       shutdown_timeout_default)
from pagedserve.common.default_model import resolve_model
from pagedserve.common.metrics import FrontendMetrics, add_metrics_arg, serve_metrics
from pagedserve.frontend.openai_api import http_gateway, reasoning
from pagedserve.frontend.core.auth import load_keys
from pagedserve.frontend.core.engine_client import EngineClient
from pagedserve.frontend.core.generation import FrontendConfig, GenerationService
from pagedserve.frontend.openai_api.openai_args import add_openai_args, build_options, check_openai_args
from pagedserve.frontend.openai_api.reasoning.args import ALIASES, add_reasoning_args
from pagedserve.frontend.grpc_api.server import SERVICE_NAME, health_status, serve, server_credentials
from pagedserve.frontend.openai_api.server_flags import add_server_flags, server_flags
from pagedserve.frontend.core.shutdown import StopSignals, drain
from pagedserve.frontend.core.stats_log import log_stats_every
from pagedserve.frontend.core.tokenizer import load as load_tokenizer
from pagedserve.frontend.core.vllm_metrics import add_vllm_metrics

log = logging.getLogger("pagedserve.frontend")
_AIOHTTP_LEVELS = {"trace": logging.DEBUG}  # uvicorn's names otherwise map onto logging's


class PortInUse(Exception):
    """A port this frontend must listen on is taken (checked again right before binding)."""


def _bind(host: str, port: int, flag: str) -> None:
    why = bind_error(host, port)
    if why is not None:
        raise PortInUse(f"{flag} {port} on {host}: {why}")


async def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    model_dir = resolve_model(cfg.model)
    # --tokenizer (serve hands over a folder) for every API; slow: the Python tokenizer (transformers').
    tokenizer = load_tokenizer(resolve_model(cfg.tokenizer) if cfg.tokenizer else model_dir,
                               slow=cfg.tokenizer_mode == "slow", trust_remote_code=cfg.trust_remote_code)
    opts = build_options(args, model_dir, len(tokenizer))
    if args.reasoning_parser is not None:  # refused at start when the tokenizer lacks its markers
        args.reasoning_parser = ALIASES.get(args.reasoning_parser, args.reasoning_parser)
        try:
            reasoning.check(args.reasoning_parser, tokenizer.get_vocab(), cfg.model or model_dir,
                            opts.tool_call_parser)
        except ValueError as e:
            raise SystemExit(f"pagedserve frontend: error: {e}") from None
        opts = dataclasses.replace(opts, reasoning_parser=args.reasoning_parser)
    if opts.chat_template is not None:
        tokenizer.chat_template = opts.chat_template  # chat, /tokenize and gRPC all render through it
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("pagedserve frontend: --tls-cert and --tls-key go together")
    keys = load_keys(args.api_key, args.api_key_file)
    logging.getLogger("aiohttp").setLevel(_AIOHTTP_LEVELS.get(args.uvicorn_log_level,
                                                              args.uvicorn_log_level.upper()))
    fcfg = FrontendConfig(max_prompt_chars=cfg.max_prompt_chars, max_stop_ids=cfg.max_stop_ids, max_n=args.max_n,
                          max_beam_width=args.max_beam_width, max_queued_requests=args.max_queued_requests,
                          max_concurrent_per_key=args.max_concurrent_per_key, auth_enabled=keys.enabled,
                          tls_enabled=bool(args.tls_cert))
    # A lost scheduler gets --health-timeout to come back before open streams end.
    engine = EngineClient(addresses_from_args(args), resume_timeout_s=args.health_timeout)
    metrics = FrontendMetrics(lambda: engine.last_stats, lambda: engine.num_streams)
    served = args.served_model_name or ([cfg.model] if cfg.model else None)
    vllm_metrics = add_vllm_metrics(metrics, engine, cfg, served)  # model_name: what /v1/models says
    svc = GenerationService(engine, tokenizer, fcfg, metrics)
    health_servicer = health.aio.HealthServicer()

    token = env("RUN_TOKEN")
    names = ("", SERVICE_NAME, *([RUN_HEALTH_PREFIX + token] if token else []))

    async def set_health(serving: bool) -> None:
        for name in names:
            await health_servicer.set(name, health_status(serving))

    await set_health(False)
    creds = server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None
    _bind(args.host, args.port, "--grpc-port")  # a clear line, before gRPC's own log of a failed bind
    if args.http_port is not None:
        _bind(args.host, args.http_port, "--port")
    try:
        server = await serve(svc, args.host, args.port, health_servicer, keys, creds)
    except (OSError, RuntimeError) as e:  # lost a race for the port since the check
        raise PortInUse(f"--grpc-port {args.port} on {args.host}: {e}") from None
    gateway_runner = None
    if args.http_port is not None:
        ssl_ctx = http_gateway.ssl_context(args.tls_cert, args.tls_key) if args.tls_cert else None
        gw = http_gateway.Gateway(svc, keys, metrics.registry, lambda: engine.healthy, served, opts=opts)
        gw.before_metrics = vllm_metrics.refresh
        gw.flags = server_flags(args)
        try:
            gateway_runner = await http_gateway.start(gw, args.host, args.http_port, ssl_ctx)
        except OSError as e:
            await server.stop(None)
            raise PortInUse(f"--port {args.http_port} on {args.host}: {e.strerror or e}") from None
    metrics_server = serve_metrics(args.metrics_port, metrics.registry, args.metrics_host)
    signals = StopSignals()
    stop = signals.first
    try:
        start = asyncio.create_task(engine.start(args.engine_timeout))
        done, _ = await asyncio.wait({start, asyncio.create_task(stop.wait())},
                                     return_when=asyncio.FIRST_COMPLETED)
        if start not in done:
            start.cancel()
            return 0
        start.result()
        engine.watch(args.health_interval, args.health_timeout, set_health)
        # Everything loaded so far (the tokenizer, grpc, aiohttp) lives as
        # long as the process: out of the collector's reach, a full collection
        # (set off by, say, a 200k-id prompt) stops the event loop for ms, not
        # the ~100 ms measured once in CI between two tokens of another stream.
        gc.collect()
        gc.freeze()
        await set_health(True)
        stats_task = None if args.disable_log_stats else asyncio.create_task(
            log_stats_every(10.0, lambda: engine.last_stats, log))
        log.info("serving on %s:%d%s%s%s", args.host, args.port,
                 f", HTTP on {args.http_port}" if args.http_port is not None else "",
                 ", TLS" if creds else "", ", API keys" if keys.enabled else "")
        await stop.wait()
        if stats_task is not None:
            stats_task.cancel()
        return 0
    finally:
        await set_health(False)
        await drain(server, gateway_runner, engine, cfg.shutdown_timeout, signals.again)
        if metrics_server is not None:
            metrics_server[0].shutdown()
        await engine.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve frontend")
    add_engine_args(p)
    p.set_defaults(shutdown_timeout=shutdown_timeout_default())  # the frontend drains; other components do not
    add_address_args(p)
    add_metrics_arg(p, "frontend")
    p.add_argument("--host", default=env("HOST", "127.0.0.1"))
    # PAGEDSERVE_GRPC_PORT, as for serve (one variable for the gRPC port); --port: the earlier spelling
    p.add_argument("--grpc-port", "--port", dest="port", type=int, default=env_int("GRPC_PORT", 50051),
                   help="gRPC port")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="names the OpenAI API accepts in 'model'; the first is reported (default: the model)")
    p.add_argument("--http-port", type=int, default=env_int("HTTP_PORT", None),
                   help="also serve the OpenAI-compatible HTTP API on this port")
    p.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", default=env("TLS_CERT"),
                   help="PEM certificate chain: serve gRPC and HTTP over TLS")
    p.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", default=env("TLS_KEY"),
                   help="PEM private key of --tls-cert")
    # Several keys (vLLM's nargs); the variable, space-separated, is how serve hands them over.
    p.add_argument("--api-key", nargs="+", default=(env("API_KEY") or "").split() or None,
                   help="require 'authorization: Bearer KEY', any of these keys")
    p.add_argument("--api-key-file", default=env("API_KEY_FILE"), help="accepted keys, one per line")
    p.add_argument("--max-queued-requests", type=int, default=env_int("MAX_QUEUED_REQUESTS", 1024),
                   help="admitted requests without a first token yet; beyond it RESOURCE_EXHAUSTED")
    p.add_argument("--max-concurrent-per-key", type=int, default=env_int("MAX_CONCURRENT_PER_KEY", 64),
                   help="open streams per API key (auth on)")
    p.add_argument("--max-n", type=int, default=env_int("MAX_N", 16))
    p.add_argument("--max-beam-width", type=int, default=env_int("MAX_BEAM_WIDTH", 8))
    p.add_argument("--health-interval", type=float, default=float(env("HEALTH_INTERVAL", 2.0)),
                   help="seconds between scheduler liveness checks")
    p.add_argument("--health-timeout", type=float, default=float(env("HEALTH_TIMEOUT", 30.0)),
                   help="no scheduler answer within this: NOT_SERVING (a lost scheduler: open streams end unless one is back)")
    p.add_argument("--engine-timeout", type=float, default=1800.0, help="seconds to wait for the engine to start")
    add_openai_args(p)
    add_reasoning_args(p)
    add_server_flags(p)
    args = p.parse_args(argv)
    check_addresses(addresses_from_args(args), "frontend")  # fail fast: before anything loads
    try:
        check_openai_args(args)
    except ValueError as e:
        print(f"pagedserve frontend: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    try:
        return asyncio.run(run(args))
    except PortInUse as e:
        print(f"pagedserve frontend: error: {e} (another server there?)", file=sys.stderr, flush=True)
        return EXIT_PORT_IN_USE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
