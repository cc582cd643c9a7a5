"""The frontend process: the public gRPC server in front of the scheduler."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from grpc_health.v1 import health

from pagedserve.common.config import add_address_args, add_engine_args, addresses_from_args, config_from_args
from pagedserve.common.default_model import resolve_model
from pagedserve.frontend.engine_client import EngineClient
from pagedserve.frontend.server import SERVICE_NAME, health_status, serve

log = logging.getLogger("pagedserve.frontend")


async def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    cfg = config_from_args(args)
    model_dir = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_status(False))
    engine = EngineClient(addresses_from_args(args))
    server = await serve(engine, tokenizer, args.host, args.port,
                         cfg.max_prompt_chars, health_servicer)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        start = asyncio.create_task(engine.start(args.engine_timeout))
        done, _ = await asyncio.wait({start, asyncio.create_task(stop.wait())},
                                     return_when=asyncio.FIRST_COMPLETED)
        if start not in done:
            start.cancel()
            return 0
        start.result()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_status(True))
        log.info("serving on %s:%d", args.host, args.port)
        await stop.wait()
        return 0
    finally:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_status(False))
        await server.stop(grace=1.0)
        await engine.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve frontend")
    add_engine_args(p)
    add_address_args(p)
    p.add_argument("--host", default=os.environ.get("PAGEDSERVE_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("PAGEDSERVE_PORT", "50051")))
    p.add_argument("--engine-timeout", type=float, default=1800.0, help="seconds to wait for the engine to start")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
