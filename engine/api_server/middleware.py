"""Two ASGI guards in front of every route: the API key on /v1, and the request body limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would hide the
client's disconnect from the streaming routes.
"""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.api_server.errors import error_response


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every /v1 route, 401 in OpenAI's format otherwise."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.expected is None or scope["type"] != "http" or not scope["path"].startswith("/v1")
                or scope["method"] == "OPTIONS"):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        message = ("Missing API key: send it as 'Authorization: Bearer <key>'." if not given
                   else "Incorrect API key provided.")
        response = error_response(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, by its Content-Length or as it streams in."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            status = 413 if length.isdigit() else 400
            message = (f"the request body is {int(length)} bytes; the limit is {self.max_bytes}"
                       if status == 413 else "invalid Content-Length header")
            return await error_response(status, message)(scope, receive, send)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # chunked, with no Content-Length to check up front
                    raise HTTPException(413, f"the request body exceeds the limit of {self.max_bytes} bytes")
            return message

        await self.app(scope, limited_receive, send)
