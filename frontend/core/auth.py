"""Bearer-token auth for the gRPC API and the HTTP gateway.

Keys come from ``--api-key`` (one or more) and/or ``--api-key-file`` (one key per line,
``#`` comments). Clients send ``authorization: Bearer <key>`` (gRPC metadata
or HTTP header). Health checks and reflection stay open so load balancers and
``grpcurl describe`` work without a key; everything else is refused with
UNAUTHENTICATED (HTTP 401).
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Any, Awaitable, Callable

import grpc

OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str | None:
        """The caller's key id (a short digest, never the key) or None if refused."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].strip().encode()
        # Compare against every key in constant time; no early exit on a match.
        found = None
        for k in self._keys:
            if hmac.compare_digest(given, k):
                found = k
        return hashlib.sha256(found).hexdigest()[:12] if found is not None else None


def load_keys(api_key: str | list[str] | None, key_file: str | None) -> ApiKeys:
    """``api_key``: one key or several (vLLM's ``--api-key k1 k2``); any of them, or of the file's, is accepted."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if key_file:
        with open(key_file) as f:
            keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if any(len(k) < 8 for k in keys):
        raise ValueError("API keys must have at least 8 characters")
    return ApiKeys(keys)


def metadata_value(metadata: Any, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        if self.keys.identify(metadata_value(details.invocation_metadata, "authorization")) is not None:
            return handler
        return _deny(handler)


def _deny(handler: Any) -> Any:
    msg = "missing or invalid API key: send 'authorization: Bearer <key>'"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(stream, **kw)
