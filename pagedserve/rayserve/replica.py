"""One Ray Serve replica = one pagedserve engine: ``pagedserve serve`` (the
four processes) started by the replica and stopped with it, its KV events
read into the set of block hashes it caches (reported to the router as
routing stats), and a streaming ``generate`` over its gRPC API."""
from __future__ import annotations

import ctypes
import json
import signal
import tempfile
import threading
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import grpc
import msgspec
import zmq
from ray import serve

from pagedserve.bench.serve_proc import start_serve
from pagedserve.blockmgr.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from pagedserve.client import AsyncGenerationClient

_PR_SET_PDEATHSIG = 1
# The engine's refusals as HTTP statuses (frontend/core/error_table.py's, for the codes a request can cause)
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAUTHENTICATED: 401}
START_TIMEOUT_S = 600.0


def _die_with_parent() -> None:
    """The engine gets SIGTERM if the replica's process dies (Ray kills it with SIGKILL)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class CachedBlocks:
    """The GPU blocks an engine caches, kept from its KV event stream: live on a
    SUB socket, a gap filled from the replay socket (vLLM's protocol)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], pub: str, replay: str) -> None:
        self.hashes: set[int] = set()
        self._lock = threading.Lock()
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._ctx, self._replay = ctx, replay
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(pub)
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()

    def snapshot(self) -> list[int]:
        with self._lock:
            return list(self.hashes)

    def _apply(self, payload: bytes) -> None:
        with self._lock:
            for e in self._decode(payload).events:
                if isinstance(e, AllBlocksCleared):
                    self.hashes.clear()
                elif e.medium in (None, "GPU"):
                    if isinstance(e, BlockStored):
                        self.hashes.update(e.block_hashes)
                    else:
                        self.hashes.difference_update(e.block_hashes)

    def _fill_gap(self, upto: int) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(self._replay)
        try:
            sock.send_multipart((b"", self._next.to_bytes(8, "big")))
            while True:
                _, _, seq_b, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq < 0:
                    break
                if self._next <= seq < upto:
                    self._apply(payload)
                    self._next = seq + 1
        finally:
            sock.close(0)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            _, seq_b, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if seq > self._next:
                self._fill_gap(seq)
            if seq >= self._next:
                self._apply(payload)
                self._next = seq + 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sub.close(0)


@serve.deployment
class PagedServeReplica:
    def __init__(self, model: str | None, serve_args: list[str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="pagedserve-ray-")
        pub, replay = f"ipc://{self._dir}/kv.pub", f"ipc://{self._dir}/kv.replay"
        events = json.dumps({"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay})
        self._engine = start_serve(["--kv-events-config", events, *serve_args], model, START_TIMEOUT_S,
                                   preexec_fn=_die_with_parent, keep_lines=200)
        self._grpc = self._engine.grpc_addr
        self._metrics_url = f"{self._engine.http_url}/metrics"
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._cached = CachedBlocks(self._ctx, pub, replay)
        self._client: AsyncGenerationClient | None = None
        self._in_flight = 0
        self._id = serve.get_replica_context().replica_id.unique_id

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads (every request_routing_stats_period_s)."""
        return {"cached_blocks": self._cached.snapshot(), "in_flight": self._in_flight}

    def check_health(self) -> None:
        if self._engine.proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {self._engine.proc.returncode}")

    def prefix_cache_totals(self) -> tuple[float, float]:
        """vllm:prefix_cache_hits_total and _queries_total of this engine's /metrics."""
        text = urllib.request.urlopen(self._metrics_url, timeout=10).read().decode()
        got = {"hits": 0.0, "queries": 0.0}
        for line in text.splitlines():
            for k in got:
                if line.startswith(f"vllm:prefix_cache_{k}_total"):
                    got[k] += float(line.rsplit(" ", 1)[1])
        return got["hits"], got["queries"]

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streams {"token_ids", "text", "finish_reason"} chunks; the last one also
        carries this replica's id and its prefix-cache totals."""
        if self._client is None:
            self._client = AsyncGenerationClient(self._grpc)
        self._in_flight += 1
        try:
            finish = ""
            try:
                async for resp in self._client.stream(request["prompt"], timeout=600, **request["sampling"]):
                    for out in resp.outputs:
                        finish = out.finish_reason or finish
                        if out.token_ids or out.text:
                            yield {"token_ids": list(out.token_ids), "text": out.text, "finish_reason": None}
            except grpc.aio.AioRpcError as e:  # the engine's refusal: the client's error, with its status
                status = _HTTP_STATUS.get(e.code())
                if status is None:
                    raise
                yield {"error": e.details() or e.code().name, "status": status}
                return
            hits, queries = self.prefix_cache_totals()
            yield {"token_ids": [], "text": "", "finish_reason": finish or "stop", "replica": self._id,
                   "prefix_cache": [hits, queries]}
        finally:
            self._in_flight -= 1

    def __del__(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.stop(timeout_s=15)  # within Serve's graceful shutdown; its death signal covers a kill
        if getattr(self, "_cached", None) is not None:
            self._cached.close()
