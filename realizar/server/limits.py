"""Request body limit: a body over ``max_body`` bytes is answered 413 (OpenAI's error body, code
``request_too_large``) before it is read whole.

Pure ASGI, outside FastAPI. A declared ``Content-Length`` over the limit is refused before a byte of
the body is read; a body without one (``Transfer-Encoding: chunked``) is counted as it streams in,
and the moment the count passes the limit the 413 goes out, the application is told the client
went away (an ``http.disconnect`` from ``receive``) and whatever it still sends is dropped. The
connection is closed after a 413 (the unread rest of the body is never drained).
"""

from __future__ import annotations

import json
from typing import Any

from realizar.server.protocol import error_body

__all__ = ["BodyLimitMiddleware", "DEFAULT_MAX_BODY"]

DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes


def _too_large(limit: int, got: str) -> tuple[dict, dict]:
    body = json.dumps(error_body(f"the request body is too large: {got}, the limit is {limit} bytes",
                                 "invalid_request_error", None, "request_too_large")).encode("utf-8")  # fmt: skip
    start = {"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]}  # fmt: skip
    return start, {"type": "http.response.body", "body": body}


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_body: int = DEFAULT_MAX_BODY):
        if int(max_body) != max_body or max_body <= 0:
            raise ValueError(f"max_body must be a positive number of bytes, got {max_body!r}")
        self.app = app
        self.max_body = int(max_body)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                break
        if declared is not None and declared > limit:
            for message in _too_large(limit, f"Content-Length {declared}"):
                await send(message)
            return

        state = {"seen": 0, "refused": False, "started": False}

        async def send_guard(message: dict) -> None:
            if state["refused"]:
                return  # the 413 has been sent: the application's own answer is dropped
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        async def receive_counting() -> dict:
            if state["refused"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["seen"] += len(message.get("body", b""))
                if state["seen"] > limit:
                    state["refused"] = True
                    if not state["started"]:
                        state["started"] = True
                        for m in _too_large(limit, f"more than {limit} bytes"):
                            await send(m)
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, receive_counting, send_guard)
