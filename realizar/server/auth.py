"""Optional API key: with one set, every ``/v1`` route and ``/tokenize``/``/detokenize`` answer 401
(OpenAI's error body, code ``invalid_api_key``) unless the request carries
``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (as Anthropic's clients send it); ``/health``,
``/metrics`` and the chat page (``/`` and ``/static/...``: the page holds no data, and its API calls send the key
the user gives it) stay open. Pure ASGI, so streamed answers pass through untouched."""

from __future__ import annotations

import hmac
import json
from typing import Any

from realizar.server.protocol import error_body

__all__ = ["ApiKeyMiddleware", "protected"]

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def protected(path: str) -> bool:
    return path == "/v1" or path.startswith(PROTECTED_PREFIXES)


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = ("Bearer " + api_key).encode("utf-8")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not protected(scope.get("path", "")) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(
            "missing or incorrect API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
            "invalid_request_error", None, "invalid_api_key")).encode("utf-8")  # fmt: skip
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict) -> bool:
        ok = False
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                # the scheme is case-insensitive; compare_digest keeps the key's bytes from leaking by timing
                given = b"Bearer " + value[7:] if value[:7].lower() == b"bearer " else value
                ok |= hmac.compare_digest(given.strip(), self.expected)
            elif name == b"x-api-key":  # (how Anthropic's clients send it)
                ok |= hmac.compare_digest(b"Bearer " + value.strip(), self.expected)
        return ok
