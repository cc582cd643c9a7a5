"""``pagedserve blockmgr``: the block manager as its own process.

A REP socket answers one message at a time: ``InitRequest`` (re)creates the
manager and answers ``Ack``; then ``StepRequest`` -> ``StepReply``,
``StatsRequest`` -> ``BlockStats``, ``ResetRequest`` -> ``Ack``. Anything
that fails (a malformed message, a protocol error) answers ``ErrorReply``
and the loop keeps serving. SIGTERM/SIGINT end the loop; closing the
socket removes its ipc:// file.
"""
from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
from types import FrameType

import zmq

from pagedserve.blockmgr.kv_publisher import KVEventPublisher
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.blockmgr.hybrid import make_block_manager
from pagedserve.common.kv_events_config import KVEventsConfig
from pagedserve.common.config import add_address_args, add_engine_args, addresses_from_args, check_addresses
from pagedserve.common.ipc import BadFrame, RepServer
from pagedserve.common.metrics import add_metrics_arg, serve_blockmgr_metrics
from pagedserve.common.messages.blockmgr import (
    Ack,
    ErrorReply,
    InitRequest,
    Request,
    ResetRequest,
    StatsRequest,
    StepRequest,
)

log = logging.getLogger("pagedserve.blockmgr")


class _Handler:
    def __init__(self, kv_events: bool = False) -> None:
        self.mgr: BlockManager | None = None
        self.kv_events = kv_events

    def handle(self, msg: object) -> object:
        if type(msg) is StepRequest:
            if self.mgr is None:
                return ErrorReply("not initialised: send InitRequest first")
            return self.mgr.step(msg)
        if isinstance(msg, InitRequest):
            self.mgr = make_block_manager(msg, kv_events=self.kv_events)
            gc.collect()
            gc.freeze()  # the block objects live forever: keep them out of GC scans
            return Ack()
        if self.mgr is None:
            return ErrorReply("not initialised: send InitRequest first")
        if isinstance(msg, StatsRequest):
            return self.mgr.stats()
        if isinstance(msg, ResetRequest):
            self.mgr.reset()
            return Ack()
        return ErrorReply(f"unexpected message {type(msg).__name__}")


def serve(addr: str, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
          kv_events: KVEventsConfig | None = None) -> int:
    stop = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    ctx = zmq.Context()
    server: RepServer[Request] = RepServer(ctx, addr, Request, pin_on=(InitRequest,))
    publisher = KVEventPublisher(ctx, kv_events) if kv_events is not None and kv_events.enabled else None
    handler = _Handler(kv_events=publisher is not None)
    serve_blockmgr_metrics(metrics_port, lambda: handler.mgr, metrics_host)
    log.info("blockmgr listening on %s", addr)
    try:
        while not stop:
            if publisher is not None:
                publisher.serve_replay()
            if not server.poll(20 if publisher is not None else 100):
                continue
            try:
                msg = server.recv()
            except BadFrame as e:  # counted and logged by recv; the REP socket still owes a reply
                server.send(ErrorReply(f"refused: {e}", kind=e.kind))
                continue
            try:
                reply = handler.handle(msg)
            except Exception as e:  # noqa: BLE001 - every failure becomes a reply
                reply = ErrorReply(f"{type(e).__name__}: {e}")
            server.send(reply)  # type: ignore[arg-type]
            batch = handler.mgr.take_kv_events() if publisher is not None and handler.mgr is not None else None
            if batch is not None:
                publisher.publish(batch)  # type: ignore[union-attr]
    finally:
        if publisher is not None:
            publisher.close()
        server.close()
        ctx.term()
        for s, h in old.items():
            signal.signal(s, h)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pagedserve blockmgr", description=__doc__.split("\n\n")[0])
    add_address_args(p)
    add_metrics_arg(p, "blockmgr")
    add_engine_args(p)  # accepted (the launcher hands every child the same flags), unused
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    check_addresses(addresses_from_args(args), "blockmgr")  # fail fast (issue 19), as the others do
    logging.basicConfig(level=logging.INFO, format="%(asctime)s blockmgr %(levelname)s %(message)s")
    return serve(args.blockmgr_addr, args.metrics_port, args.metrics_host, args.kv_events_config)


if __name__ == "__main__":
    raise SystemExit(main())
