"""The OpenAI-shaped HTTP error: ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from aiohttp import web


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type_, param, code

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}
        return web.json_response(body, status=self.status)
