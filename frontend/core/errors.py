"""The HTTP error body, as vLLM 0.32's ``ErrorResponse`` gives it:
``{"error": {"message", "type", "param", "code"}}`` with ``code`` the HTTP status (an
integer, vLLM's ``ErrorInfo.code: int``) and ``type`` vLLM's name for that status
(``BadRequestError``, ``NotFoundError``, ..., else the status phrase as vLLM's
HTTPException handler gives it, e.g. ``Method Not Allowed``)."""
from __future__ import annotations

from http import HTTPStatus

from aiohttp import web

# vLLM's exception classes -> names (serve/exception_handling/error_response.py).
_VLLM_TYPES = {
    400: "BadRequestError",  # VLLMValidationError, ValueError, VLLMClientError
    404: "NotFoundError",  # VLLMNotFoundError: a model that is not served
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",  # RetryableRequestError: the engine cannot take it now
}


def vllm_error_type(status: int, routing: bool = False) -> str:
    """vLLM's ``type`` for ``status``; ``routing`` for the router's own 404/405 (FastAPI's
    HTTPException, whose type is the status phrase: ``Not Found``)."""
    if not routing and status in _VLLM_TYPES:
        return _VLLM_TYPES[status]
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError"


class ApiError(Exception):
    """``reason`` (e.g. ``model_not_found``, ``queue_full``) is ours, for logs and callers;
    the body carries vLLM's ``type`` and the integer ``code``. ``headers`` go on the
    response (``Retry-After`` on a 503, ``Allow`` on a 405)."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 param: str | None = None, code: str | None = None, *, routing: bool = False,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param
        # ``type_`` (an OpenAI-style name from older callers) is kept as the reason only.
        self.reason = code or type_
        self.type = vllm_error_type(status, routing)
        self.code = status
        self.headers = dict(headers or {})
        if status == 503 and "Retry-After" not in self.headers:
            self.headers["Retry-After"] = str(RETRY_AFTER_S)

    def body(self) -> dict[str, object]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


# A 503 says when to come back: a component's recovery takes about this long on an idle server.
RETRY_AFTER_S = 5
