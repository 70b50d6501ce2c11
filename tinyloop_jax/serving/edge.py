"""What stands between the network and the routes of `tinyloop serve`: ASGI middleware, outermost
first (`middleware`):

    CORS      Starlette's CORSMiddleware for the listed origins (none by default). Outermost, so a
              browser's preflight is answered without a key and a 401 still carries the header
              the page needs to read it.
    ApiKey    `Authorization: Bearer KEY` on every route but /health and /metrics (deny by
              default: a route added later is guarded too); else 401, type authentication_error.
    BodyLimit a request body over `max_body` bytes: 413, by its Content-Length before anything is
              read, or, chunked, as soon as the bytes read pass the limit; the connection is then
              closed, so the rest is never read (beyond what uvicorn had already buffered, at
              most its 64 KiB flow-control window).
"""

from __future__ import annotations

import secrets

from .protocol import error_body

OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers carry no key


def middleware(api_key: str | None, cors_origins, max_body: int) -> list:
    """The Starlette `Middleware` list of an app with these settings."""
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware

    out = []
    if cors_origins:
        # any header: browser SDKs send their own (x-stainless-*, OpenAI-Organization, ...)
        out.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                              allow_headers=["*"]))
    if api_key:
        out.append(Middleware(ApiKey, key=api_key))
    out.append(Middleware(BodyLimit, max_body=max_body))
    return out


def _json(status: int, body: dict, headers: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


class ApiKey:
    """401 unless the request carries `Authorization: Bearer <key>` (compared in constant time)."""

    def __init__(self, app, key: str):
        if not isinstance(key, str) or not key:
            raise ValueError("api_key must be a non-empty string")
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            from starlette.datastructures import Headers

            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.key)):
                body = error_body("a valid API key is required: send the header Authorization: Bearer <key>",
                                  "authentication_error", code="invalid_api_key")
                return await _json(401, body, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
        await self.app(scope, receive, send)


class BodyTooLarge(Exception):
    """Raised from `receive` once a body passes the limit (not a ValueError: no route catches it)."""


class BodyLimit:
    """413 for a request body over `max_body` bytes, without reading past the limit."""

    def __init__(self, app, max_body: int):
        if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
            raise ValueError(f"max_body must be a positive number of bytes, got {max_body!r}")
        self.app, self.max_body = app, max_body

    def refuse(self):
        body = error_body(f"the request body is larger than this server's limit of {self.max_body} bytes",
                          "invalid_request_error")
        return _json(413, body, {"Connection": "close"})  # the rest of the body is never read

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.datastructures import Headers

        length = Headers(scope=scope).get("content-length", "")  # (the server checked its syntax)
        if length.isdigit() and int(length) > self.max_body:
            return await self.refuse()(scope, receive, send)
        read, started = 0, False

        async def limited_receive():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_body:
                    raise BodyTooLarge
            return message

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, watched_send)
        except BodyTooLarge:
            if started:  # (routes read the body before answering; a stream cannot be taken back)
                raise
            await self.refuse()(scope, receive, send)
