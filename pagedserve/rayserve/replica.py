"""One Ray Serve replica = one pagedserve engine (engine.py): started by the
replica and stopped with it, its KV events read into the set of block hashes
it caches (reported to the router as routing stats, with its load, its health
and its addresses), and ``forward``: an HTTP request passed unchanged to the
engine's own OpenAI server, its response streamed back as it comes (first the
status and headers, then the body's bytes)."""
from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import zmq
from ray import serve

from pagedserve.blockmgr.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from pagedserve.rayserve.engine import Engine, start_engine

# Response headers the HTTP server in front (Serve's proxy) sets itself
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "content-length", "date", "server", "host"})
WHOLE_BODY_BYTES = 8 << 20  # a response with a length up to this comes back in one piece
HEALTH_TIMEOUT_S = 2.0


class EngineUnavailable(RuntimeError):
    """The engine did not take the request (it is down or restarting): the ingress tries another replica."""


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
        import ray

        self._engine: Engine = start_engine(model, serve_args, ray.util.get_node_ip_address())
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._cached = CachedBlocks(self._ctx, self._engine.kv_pub, self._engine.kv_replay)
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        self._engine_ok = True  # its /health, as of the last stats report
        self._id = serve.get_replica_context().replica_id.unique_id

    async def _engine_healthy(self) -> bool:
        """The engine's own /health: 503 while it starts or recovers a component (docs/fault-tolerance.md)."""
        if not self._engine.alive():
            return False
        try:
            async with self._http().get(self._engine.http_url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads (every request_routing_stats_period_s), and the ingress's /health and /metrics."""
        self._engine_ok = await self._engine_healthy()
        return {"cached_blocks": self._cached.snapshot(), "in_flight": self._in_flight, "healthy": self._engine_ok,
                "http": self._engine.http_url, "at": time.time()}

    def check_health(self) -> None:
        if not self._engine.alive():
            raise RuntimeError(f"the engine exited with {self._engine.proc.returncode}")

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=10), auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, force_close=False))
        return self._session

    async def forward(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any] | bytes]:
        """``req``: method, path (with its query), headers, body. Yields {"status", "headers"} (with
        "body" when the whole body came at once), then the body's chunks as the engine writes them."""
        self._in_flight += 1
        try:
            try:
                resp = await self._http().request(req["method"], self._engine.http_url + req["path"],
                                                  headers=req["headers"], data=req["body"], allow_redirects=False)
            except (aiohttp.ClientConnectionError, OSError) as e:
                self._engine_ok = False
                raise EngineUnavailable(f"replica {self._id}: the engine is not answering ({e})") from None
            async with resp:
                headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers
                           if k.decode("latin-1").lower() not in HOP_BY_HOP]
                head: dict[str, Any] = {"status": resp.status, "headers": headers, "replica": self._id}
                if resp.content_length is not None and resp.content_length <= WHOLE_BODY_BYTES:
                    head["body"] = await resp.read()
                    yield head
                    return
                yield head
                async for chunk in resp.content.iter_any():  # as the engine flushes it: SSE events unbuffered
                    yield chunk
        finally:
            self._in_flight -= 1

    async def where(self, req: dict[str, Any]) -> dict[str, Any]:
        """For a gRPC client (docs/deployment.md): this engine's addresses, once its HTTP server accepts the
        request's Authorization (the engine's own check: its 401 comes back as is)."""
        try:
            async with self._http().get(self._engine.http_url + "/v1/models", headers=req["headers"]) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return {"status": resp.status, "body": body}
        except (aiohttp.ClientConnectionError, OSError) as e:
            raise EngineUnavailable(f"replica {self._id}: the engine is not answering ({e})") from None
        return {"status": 200, "body": msgspec.json.encode({"replica": self._id, "grpc": self._engine.grpc_addr,
                                                            "http": self._engine.http_url})}

    def __del__(self) -> None:
        """Serve calls it on a graceful shutdown (serve.shutdown, a scale-down): the engine stops, its folder goes."""
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.stop(timeout_s=15)  # within Serve's graceful shutdown; the death signal covers a kill
        if getattr(self, "_cached", None) is not None:
            self._cached.close()
