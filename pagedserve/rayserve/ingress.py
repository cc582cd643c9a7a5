"""The ingress: a forwarding proxy, not a second OpenAI server. Every request
goes unchanged (method, path, query, headers including Authorization, body)
to one replica's own pagedserve HTTP server, and that server's response comes
back as it is (status, headers, body; an SSE stream chunk by chunk, as the
engine flushes it). So every route, error, auth check and model name is the
engine's own.

It reads only what routing needs: the prompt (or the chat messages, through
the model's chat template) of /v1/completions and /v1/chat/completions,
tokenized with the model's tokenizer, as block hashes (vLLM's sha256_cbor,
common/block_hash.py) that the KV-aware router matches against what each
replica caches. A body it cannot read is forwarded without hashes: the
engine answers it (with its own 4xx).

Its own routes: /health (the replicas' health) and /metrics (each replica's
engine metrics with a ``replica`` label, and the router's families).

A replica that dies, or whose engine refuses the connection, before the
response began is replaced by another: the client sees one answer. One that
dies mid-stream ends the stream with an OpenAI error event."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedserve.common.block_hash import prompt_block_hashes
from pagedserve.rayserve import observe

log = logging.getLogger("ray.serve")
MAX_ATTEMPTS = 4
MAX_BODY_BYTES = 32 << 20  # as the engine's own bound on a body (frontend: MAX_REQUEST_BYTES)
# Bounds on what the ingress itself tokenizes for routing (past them: forwarded without hashes)
MAX_PROMPT_CHARS = 4_000_000
MAX_PROMPT_TOKENS = 1 << 20
MAX_MESSAGES = 10_000
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
DROP_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                                  "upgrade", "proxy-authorization", "proxy-connection"})


def error_response(status: int, message: str, code: str) -> Response:
    """The engine's error object (frontend/errors.py), for what only the ingress can refuse."""
    body = {"error": {"message": message, "type": code, "param": None, "code": status}, "object": "error",
            "message": message, "type": code, "param": None, "code": status}
    return Response(json.dumps(body), status_code=status, media_type="application/json")


class _Unavailable(Exception):
    pass


@serve.deployment
class Ingress:
    def __init__(self, replicas: DeploymentHandle, model: str | None, block_size: int,
                 stats_period_s: float = 0.5) -> None:
        from transformers import AutoTokenizer

        from pagedserve.common.default_model import resolve_model

        self._replicas = replicas.options(stream=True)
        self._replica_deployment = replicas.deployment_name
        self._tok = AutoTokenizer.from_pretrained(resolve_model(model))
        self._bs = block_size
        self._period = stats_period_s

    # ------------------------------------------------------------ routing
    def _prompt_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        if path == "/v1/completions":
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1:  # a batch of one
                p = p[0]
            if isinstance(p, str) and 0 < len(p) <= MAX_PROMPT_CHARS:
                return list(self._tok.encode(p))
            if isinstance(p, list) and 0 < len(p) <= MAX_PROMPT_TOKENS and all(type(t) is int for t in p):
                return p
            return None
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not 0 < len(msgs) <= MAX_MESSAGES or len(str(msgs)) > MAX_PROMPT_CHARS:
            return None
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        out = self._tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        return list(out)

    def _hashes(self, path: str, raw: bytes) -> list[int]:
        """The prompt's block hashes, or none for what the engine will refuse (or reads otherwise)."""
        if path not in ROUTED_PATHS or not raw:
            return []
        try:
            body = json.loads(raw)
            ids = self._prompt_ids(path, body) if isinstance(body, dict) else None
        except Exception:  # noqa: BLE001 - a body or template the engine will judge; route it by load
            return []
        return prompt_block_hashes(ids, self._bs) if ids else []

    # ------------------------------------------------------------ HTTP
    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/health":
            return await self._health()
        if request.method == "GET" and path == "/metrics":
            return Response(await observe.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                return error_response(413, f"body: larger than {MAX_BODY_BYTES} bytes", "BadRequestError")
        hashes = await asyncio.to_thread(self._hashes, path, raw) if path in ROUTED_PATHS else []
        query = request.url.query
        req = {"method": request.method, "path": path + (f"?{query}" if query else ""), "body": raw,
               "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in DROP_REQUEST_HEADERS],
               "block_hashes": hashes}
        for attempt in range(MAX_ATTEMPTS):
            gen = self._replicas.forward.remote(req)
            try:
                head = await gen.__anext__()
            except StopAsyncIteration:
                head = None
            except (RayActorError, RayTaskError) as e:  # the replica died, or its engine refused the connection
                log.warning("ingress: %s %s: attempt %d on a replica that failed: %s", request.method, path,
                            attempt + 1, str(e).splitlines()[0][:300])
                observe.RETRIES.inc()
                await asyncio.sleep(self._period)  # the router learns of it within a stats period
                continue
            if head is None:
                break
            if "body" in head:
                return Response(head["body"], status_code=head["status"], headers=dict(head["headers"]))
            return StreamingResponse(self._rest(gen, head), status_code=head["status"],
                                     headers=dict(head["headers"]))
        return error_response(503, "no replica could take the request", "ServiceUnavailableError")

    async def _rest(self, gen: Any, head: dict[str, Any]) -> AsyncIterator[bytes]:
        sse = any(k.lower() == "content-type" and "text/event-stream" in v for k, v in head["headers"])
        try:
            async for chunk in gen:
                yield chunk
        except (RayActorError, RayTaskError) as e:
            log.warning("ingress: replica %s failed mid-response: %s", head.get("replica"),
                        str(e).splitlines()[0][:300])
            observe.BROKEN.inc()
            if sse:
                err = {"error": {"message": "the replica serving this stream failed", "type": "InternalServerError",
                                 "param": None, "code": 500}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()

    async def _health(self) -> Response:
        """200 while a replica can take requests. The router's view (each replica's health and load, from its
        stats), and Serve's count of replicas by state: a replica restarting shows as STARTING or RECOVERING."""
        ctx = serve.get_replica_context()
        states = await asyncio.to_thread(observe.serve_states, ctx.app_name, self._replica_deployment)
        reps = observe.replica_states()
        ok = any(r["healthy"] for r in reps) if reps else states.get("RUNNING", 0) > 0
        body = {"status": "ok" if ok else "unavailable", "replicas": reps, "replica_states": states}
        return Response(json.dumps(body), status_code=200 if ok else 503, media_type="application/json")
