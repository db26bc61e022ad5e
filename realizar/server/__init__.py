"""OpenAI-compatible HTTP server (FastAPI + uvicorn).

    from realizar.engine import load_engine
    from realizar.server import create_app, serve
    app = create_app(load_engine())          # an ASGI app: run it with any ASGI server
    serve(load_engine(), port=8000)          # or let realizar run uvicorn (127.0.0.1 by default)
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Sequence

from realizar.server.app import create_app

__all__ = ["DRAIN_SECONDS", "bind_socket", "create_app", "graceful_server", "serve", "uvicorn_config"]


def bind_socket(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free port, see ``getsockname()``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
    # Nagle's algorithm holds every small write after the first on a keep-alive connection (SSE chunks too)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, limits: Any = None, **kwargs: Any) -> Any:
    """uvicorn's configuration for ``app`` with realizar's HTTP protocol (httptools) under ``limits``
    (:class:`~realizar.server.connections.ConnectionLimits`; None: its defaults)."""
    import uvicorn

    from realizar.server.connections import ConnectionLimits, fit_fd_limit, protocol_class

    return uvicorn.Config(app, http=protocol_class(fit_fd_limit(limits or ConnectionLimits())), lifespan="on", **kwargs)


# seconds requests in flight may take to finish once shutdown starts (SIGTERM, Ctrl-C), before the rest end with
# a 503 error event; uvicorn then waits up to timeout_graceful_shutdown for their responses to go out
DRAIN_SECONDS = 4.0


def graceful_server(config: Any, app: Any, drain_seconds: float = DRAIN_SECONDS,
                    on_shutdown: Callable[[], None] | None = None, after_drain: Callable[[], None] | None = None) -> Any:
    """A uvicorn server for ``app`` that, on shutdown, stops accepting connections, lets the requests in flight
    finish for ``drain_seconds`` and ends the rest with a 503 error event (streams: the event, then ``[DONE]``;
    whole answers: a JSON 503; :meth:`~realizar.server.scheduler.Scheduler.drain`) before uvicorn's own shutdown,
    which then finds no response to cut off. ``on_shutdown()`` is called as shutdown begins, ``after_drain()``
    (on a worker thread: it may wait, e.g. for other server processes to finish theirs) once the drain is over and
    before the app's own shutdown closes its engine."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        async def shutdown(self, sockets: list | None = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            for server in self.servers:  # (no new connections while the requests in flight finish)
                server.close()
            await app.state.server.scheduler.drain(drain_seconds)
            if after_drain is not None:
                import asyncio

                await asyncio.to_thread(after_drain)
            await super().shutdown(sockets)

    return GracefulServer(config)


def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    model_name: str | list[str] | None = None,
    max_queue: int = 256,
    default_max_tokens: int | None = None,
    log_level: str = "info",
    api_key: str | None = None,
    max_body: int | None = None,
    max_batch: int | None = None,
    kv_memory: int | None = None,
    kv_dtype: str | None = None,
    block_size: int | None = None,
    max_batched_tokens: int | None = None,
    prefill_chunk: int | None = None,
    f16_weights: bool | None = None,
    kv_events: str | None = None,
    kv_events_topic: str = "",
    on_ready: Callable[[str, int], None] | None = None,
    limits: Any = None,
    drain_seconds: float = DRAIN_SECONDS,
    allowed_origins: Sequence[str] = (),
    serving: Any = None,
    sock: socket.socket | None = None,
    on_shutdown: Callable[[], None] | None = None,
    after_drain: Callable[[], None] | None = None,
    chat_page: bool = True,
) -> None:
    """Serve ``engine`` with uvicorn until interrupted (on ``serving``, e.g. an engine process, when given: see
    :func:`create_app`). ``on_ready(host, port)`` is called once the
    socket is bound (with the real port when ``port`` is 0); ``max_body``: the request body limit in
    bytes (default 4 MiB, see :mod:`realizar.server.limits`); ``max_batch``, ``kv_memory`` (bytes),
    ``kv_dtype``, ``block_size``, ``max_batched_tokens``, ``prefill_chunk``, ``f16_weights`` and ``kv_events``
    (with its topic) configure the continuous-batching engine (see :func:`create_app`); ``limits``: the
    connection limits (:class:`~realizar.server.connections.ConnectionLimits`; None: its defaults);
    ``drain_seconds``: how long requests in flight may take to finish at shutdown (:func:`graceful_server`);
    ``allowed_origins``: browser origins allowed cross-site (CORS). Listening on loopback without ``api_key``,
    requests addressed to another Host are refused (DNS rebinding; :mod:`realizar.server.origin`). ``sock``: a
    listening socket to serve on instead of binding ``host:port`` (several server processes share one; it is
    left open); ``on_shutdown``, ``after_drain``: see :func:`graceful_server`; ``chat_page``: serve the chat page
    at ``/``."""
    app = create_app(engine, model_name=model_name, max_queue=max_queue, default_max_tokens=default_max_tokens,
                     api_key=api_key, max_batch=max_batch, kv_memory=kv_memory, kv_dtype=kv_dtype,
                     block_size=block_size, max_batched_tokens=max_batched_tokens, prefill_chunk=prefill_chunk,
                     f16_weights=f16_weights, allowed_origins=allowed_origins,
                     loopback_hosts=api_key is None and host in ("127.0.0.1", "localhost", "::1"), kv_events=kv_events,
                     kv_events_topic=kv_events_topic, serving=serving, chat_page=chat_page,
                     **({} if max_body is None else {"max_body": max_body}))
    own = sock is None
    sock = bind_socket(host, port) if own else sock
    bound_host, bound_port = sock.getsockname()[:2]
    config = uvicorn_config(app, limits, log_level=log_level, timeout_graceful_shutdown=5)
    server = graceful_server(config, app, drain_seconds, on_shutdown, after_drain)
    if on_ready is not None:
        on_ready(bound_host, bound_port)
    try:
        server.run(sockets=[sock])
    finally:
        if own:
            sock.close()
