"""The scheduler process: binds the two frontend-facing queues, connects to the
blockmgr and the gpuworker, and runs the step loop."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any, Callable

import zmq

from pagedserve.common import ipc
from pagedserve.common.env import env
from pagedserve.common.lifecycle import StopFlag
from pagedserve.common.config import (add_address_args, add_engine_args, addresses_from_args, check_addresses,
                                       config_from_args)
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages import worker as wk
from pagedserve.common.metrics import add_metrics_arg, serve_scheduler_metrics
from pagedserve.scheduler.control import Control, abort_all
from pagedserve.scheduler.engine import ComponentError, EngineCore, IpcClient, PeerRefused
from pagedserve.scheduler.frontend_link import FrontendLink

log = logging.getLogger("pagedserve.scheduler")
# wrong_peer answers are tolerated at start-up for longer than a tcp peer takes
# to count a silent (killed) predecessor as gone, so a restarted scheduler waits
# for the components to release it instead of exiting and being restarted again.
STARTUP_REFUSAL_S = ipc.HEARTBEAT_TIMEOUT_MS / 1000 + 5.0


def _recover(core: EngineCore, why: ComponentError, drain: Callable[[], None], link: FrontendLink,
             stop: StopFlag, timeout_s: float) -> bool:
    """Waits for the lost component to come back and resumes every request
    by recompute; the frontend is told (an unsolicited EngineStats, query 0)
    when recovery starts and ends, so health tells the truth meanwhile."""
    t0 = time.monotonic()
    log.warning("lost a component (%s): recovering by recompute", why)
    core.recovering = True
    link.put(core.stats(0))
    try:
        n = core.recover(drain, lambda: bool(stop), timeout_s)
    except ComponentError as e:
        log.error("recovery failed: %s", e)
        return False
    try:
        link.put(core.stats(0))
    except ComponentError:  # lost again at once: the loop notices and recovers again
        pass
    log.info("recovered in %.2fs: %d requests resume by recompute", time.monotonic() - t0, n)
    return True


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedserve scheduler")
    add_engine_args(p)
    add_address_args(p)
    add_metrics_arg(p, "scheduler")
    p.add_argument("--init-timeout", type=float, default=1800.0, help="seconds to wait for the worker to load")
    p.add_argument("--step-timeout", type=float, default=float(env("STEP_TIMEOUT", 600.0)),
                   help="seconds a live but slow worker step is waited for (env PAGEDSERVE_STEP_TIMEOUT)")
    args = p.parse_args(argv)
    addrs = addresses_from_args(args)
    check_addresses(addrs, "scheduler")  # fail fast: before anything loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    cfg = config_from_args(args)

    stop = StopFlag()

    ctx: zmq.Context[Any] = zmq.Context()
    inbox: ipc.PullQueue[fe.Request] = ipc.PullQueue(ctx, addrs.scheduler_in, fe.Request, bind=True)
    # A put waiting for a frontend gives up on SIGTERM or once none is connected.
    link = FrontendLink(lambda: bool(stop))
    outbox: ipc.PushQueue[fe.Reply] = ipc.PushQueue(ctx, addrs.scheduler_out, bind=True, stop=link.give_up)
    link.attach(outbox)
    # Calls wait in short polls: SIGTERM and a disconnected peer end them at once.
    control = Control(inbox, link)
    blockmgr = IpcClient(ctx, addrs.blockmgr, bm.Reply, timeout_s=30.0, stop=lambda: bool(stop),
                         while_waiting=control.while_waiting)
    worker = IpcClient(ctx, addrs.worker, wk.Reply, timeout_s=args.step_timeout, stop=lambda: bool(stop),
                       while_waiting=control.while_waiting)
    try:
        core = None
        refusals_until = time.monotonic() + STARTUP_REFUSAL_S
        refused = 0
        while core is None and not stop and time.monotonic() < refusals_until:
            try:
                core = EngineCore(cfg, blockmgr, worker, init_timeout_s=args.init_timeout)
            except PeerRefused as e:  # our predecessor's connection is still closing
                if refused % 20 == 0:  # every 2 s, not every try
                    log.warning("start-up: %s; retrying", e)
                refused += 1
                time.sleep(0.1)
            except ComponentError as e:
                log.error("start-up failed: %s", e)
                return 0 if stop else 1
        if core is None:
            log.error("start-up failed: the components serve another scheduler")
            return 1
        log.info("ready: %d GPU blocks of %d tokens, %d CPU blocks", core.ready.num_gpu_blocks,
                 core.ready.block_size, core.ready.num_cpu_blocks)
        serve_scheduler_metrics(args.metrics_port, lambda: core.counts, args.metrics_host)
        control.core = core
        drain = control.drain

        while not stop:
            try:
                core.check_peers()
                if link.lost():
                    abort_all(core)
                # Block briefly for input only when idle; otherwise drain and step.
                if control.has_input(0 if core.has_work() else 50):
                    drain()
                if core.has_work():
                    deltas = core.step()
                    if deltas:
                        link.put(fe.Outputs(deltas))
                elif (deltas := core.scheduler.take_deltas()):
                    link.put(fe.Outputs(deltas))
            except ComponentError as e:
                if stop:
                    return 0
                if not _recover(core, e, drain, link, stop, args.init_timeout):
                    return 0 if stop else 1
        return 0
    finally:
        link.close()
        for sock in (inbox, outbox, blockmgr, worker):
            sock.close()
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
