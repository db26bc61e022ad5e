"""Requests a browser makes on another site's behalf: refused unless allowed.

* **Origin.** A browser marks every cross-site request with ``Origin``; API clients (curl, the OpenAI SDKs) send
  none. A request whose ``Origin`` is neither the server's own (same scheme, host and port as its ``Host``) nor one
  of ``allowed_origins`` is answered 403, so a page elsewhere cannot run generations through a user's browser
  (a ``text/plain`` POST needs no preflight). For the allowed origins CORS is on: preflight ``OPTIONS`` requests
  are answered and responses carry ``Access-Control-Allow-Origin``. With none allowed (the default) no CORS
  header is ever sent.
* **Host** (``loopback_hosts``, set when the server listens on loopback without an API key): a request whose
  ``Host`` is not a loopback name (``localhost``, ``127.0.0.1``, ``[::1]``, any port) is answered 403: a page
  whose DNS name was rebound to 127.0.0.1 still sends its own name as ``Host``.

Pure ASGI (streamed answers pass untouched); the 403s carry OpenAI's error body.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from realizar.server.protocol import error_body

__all__ = ["LOOPBACK_NAMES", "OriginMiddleware"]

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _host_name(host: str) -> str:
    """``host`` (a Host header) without its port, lowercased: ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class OriginMiddleware:
    def __init__(self, app: Any, allowed_origins: Sequence[str] = (), loopback_hosts: bool = False):
        self.app = app
        self.allowed = {o.rstrip("/").lower() for o in allowed_origins}
        self.loopback_hosts = loopback_hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host, origin = headers.get("host", ""), headers.get("origin")
        if self.loopback_hosts and _host_name(host) not in LOOPBACK_NAMES:
            await _refuse(send, f"this server answers requests addressed to a loopback name only, not Host {host!r}",
                          "host_not_allowed")
            return
        if origin is None or origin.rstrip("/").lower() in (f"http://{host.lower()}", f"https://{host.lower()}"):
            await self.app(scope, receive, send)
            return
        ok = "*" in self.allowed or origin.rstrip("/").lower() in self.allowed
        if not ok:
            await _refuse(send, f"requests from Origin {origin!r} are not allowed (serve --allowed-origins)",
                          "origin_not_allowed")
            return
        cors = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await send({"type": "http.response.start", "status": 204, "headers": cors + [
                (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
                (b"access-control-allow-headers", b"Authorization, Content-Type"),
                (b"access-control-max-age", b"600")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_cors)


async def _refuse(send: Any, message: str, code: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode("utf-8")
    await send({"type": "http.response.start", "status": 403, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
