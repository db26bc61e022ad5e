"""Request body limit: a body over ``max_body`` bytes is answered 413 (OpenAI's error body, code
``request_too_large``) before it is read whole.

Pure ASGI, outside FastAPI. A declared ``Content-Length`` over the limit is refused before a byte of
the body is read; a body without one (``Transfer-Encoding: chunked``) is counted as it streams in,
and the moment the count passes the limit the 413 goes out, the application is told the client
went away (an ``http.disconnect`` from ``receive``) and whatever it still sends is dropped. The
connection is closed after a 413. The 413's bytes go out at once, but the response is finished (and
the connection closed) only after the rest of the body has been read and dropped, never kept, up to
``DRAIN_BYTES`` and ``DRAIN_SECONDS``, until the client pauses for ``DRAIN_IDLE_SECONDS``: a socket
closed with unread input is reset, and a client still sending its body could lose the answer with it
(seen on a loaded 2-core machine). A client sending more than that is cut off with that risk.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from realizar.server.protocol import error_body

__all__ = ["BodyLimitMiddleware", "DEFAULT_MAX_BODY", "DRAIN_BYTES", "DRAIN_IDLE_SECONDS", "DRAIN_SECONDS"]

DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes
DRAIN_BYTES = 64 * 1024 * 1024  # most bytes of a refused body read and dropped before the connection closes
DRAIN_SECONDS = 5.0  # most time spent on that
DRAIN_IDLE_SECONDS = 0.25  # a client silent this long has stopped sending


async def _drain(receive: Any) -> None:
    """Read and drop the rest of a refused body (see the module docstring for the bounds)."""
    loop = asyncio.get_running_loop()
    end, seen = loop.time() + DRAIN_SECONDS, 0
    while seen < DRAIN_BYTES:
        left = min(DRAIN_IDLE_SECONDS, end - loop.time())
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send: Any, receive: Any, limit: int, got: str, more_body: bool) -> None:
    """Send the whole 413, drain the rest of the body (``more_body``: the client has more to send),
    then finish the response (the server closes the connection)."""
    start, body = _too_large(limit, got)
    await send(start)
    await send({**body, "more_body": True})
    if more_body:
        await _drain(receive)
    try:
        await send({"type": "http.response.body", "body": b""})
    except OSError:  # the client went away meanwhile: nothing left to finish
        pass


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
            await _refuse(send, receive, limit, f"Content-Length {declared}", more_body=True)
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
                        await _refuse(send, receive, limit, f"more than {limit} bytes",
                                      more_body=message.get("more_body", False))
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, receive_counting, send_guard)
