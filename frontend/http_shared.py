"""What the HTTP gateway and its route modules (``http_batch``, ``http_extras``)
share: a response's context and the gateway surface those routes call. Its own
module so the routes import it instead of ``http_gateway``, which imports them."""
from __future__ import annotations

import time
from typing import Any, Protocol

from aiohttp import web

from pagedserve.frontend.generation import GenerationService, RequestStream
from pagedserve.frontend.outputs import Chunk
from pagedserve.v1 import generation_pb2 as pb


class Ctx:
    """One response's id, object type, model and sample count, fixed when it opens."""

    def __init__(self, id_: str, obj: str, model: str, n: int) -> None:
        self.id, self.object, self.model, self.n = id_, obj, model, n
        self.created = int(time.time())


class GatewayApi(Protocol):
    """The part of ``http_gateway.Gateway`` the route modules use."""

    svc: GenerationService

    async def json_body(self, request: web.Request) -> dict[str, Any]: ...

    async def prepare(self, req: pb.GenerateRequest, add_special_tokens: bool = True) -> Any: ...

    async def open_stream(self, request: web.Request, prepared: Any) -> RequestStream: ...

    def model_name(self) -> str: ...

    def token_str(self, tok: int) -> str: ...

    def completion_choice(self, c: Chunk, acc: dict[str, Any] | None) -> dict[str, Any]: ...
