"""A SIMULATED scheduler for ``bench frontend-cpu``: it owns the scheduler's
two sockets and speaks the frontend channel (common/messages/frontend.py)
as ``pagedserve scheduler`` does, with no model behind it.

Every ``--step-ms`` it sends one ``Outputs`` with one new token for every
running request, as a decode step of the real engine does; the tokens are
real text (``--ids``, a JSON list the driver tokenized), each request
starting at another offset, so the frontend detokenizes multi-byte text.
A request ends (``length``) after its ``max_tokens``; EOS is not special.

Run as ``python -m pagedserve.bench.frontend_cpu_engine --scheduler-in ADDR
--scheduler-out ADDR --ids FILE``; it runs until SIGTERM/SIGINT.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import zmq

from pagedserve.common import ipc
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages.types import ModelInfo

BLOCK_SIZE = 16
NUM_BLOCKS = 1 << 16


@dataclass
class _Running:
    request_id: str
    num_prompt: int
    left: int  # tokens still to send
    pos: int  # next index into the id cycle
    first: bool = True


def _info(query_id: int, vocab_size: int, max_model_len: int) -> fe.EngineInfo:
    model = ModelInfo("simulated:frontend-cpu", vocab_size, max_model_len, (), 1, 1, 1, "none", "sim")
    return fe.EngineInfo(query_id, model, BLOCK_SIZE, NUM_BLOCKS, 0, 1024, 1 << 16)


def _stats(query_id: int, running: int, steps: int) -> fe.EngineStats:
    return fe.EngineStats(query_id, running, 0, 0, NUM_BLOCKS, NUM_BLOCKS - running, 0, 0, 0, 0, 0, steps)


def serve(inbox: ipc.PullQueue[Any], outbox: ipc.PushQueue[Any], ids: list[int], step_s: float,
          vocab_size: int, max_model_len: int, stop: list[bool]) -> None:
    running: dict[str, _Running] = {}
    offsets = 0
    steps = 0
    next_step = time.monotonic()
    while not stop[0]:
        wait_ms = max(0, int((next_step - time.monotonic()) * 1000)) if running else 50
        if inbox.poll(wait_ms):
            while (msg := inbox.get_nowait()) is not None:
                if isinstance(msg, fe.AddRequest):
                    offsets += 7919  # another window of the text for every request
                    running[msg.request_id] = _Running(msg.request_id, len(msg.prompt_token_ids),
                                                       msg.params.max_tokens, offsets % len(ids))
                elif isinstance(msg, fe.AbortRequest):
                    for rid in msg.request_ids:
                        running.pop(rid, None)
                elif isinstance(msg, fe.InfoQuery):
                    outbox.put(_info(msg.query_id, vocab_size, max_model_len))
                elif isinstance(msg, fe.StatsQuery):
                    outbox.put(_stats(msg.query_id, len(running), steps))
        now = time.monotonic()
        if not running:
            next_step = now
            continue
        if now < next_step:
            continue
        next_step = max(next_step + step_s, now)  # a late step is not made up with a burst
        steps += 1
        deltas = []
        for r in list(running.values()):
            r.left -= 1
            done = r.left <= 0
            deltas.append(fe.TokenDelta(r.request_id, 0, [ids[r.pos]], fe.FinishReason.LENGTH if done else None,
                                        r.num_prompt, queue_time_s=0.0 if r.first else None))
            r.pos, r.first = (r.pos + 1) % len(ids), False
            if done:
                del running[r.request_id]
        outbox.put(fe.Outputs(deltas))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="frontend_cpu_engine")
    p.add_argument("--scheduler-in", required=True)
    p.add_argument("--scheduler-out", required=True)
    p.add_argument("--ids", required=True, help="JSON list of token ids to stream")
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args(argv)
    with open(args.ids) as f:
        ids = [int(i) for i in json.load(f)]
    stop = [False]

    def on_signal(*_: Any) -> None:
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ctx: zmq.Context[Any] = zmq.Context()
    inbox: ipc.PullQueue[fe.Request] = ipc.PullQueue(ctx, args.scheduler_in, fe.Request, bind=True)
    outbox: ipc.PushQueue[fe.Reply] = ipc.PushQueue(ctx, args.scheduler_out, bind=True, stop=lambda: stop[0])
    try:
        serve(inbox, outbox, ids, args.step_ms / 1000, args.vocab_size, args.max_model_len, stop)
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
