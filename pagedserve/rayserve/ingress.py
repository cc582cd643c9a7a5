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

Its own routes: /health (the replicas' health), /metrics (each replica's
engine metrics with a ``replica`` label, and the router's families), and
POST /pagedserve/route (a prompt or chat messages in, the chosen replica's
gRPC address out: gRPC clients talk to the engine directly).

A replica that dies, whose engine refuses the connection, or whose engine
answers 503 (it is starting or recovering a component), before the response
began is replaced by another: the client sees one answer. One that
dies mid-stream: the stream resumes on another replica where it was cut
(resume.py), or, where a continuation cannot reproduce it, ends with an
OpenAI error event."""
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
from pagedserve.common.routing_prompt import routing_token_ids
from pagedserve.rayserve import observe
from pagedserve.rayserve.resume import StreamState

log = logging.getLogger("ray.serve")
MAX_ATTEMPTS = 4
MAX_BODY_BYTES = 32 << 20  # as the engine's own bound on a body (frontend: MAX_REQUEST_BYTES)
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
ROUTE_PATH = "/pagedserve/route"  # for gRPC clients: which replica, for this prompt (docs/deployment.md)
DROP_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                                  "upgrade", "proxy-authorization", "proxy-connection"})


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   code: str | None = None) -> Response:
    """The engine's error object (frontend/errors.py), for what only the ingress can refuse."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(json.dumps(body), status_code=status, media_type="application/json")


async def gen_close(gen: Any) -> None:
    """Stops reading a replica's response (its stream is cancelled)."""
    try:
        gen.cancel()
    except Exception:  # noqa: BLE001 - already finished
        pass


async def _finished(state: StreamState) -> AsyncIterator[bytes]:
    """The end of a stream whose budget was spent when its replica died: a length finish, then [DONE]."""
    chat = state.path == "/v1/chat/completions"
    choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"} if chat else \
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    obj = {"id": state.id, "object": "chat.completion.chunk" if chat else "text_completion",
           "created": state.created, "model": state.model, "choices": [choice]}
    yield f"data: {json.dumps(obj)}\n\ndata: [DONE]\n\n".encode()


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
    def _hashes(self, path: str, raw: bytes) -> list[int]:
        """The prompt's block hashes, or none for what the engine will refuse (or reads otherwise)."""
        if path not in (*ROUTED_PATHS, ROUTE_PATH) or not raw:
            return []
        try:
            body = json.loads(raw)
            if path == ROUTE_PATH and isinstance(body, dict):  # a prompt (text or ids) or chat messages
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            ids = routing_token_ids(self._tok, path, body) if isinstance(body, dict) else None
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
        buf = bytearray()
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > MAX_BODY_BYTES:
                return error_response(413, f"body: larger than {MAX_BODY_BYTES} bytes", "invalid_request_error",
                                      "body")
        raw = bytes(buf)
        hashes = await asyncio.to_thread(self._hashes, path, raw) if path in (*ROUTED_PATHS, ROUTE_PATH) else []
        query = request.url.query
        req = {"method": request.method, "path": path + (f"?{query}" if query else ""), "body": raw,
               "headers": [(k, v) for k, v in request.headers.items() if k.lower() not in DROP_REQUEST_HEADERS],
               "block_hashes": hashes}
        if request.method == "POST" and path == ROUTE_PATH:
            return await self._route(req)
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
            if head["status"] == 503 and attempt < MAX_ATTEMPTS - 1:  # that engine is starting or recovering
                log.warning("ingress: %s %s: replica %s answered 503, trying another", request.method, path,
                            head.get("replica"))
                observe.RETRIES.inc()
                await gen_close(gen)
                await asyncio.sleep(self._period)  # its next stats report says it is unhealthy
                continue
            if "body" in head:
                return Response(head["body"], status_code=head["status"], headers=dict(head["headers"]))
            return StreamingResponse(self._rest(gen, head, req), status_code=head["status"],
                                     headers=dict(head["headers"]))
        return error_response(503, "no replica could take the request", "service_unavailable",
                              code="unavailable")

    async def _route(self, req: dict[str, Any]) -> Response:
        """The replica the router picks for this prompt: its gRPC address, for a client that speaks gRPC to it
        directly. The router counts the prompt's blocks there at once, as for a forwarded request."""
        for _ in range(MAX_ATTEMPTS):
            try:
                got = await self._replicas.options(stream=False).where.remote(
                    {"headers": req["headers"], "block_hashes": req["block_hashes"]})
            except (RayActorError, RayTaskError):
                observe.RETRIES.inc()
                await asyncio.sleep(self._period)
                continue
            return Response(got["body"], status_code=got["status"], media_type="application/json")
        return error_response(503, "no replica could take the request", "service_unavailable",
                              code="unavailable")

    def _count(self, text: str, ids: bool = False) -> Any:
        out = list(self._tok.encode(text, add_special_tokens=False))
        return out if ids else len(out)

    async def _rest(self, gen: Any, head: dict[str, Any], req: dict[str, Any]) -> AsyncIterator[bytes]:
        """The body after the head. An SSE stream goes event by event, and resumes on another replica when
        its replica dies (resume.py); any other body ends where the replica died."""
        sse = any(k.lower() == "content-type" and "text/event-stream" in v for k, v in head["headers"])
        state = StreamState(req["path"].split("?", 1)[0], req["body"]) if sse else None
        while True:
            try:
                async for chunk in gen:
                    if state is None:
                        yield chunk
                        continue
                    for ev in state.events(chunk):
                        out = ev if not state.resumed else state.rewrite(ev)
                        if out:
                            yield out
                return
            except (RayActorError, RayTaskError) as e:
                log.warning("ingress: replica %s failed mid-response: %s", head.get("replica"),
                            str(e).splitlines()[0][:300])
                gen = await self._resume(state, req) if state is not None else None
                if gen is None:
                    observe.BROKEN.inc()
                    if state is not None:
                        yield self._broken(state)
                    return

    async def _resume(self, state: StreamState, req: dict[str, Any]) -> Any:
        """The continuation's stream on another replica, past its head; None if it cannot resume."""
        if not state.resumable() or state.resumed >= MAX_ATTEMPTS:
            log.warning("ingress: the stream cannot resume (%s)", "resumed too often" if state.resumed
                        else "its body asks for what a continuation would change")
            return None
        body = await asyncio.to_thread(state.continuation, self._count)
        if body is None:  # the budget was spent: the stream is complete but for its end
            return _finished(state)
        state.resumed += 1
        state.buf = b""
        cont = {**req, "body": body, "block_hashes": await asyncio.to_thread(self._hashes, state.path, body)}
        for _ in range(MAX_ATTEMPTS * 2):
            await asyncio.sleep(self._period)  # the router learns of the dead replica
            gen = self._replicas.forward.remote(cont)
            try:
                head = await gen.__anext__()
            except (RayActorError, RayTaskError) as e:
                log.warning("ingress: the continuation failed: %s", str(e).splitlines()[0][:300])
                continue
            if head["status"] == 503:
                await gen_close(gen)
                continue  # that engine is recovering too: another
            if head["status"] != 200 or "body" in head:
                log.warning("ingress: the continuation was refused: %s %s", head["status"], head.get("body"))
                return None
            observe.RESUMED.inc()
            return gen
        log.warning("ingress: no replica took the continuation")
        return None

    def _broken(self, state: StreamState) -> bytes:
        err = {"error": {"message": "the replica serving this stream failed", "type": "internal_server_error",
                         "param": None, "code": "replica_failed"}}
        return f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()

    async def _health(self) -> Response:
        """200 while a replica can take requests. The router's view (each replica's health and load, from its
        stats), and Serve's count of replicas by state: a replica restarting shows as STARTING or RECOVERING."""
        ctx = serve.get_replica_context()
        states = await asyncio.to_thread(observe.serve_states, ctx.app_name, self._replica_deployment)
        reps = [{k: v for k, v in r.items() if k != "http"} for r in observe.replica_states()]  # no addresses
        ok = any(r["healthy"] for r in reps) if reps else states.get("RUNNING", 0) > 0
        body = {"status": "ok" if ok else "unavailable", "replicas": reps, "replica_states": states}
        return Response(json.dumps(body), status_code=200 if ok else 503, media_type="application/json")
