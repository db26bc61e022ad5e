"""Connection limits of the HTTP server: how many connections it holds and how long a request may take to arrive.

uvicorn's HTTP/1.1 protocol (httptools: a C parser and chunked framing without Python per event) closes a connection left idle after a response (``timeout_keep_alive``) but
waits forever for the first request's headers, for a request whose headers trickle in and for a body shorter
than its ``Content-Length``; and it accepts connections until the process runs out of file descriptors (then
every accept fails and logs a traceback). :func:`protocol_class` makes a subclass that adds:

* ``header_timeout``: a request's headers must be complete this long after the connection opens or the previous
  response ends, else the connection is closed;
* ``body_timeout``: its body must be complete this long after its headers, else the connection is closed (the
  application sees the client go away);
* ``max_connections``: at the limit, a new connection closes the oldest *idle* one (no request in progress: still
  waiting for headers, or kept alive after a response) to take its place; when every connection is busy, the new
  one is answered 503 (OpenAI's error body) and closed at once. Idle connections cannot lock out real clients,
  and file descriptors stay bounded.

What was closed or refused is logged once per ``log_interval`` at most, with counts. :func:`fit_fd_limit` raises
the process's soft ``RLIMIT_NOFILE`` so the connections fit beside ``FD_RESERVE`` other descriptors (or lowers
``max_connections`` to what the hard limit allows): accepts never fail for want of a descriptor.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["ConnectionLimits", "FD_RESERVE", "fit_fd_limit", "protocol_class"]

log = logging.getLogger("realizar.server")
FD_RESERVE = 256  # descriptors kept for everything but client connections (model files, pipes, the listener...)


@dataclass(frozen=True)
class ConnectionLimits:
    """The server's connection limits (see the module docstring)."""

    max_connections: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    log_interval: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int) \
                or self.max_connections < 1:
            raise ValueError(f"max_connections must be a positive integer, got {self.max_connections!r}")
        for name in ("header_timeout", "body_timeout", "log_interval"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")


def fit_fd_limit(limits: ConnectionLimits) -> ConnectionLimits:
    """``limits`` once the process may open ``max_connections + FD_RESERVE`` descriptors: the soft RLIMIT_NOFILE
    raised towards the hard one, ``max_connections`` lowered (with a warning) where the hard limit is below."""
    import dataclasses

    try:
        import resource
    except ImportError:  # (not on this platform: nothing to fit)
        return limits
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = limits.max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < need:
        room = max(1, soft - FD_RESERVE)
        log.warning("max_connections %d lowered to %d: the process may open %d file descriptors (RLIMIT_NOFILE)",
                    limits.max_connections, room, soft)
        return dataclasses.replace(limits, max_connections=room)
    return limits


def _refusal() -> bytes:
    body = json.dumps({"error": {"message": "the server holds as many connections as it takes, all busy; retry "
                                            "later", "type": "server_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "retry-after: 1\r\nconnection: close\r\n\r\n").encode()
    return head + body


class _Guard:
    """The live connections of one server, oldest first, and the counts of what was closed or refused."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.live: dict[Any, None] = {}  # (insertion order: oldest first)
        self.counts = {"closed idle at the limit": 0, "refused (all busy)": 0, "headers too slow": 0,
                       "body too slow": 0}
        self._logged = 0.0
        self.accepted = 0  # connections seen so far (admitted or not)

    def admit(self, proto: Any) -> bool:
        self.accepted += 1
        if len(self.live) >= self.limits.max_connections:
            victim = next((p for p in self.live if p.idle()), None)
            if victim is None:
                self.note("refused (all busy)")
                return False
            self.release(victim)
            victim.transport.close()
            self.note("closed idle at the limit")
        self.live[proto] = None
        return True

    def release(self, proto: Any) -> None:
        self.live.pop(proto, None)

    def note(self, what: str) -> None:
        self.counts[what] += 1
        now = time.monotonic()
        if now - self._logged >= self.limits.log_interval:
            self._logged = now
            seen = ", ".join(f"{k}: {v}" for k, v in self.counts.items() if v)
            log.warning("connection limits (%d connections at most, headers within %gs, body within %gs): %s",
                        self.limits.max_connections, self.limits.header_timeout, self.limits.body_timeout, seen)
            for k in self.counts:
                self.counts[k] = 0


def protocol_class(limits: ConnectionLimits) -> type:
    """An HTTP/1.1 protocol class for ``uvicorn.Config(http=...)`` enforcing ``limits`` (one guard per class)."""
    guard = _Guard(limits)

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._timer = None
            self._waiting = ""
            self._cycle_seen = None
            if not guard.admit(self):
                transport.write(_refusal())
                transport.close()
                return
            self._arm("headers", limits.header_timeout)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._progress()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm("headers", limits.header_timeout)  # (the next request's; a pipelined one is under way)
            self._progress()  # (a pipelined request may have started)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.release(self)
            self._disarm()
            super().connection_lost(exc)

        def idle(self) -> bool:
            """No request in progress: waiting for headers, or kept alive after a response."""
            return not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete)

        # ---- timers ------------------------------------------------------------------------------------
        def _progress(self) -> None:
            cycle = self.cycle
            if cycle is not None and cycle is not self._cycle_seen:  # a request's headers arrived
                self._cycle_seen = cycle
                self._disarm()
                if cycle.more_body:
                    self._arm("body", limits.body_timeout)
            elif self._waiting == "body" and cycle is not None and not cycle.more_body:
                self._disarm()

        def _arm(self, what: str, seconds: float) -> None:
            self._disarm()
            self._waiting = what
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
            self._timer, self._waiting = None, ""

        def _expired(self) -> None:
            what, self._timer = self._waiting, None
            if self.transport.is_closing():
                return
            guard.note("headers too slow" if what == "headers" else "body too slow")
            self.transport.close()

    GuardedProtocol.guard = guard
    return GuardedProtocol
