"""The one error vocabulary of both public protocols: every engine error kind
and every admission refusal maps to one (gRPC code, HTTP status, OpenAI error
type), and an error after a stream began is one SSE event of OpenAI's shape.
gRPC (``server``) and HTTP (``http_gateway``, ``http_batch``) read only this.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import grpc

from pagedserve.common.messages.frontend import ErrorKind
from pagedserve.frontend.core.errors import ApiError


class RejectReason(enum.Enum):
    """Why admission refused a request before the engine saw it (a metrics label too)."""

    UNAVAILABLE = "unavailable"  # the engine is gone, restarting or shutting down
    QUEUE_FULL = "queue_full"  # --max-queued-requests requests wait for a first token
    KEY_CONCURRENCY = "key_concurrency"  # --max-concurrent-per-key streams of this key are open


@dataclass(frozen=True)
class ErrorClass:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str


_INTERNAL = ErrorClass(grpc.StatusCode.INTERNAL, 500, "server_error")
_UNAVAILABLE = ErrorClass(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable")
_BUSY = ErrorClass(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")

ENGINE_ERRORS: dict[ErrorKind, ErrorClass] = {
    ErrorKind.INTERNAL: _INTERNAL,
    # Can never fit the KV pool: not the client's fault, but retrying as is will not help.
    ErrorKind.KV_CACHE: _BUSY,
    ErrorKind.UNAVAILABLE: _UNAVAILABLE,
    ErrorKind.INVALID_REQUEST: ErrorClass(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
    ErrorKind.DATA_LOSS: ErrorClass(grpc.StatusCode.DATA_LOSS, 500, "server_error"),
}

REJECTIONS: dict[RejectReason, ErrorClass] = {
    RejectReason.UNAVAILABLE: _UNAVAILABLE,
    RejectReason.QUEUE_FULL: _BUSY,
    RejectReason.KEY_CONCURRENCY: _BUSY,
}


def engine_api_error(kind: ErrorKind, message: str) -> ApiError:
    cls = ENGINE_ERRORS[kind]
    return ApiError(cls.http_status, message, cls.openai_type, code=kind.name.lower())


def rejected_api_error(reason: RejectReason, message: str) -> ApiError:
    cls = REJECTIONS[reason]
    return ApiError(cls.http_status, message, cls.openai_type, code=reason.value)


def sse_error_event(err: ApiError) -> dict[str, Any]:
    """The error as a server-sent event's payload (the status line went out
    with the stream's first bytes)."""
    return {"error": {"message": str(err), "type": err.type, "param": err.param, "code": err.code}}
