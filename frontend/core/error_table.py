"""The one error vocabulary of both public protocols: every engine error kind
and every admission refusal maps to one (gRPC code, HTTP status, vLLM error
type), and an error after a stream began is one SSE event of vLLM's shape.
gRPC (``server``) and HTTP (``http_gateway``, ``http_batch``) read only this.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import grpc

from pagedserve.common.messages.frontend import ErrorKind
from pagedserve.frontend.core.errors import RETRY_AFTER_S, ApiError, vllm_error_type


class RejectReason(enum.Enum):
    """Why admission refused a request before the engine saw it (a metrics label too)."""

    UNAVAILABLE = "unavailable"  # the engine is gone, restarting or shutting down
    QUEUE_FULL = "queue_full"  # --max-queued-requests requests wait for a first token
    KEY_CONCURRENCY = "key_concurrency"  # --max-concurrent-per-key streams of this key are open


@dataclass(frozen=True)
class ErrorClass:
    grpc_code: grpc.StatusCode
    http_status: int

    @property
    def openai_type(self) -> str:
        """The body's ``type``: vLLM 0.32's name for the status (``errors.vllm_error_type``)."""
        return vllm_error_type(self.http_status)


_INTERNAL = ErrorClass(grpc.StatusCode.INTERNAL, 500)
_UNAVAILABLE = ErrorClass(grpc.StatusCode.UNAVAILABLE, 503)
_BUSY = ErrorClass(grpc.StatusCode.RESOURCE_EXHAUSTED, 429)

ENGINE_ERRORS: dict[ErrorKind, ErrorClass] = {
    ErrorKind.INTERNAL: _INTERNAL,
    # Can never fit the KV pool: not the client's fault, but retrying as is will not help.
    ErrorKind.KV_CACHE: _BUSY,
    ErrorKind.UNAVAILABLE: _UNAVAILABLE,
    ErrorKind.INVALID_REQUEST: ErrorClass(grpc.StatusCode.INVALID_ARGUMENT, 400),
    ErrorKind.DATA_LOSS: ErrorClass(grpc.StatusCode.DATA_LOSS, 500),
}

REJECTIONS: dict[RejectReason, ErrorClass] = {
    RejectReason.UNAVAILABLE: _UNAVAILABLE,
    RejectReason.QUEUE_FULL: _BUSY,
    RejectReason.KEY_CONCURRENCY: _BUSY,
}


def retry_trailers(code: grpc.StatusCode) -> tuple[tuple[str, str], ...]:
    """gRPC's counterpart of HTTP's Retry-After on an UNAVAILABLE refusal: ``retry-after``
    (seconds) and gRPC's own retry pushback (``grpc-retry-pushback-ms``, read by a channel's
    retry policy)."""
    if code != grpc.StatusCode.UNAVAILABLE:
        return ()
    return (("retry-after", str(RETRY_AFTER_S)), ("grpc-retry-pushback-ms", str(RETRY_AFTER_S * 1000)))


def engine_api_error(kind: ErrorKind, message: str) -> ApiError:
    cls = ENGINE_ERRORS[kind]
    return ApiError(cls.http_status, message, code=kind.name.lower())


# A full queue or a key at its cap clears as requests finish (seconds): a 429 says to come back
# sooner than a 503 (which adds RETRY_AFTER_S itself). Clients (openai's, schemathesis's) honour it.
BUSY_RETRY_AFTER_S = 1


def rejected_api_error(reason: RejectReason, message: str) -> ApiError:
    cls = REJECTIONS[reason]
    busy = {"Retry-After": str(BUSY_RETRY_AFTER_S)} if cls is _BUSY else None
    return ApiError(cls.http_status, message, code=reason.value, headers=busy)


def sse_error_event(err: ApiError) -> dict[str, Any]:
    """The error as a server-sent event's payload (the status line went out
    with the stream's first bytes)."""
    return err.body()
