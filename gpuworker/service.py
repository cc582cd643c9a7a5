"""``pagedserve gpuworker``: the ModelRunner behind a REP socket.

Loads the model before binding (the scheduler waits for the InitWorker reply
with a generous timeout), then answers one request at a time. A failing
request is answered with WorkerError and the worker keeps serving; SIGTERM or
SIGINT ends the loop and removes the ipc socket file.
"""
from __future__ import annotations

import argparse
import signal
import sys
import traceback
from types import FrameType

import zmq

from pagedserve.common.config import add_address_args, add_engine_args, config_from_args
from pagedserve.common.ipc import RepServer
from pagedserve.common.messages import worker as wk
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.sim_worker import SimWorker


def handle(runner: "ModelRunner | SimWorker", msg: wk.Request) -> wk.Reply:
    try:
        if isinstance(msg, wk.ExecuteStep):
            return runner.execute(msg)
        if isinstance(msg, wk.InitWorker):
            return runner.init()
        if isinstance(msg, wk.ResetWorker):
            runner.reset()
            return wk.WorkerAck()
        return wk.WorkerAck()  # Shutdown: acknowledged, the loop then exits
    except Exception as e:  # noqa: BLE001 - every failure goes back to the scheduler
        traceback.print_exc(file=sys.stderr)
        return wk.WorkerError(f"{type(e).__name__}: {e}")


def _limit_cpu_threads(device: str) -> None:
    """On CPU the worker shares the machine with the other three processes;
    intra-op threads that outnumber the free cores spin-wait on each other and
    make small ops 10x slower, so leave one core free (override with
    PAGEDSERVE_WORKER_THREADS)."""
    import os

    import torch

    env = os.environ.get("PAGEDSERVE_WORKER_THREADS")
    if env:
        torch.set_num_threads(int(env))
    elif device == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve gpuworker", description="model forward, KV pool and sampling")
    add_engine_args(parser)
    add_address_args(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    _limit_cpu_threads(cfg.device)

    if cfg.worker == "sim":
        runner: ModelRunner | SimWorker = SimWorker.from_config(cfg)
    else:
        runner = ModelRunner(cfg)
    try:
        runner.init()  # a signal during loading just ends the process: no socket exists yet
    except Exception as e:  # noqa: BLE001
        print(f"pagedserve gpuworker: failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1

    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ctx = zmq.Context()
    server: RepServer[wk.Request] = RepServer(ctx, args.worker_addr, wk.Request)
    print(f"pagedserve gpuworker: serving on {args.worker_addr}", file=sys.stderr, flush=True)
    try:
        while not stop:
            if not server.poll(100):  # wake up regularly to notice signals
                continue
            try:
                msg = server.recv()
            except Exception as e:  # noqa: BLE001 - undecodable request: say so, keep serving
                server.send(wk.WorkerError(f"bad request: {e}"))
                continue
            server.send(handle(runner, msg))
            if isinstance(msg, wk.Shutdown):
                break
    finally:
        server.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
