"""The app's ASGI guards: the API key on every route but /health, and the request body size.
Their refusals take the shape of the API the route speaks (`errors.error_response`)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from portside.server.errors import APIError, error_response, route_path

OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`, on every route but
    /health (constant-time compare)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        x_api_key = headers.get(b"x-api-key")
        scheme, _, token = auth.partition(b" ")
        # compare_digest runs in time independent of where the strings differ
        ok = hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"
        if x_api_key is not None:
            ok = hmac.compare_digest(x_api_key.strip(), self._key) or ok
        if not ok:
            message = ("Incorrect API key provided" if auth or x_api_key is not None
                       else "Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')")
            err = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(scope, err)(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for request bodies over `max_bytes`, by Content-Length or by counting as they arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._too_large(scope, receive, send)
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large")
            return message

        await self.app(scope, limited_receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(scope, APIError(413, f"request body exceeds {self.max_bytes} bytes", code="request_too_large"))
        await response(scope, receive, send)
