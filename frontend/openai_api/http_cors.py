"""CORS and ``root_path`` for the HTTP gateway, as vLLM's FastAPI app has them.

CORS follows Starlette's ``CORSMiddleware`` as vLLM configures it
(``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``,
``--allow-credentials``); without allowed origins there is none. A preflight
(``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) is answered
here, before authentication, with 200 ``OK`` or 400 ``Disallowed CORS origin``;
every other response to a request with ``Origin`` gets
``Access-Control-Allow-Origin`` (``*``, or the origin when it is listed) and
``Vary: Origin``.

``root_path``: the prefix a proxy serves us under. As with Starlette's
``root_path``, a path that starts with it is served as the path without it, so
both ``/v1/models`` (a proxy that strips the prefix) and ``<root>/v1/models``
(one that does not) reach the same route.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from pagedserve.frontend.openai_api.openai_options import OpenAIOptions

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")  # Starlette's "*"
_SAFELISTED = {"Accept", "Accept-Language", "Content-Language", "Content-Type"}
_PREFLIGHT_VARY = ("Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
                   "Access-Control-Request-Private-Network")
MAX_AGE_S = 600


class Cors:
    """Starlette's CORSMiddleware with vLLM's flags; no origins: no CORS at all."""

    def __init__(self, opts: OpenAIOptions) -> None:
        self.on = bool(opts.allowed_origins)
        self.origins = opts.allowed_origins
        self.allow_all = "*" in opts.allowed_origins
        self.methods = ALL_METHODS if "*" in opts.allowed_methods else opts.allowed_methods
        self.all_headers = "*" in opts.allowed_headers
        self.headers = sorted(_SAFELISTED | set(opts.allowed_headers))
        self.credentials = opts.allow_credentials
        self.explicit = not self.allow_all or self.credentials  # answer with the origin, not "*"

    def allowed(self, origin: str) -> bool:
        return self.allow_all or origin in self.origins

    def preflight(self, request: web.Request) -> web.Response | None:
        """The answer to a CORS preflight, or None for any other request."""
        origin = request.headers.get("Origin")
        if (not self.on or origin is None or request.method != "OPTIONS"
                or "Access-Control-Request-Method" not in request.headers):
            return None
        headers = {"Vary": _PREFLIGHT_VARY}
        if not self.explicit:
            headers["Access-Control-Allow-Origin"] = "*"
        headers["Access-Control-Allow-Methods"] = ", ".join(self.methods)
        headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        if not self.all_headers:
            headers["Access-Control-Allow-Headers"] = ", ".join(self.headers)
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        failures = []
        if not self.allowed(origin):
            failures.append("origin")
        elif self.explicit:
            headers["Access-Control-Allow-Origin"] = origin
        if request.headers["Access-Control-Request-Method"] not in self.methods:
            failures.append("method")
        requested = request.headers.get("Access-Control-Request-Headers")
        if self.all_headers and requested is not None:  # every header allowed: mirrored back
            headers["Access-Control-Allow-Headers"] = requested
        elif requested is not None and any(h.strip() not in [a.lower() for a in self.headers]
                                           for h in requested.lower().split(",")):
            failures.append("headers")
        if request.headers.get("Access-Control-Request-Private-Network") is not None:
            failures.append("private-network")
        if failures:
            return web.Response(status=400, text="Disallowed CORS " + ", ".join(failures), headers=headers)
        return web.Response(status=200, text="OK", headers=headers)

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Before any response's headers go out (streams included)."""
        if not self.on or "Access-Control-Max-Age" in response.headers:
            return  # no CORS, or a preflight answer, complete already
        origin = request.headers.get("Origin")
        if origin is not None:
            if self.allow_all:
                response.headers["Access-Control-Allow-Origin"] = "*"
            if self.credentials:
                response.headers["Access-Control-Allow-Credentials"] = "true"
        vary = ", ".join([*response.headers.getall("Vary", []), "Origin"])
        if origin is not None and (self.allow_all and self.credentials or not self.allow_all and self.allowed(origin)):
            response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = vary


def route_path(request: web.Request, root_path: str) -> str:
    """The request's path without the root path (the routes' own path)."""
    path = request.path
    if root_path and (path == root_path or path.startswith(root_path + "/")):
        return path[len(root_path):] or "/"
    return path


def add_prefixed_routes(app: web.Application, root_path: str) -> None:
    """Each route also under ``root_path`` (a proxy that forwards the prefix)."""
    if not root_path:
        return
    routes: list[tuple[str, str, Any]] = []
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path")
        if path is not None and route.method != "HEAD":
            routes.append((route.method, path, route.handler))
    for method, path, handler in routes:
        app.router.add_route(method, root_path + path, handler)


def normalize_root(root_path: str) -> str:
    return "/" + root_path.strip("/") if root_path.strip("/") else ""
