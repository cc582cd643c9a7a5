"""The scheduler process: binds the two frontend-facing queues, connects to the
blockmgr and the gpuworker, and runs the step loop."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import zmq

from pagedserve.common import ipc
from pagedserve.common.lifecycle import StopFlag
from pagedserve.common.config import add_address_args, add_engine_args, addresses_from_args, config_from_args
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages import worker as wk
from pagedserve.common.metrics import add_metrics_arg, serve_scheduler_metrics
from pagedserve.scheduler.admission import check_add
from pagedserve.scheduler.engine import ComponentError, EngineCore, IpcClient

log = logging.getLogger("pagedserve.scheduler")


def _handle(core: EngineCore, msg: fe.Request) -> fe.Reply | None:
    """A well-typed message the scheduler cannot apply (a bad field value,
    a duplicate id) is dropped like an undecodable frame; losing a component
    (ComponentError) still ends the loop."""
    if isinstance(msg, fe.AddRequest) and (why := check_add(msg, core.ready.model)) is not None:
        ipc.note_dropped("scheduler_in", ValueError(f"AddRequest {msg.request_id[:64]!r} refused: {why}"))
        return fe.Outputs([fe.TokenDelta(msg.request_id, 0, [], "error", len(msg.prompt_token_ids),
                                         f"invalid request: {why}")])
    try:
        return core.handle(msg)
    except ComponentError:
        raise
    except Exception as e:  # noqa: BLE001 - one bad request must not end the server
        ipc.note_dropped("scheduler_in", e)
        return None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve scheduler")
    add_engine_args(p)
    add_address_args(p)
    add_metrics_arg(p, "scheduler")
    p.add_argument("--init-timeout", type=float, default=1800.0, help="seconds to wait for the worker to load")
    p.add_argument("--step-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    cfg = config_from_args(args)
    addrs = addresses_from_args(args)

    stop = StopFlag()

    ctx: zmq.Context[Any] = zmq.Context()
    inbox: ipc.PullQueue[fe.Request] = ipc.PullQueue(ctx, addrs.scheduler_in, fe.Request, bind=True)
    outbox: ipc.PushQueue[fe.Reply] = ipc.PushQueue(ctx, addrs.scheduler_out, bind=True, stop=lambda: bool(stop))
    # Calls wait in short polls: SIGTERM and a disconnected peer end them at once.
    blockmgr = IpcClient(ctx, addrs.blockmgr, bm.Reply, timeout_s=30.0, stop=lambda: bool(stop))
    worker = IpcClient(ctx, addrs.worker, wk.Reply, timeout_s=args.step_timeout, stop=lambda: bool(stop))
    try:
        try:
            core = EngineCore(cfg, blockmgr, worker, init_timeout_s=args.init_timeout)
        except ComponentError as e:
            log.error("start-up failed: %s", e)
            return 0 if stop else 1
        log.info("ready: %d GPU blocks of %d tokens, %d CPU blocks", core.ready.num_gpu_blocks,
                 core.ready.block_size, core.ready.num_cpu_blocks)
        serve_scheduler_metrics(args.metrics_port, core, args.metrics_host)
        while not stop:
            # Block briefly for input only when idle; otherwise drain and step.
            if inbox.poll(0 if core.has_work() else 50):
                while (msg := inbox.get_nowait()) is not None:
                    reply = _handle(core, msg)
                    if reply is not None:
                        outbox.put(reply)
            if core.has_work():
                try:
                    deltas = core.step()
                except ComponentError as e:
                    log.error("step failed: %s", e)
                    return 0 if stop else 1
                if deltas:
                    outbox.put(fe.Outputs(deltas))
            elif (deltas := core.scheduler.take_deltas()):
                outbox.put(fe.Outputs(deltas))
        return 0
    finally:
        for sock in (inbox, outbox, blockmgr, worker):
            sock.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
