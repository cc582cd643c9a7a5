"""What the HTTP gateway and its route modules (``http_batch``, ``http_extras``,
``http_response``) share: a response's context and the gateway surface those
routes call. Its own module so the routes import it instead of ``http_gateway``,
which imports them."""
from __future__ import annotations

import time
from typing import Any, Protocol

from aiohttp import web

from pagedserve.frontend.core.generation import GenerationService, RequestStream
from pagedserve.frontend.openai_api.openai_extras import Extras
from pagedserve.frontend.openai_api.openai_options import OpenAIOptions
from pagedserve.frontend.core.prompt_options import InputOptions
from pagedserve.frontend.openai_api.server_flags import ServerFlags
from pagedserve.v1 import generation_pb2 as pb


class Ctx:
    """One response's id, object type, model and sample count, fixed when it opens;
    with the request's vLLM extras, the chat role and what chat ``echo`` prepends."""

    def __init__(self, id_: str, obj: str, model: str, n: int, extras: Extras | None = None,
                 role: str = "assistant", echo_text: str = "", prompt_text: str | None = None,
                 prompt_details: bool = False) -> None:
        self.id, self.object, self.model, self.n = id_, obj, model, n
        self.extras, self.role, self.echo_text, self.prompt_text = extras, role, echo_text, prompt_text
        self.created = int(time.time())
        self.prompt_details = prompt_details  # usage.prompt_tokens_details (--enable-prompt-tokens-details)


class GatewayApi(Protocol):
    """The part of ``http_gateway.Gateway`` the route modules use."""

    svc: GenerationService
    opts: OpenAIOptions
    flags: ServerFlags

    async def json_body(self, request: web.Request) -> dict[str, Any]: ...

    async def prepare(self, req: pb.GenerateRequest, add_special_tokens: bool = True,
                      options: InputOptions | None = None) -> Any: ...

    async def open_stream(self, request: web.Request, prepared: Any) -> RequestStream: ...

    def model_name(self) -> str: ...

    def token_str(self, tok: int) -> str: ...
