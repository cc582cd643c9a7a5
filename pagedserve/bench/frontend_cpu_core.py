"""``bench frontend-cpu --core``: the frontend's own per-token work with no
transport: one process, one thread, CPU time by ``time.process_time``.

The real ``EngineClient`` (its per-frame dispatch), ``GenerationService``,
``RequestStream.next``, ``OutputState`` (detokenizer, stop strings),
metrics, and the gRPC response of ``server.chunk_pb`` serialized to bytes,
for ``--concurrency`` streams fed one token per step from msgpack frames
decoded here (the scheduler's ``Outputs``, encoded beforehand). What is
left out is grpc's and aiohttp's own cost per message.

Run as ``python -m pagedserve.bench.frontend_cpu_core MODEL_DIR STREAMS
TOKENS [STOP]``; prints one JSON line {"cpu_s", "tokens", "texts"}.
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from typing import Any

import msgspec

from pagedserve.bench.frontend_cpu import TEXT


async def _run(model_dir: str, streams: int, tokens: int, stops: list[str]) -> dict[str, Any]:
    from pagedserve.common.config import default_addresses
    from pagedserve.common.messages import frontend as fe
    from pagedserve.common.messages.types import ModelInfo
    from pagedserve.common.metrics import FrontendMetrics
    from pagedserve.frontend.core.engine_client import EngineClient
    from pagedserve.frontend.core.generation import FrontendConfig, GenerationService
    from pagedserve.frontend.grpc_api.server import chunk_pb
    from pagedserve.frontend.core.tokenizer import load
    from pagedserve.v1 import generation_pb2 as pb

    tok = load(model_dir)
    ids = tok(TEXT * 8, add_special_tokens=False).input_ids
    engine = EngineClient(default_addresses(tempfile.mkdtemp(prefix="pagedserve-fecore-")), send_timeout_s=1.0)
    engine.info = fe.EngineInfo(0, ModelInfo("sim", len(tok), 8192, (), 1, 1, 1, "none", "sim"), 16, 1 << 16, 0,
                                1024, 1 << 16)
    engine.healthy = True
    metrics = FrontendMetrics(lambda: None, lambda: engine.num_streams)
    svc = GenerationService(engine, tok, FrontendConfig(), metrics)
    opened = []
    for i in range(streams):
        req = svc.prepare(pb.GenerateRequest(request_id=f"r{i}", prompt="Hello", sampling_params=pb.SamplingParams(
            max_tokens=tokens, temperature=0.0, stop=stops)))
        opened.append(await svc.open(req))
    enc = msgspec.msgpack.Encoder()
    frames = [enc.encode(fe.Outputs([fe.TokenDelta(f"r{i}", 0, [ids[(i * 7919 + k) % len(ids)]],
                                                   fe.FinishReason.LENGTH if k == tokens - 1 else None, 2,
                                                   queue_time_s=0.0 if k == 0 else None)
                                     for i in range(streams)])) for k in range(tokens)]
    dec = msgspec.msgpack.Decoder(fe.Reply)
    texts = [""] * streams

    async def consume(i: int) -> None:
        s = opened[i]
        while (chunks := await s.next()) is not None:
            resp = pb.GenerateResponse(request_id=s.request_id, outputs=[chunk_pb(c) for c in chunks])
            resp.SerializeToString()
            texts[i] += "".join(c.text for c in chunks)
        s.close()

    tasks = [asyncio.create_task(consume(i)) for i in range(streams)]
    await asyncio.sleep(0)
    t0 = time.process_time()
    for frame in frames:
        msg = dec.decode(frame)
        if hasattr(engine, "dispatch"):
            engine.dispatch(msg)
        else:  # a frontend from before the dispatch method: its reader loop's body
            now = time.monotonic()
            for d in msg.deltas:
                routed = engine._book.route(d)
                if routed is not None and (q := engine._streams.get(routed.request_id)) is not None:
                    q.put_nowait((now, routed))
        while any(q.qsize() for q in engine._streams.values()):  # every stream takes its token: one per step
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - t0
    await engine.close()
    return {"cpu_s": cpu, "tokens": streams * tokens, "texts": texts}


def main(argv: list[str]) -> int:
    model_dir, streams, tokens = argv[0], int(argv[1]), int(argv[2])
    out = asyncio.run(_run(model_dir, streams, tokens, argv[3:]))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
