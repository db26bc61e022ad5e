"""The OpenAI-compatible HTTP server: ``create_app(engine)`` returns a FastAPI application.

Endpoints (:mod:`realizar.server.routes`): ``POST /v1/completions``, ``POST /v1/chat/completions``
(both with ``stream: true`` as Server-Sent Events in OpenAI's chunk format, ending with
``data: [DONE]``), Anthropic's ``POST /v1/messages`` (:mod:`realizar.server.anthropic`), OpenAI's stateless
``POST /v1/responses`` (:mod:`realizar.server.responses_api`), ``GET /v1/models``,
``POST /v1/embeddings`` (:mod:`realizar.server.routes.embeddings`), ``POST /tokenize`` and ``/detokenize``, ``GET /health`` and ``GET /metrics`` (Prometheus text). An optional API key guards every route but the last two
and the chat page (``GET /`` and its ``/static/`` files, :mod:`realizar.server.routes.page`), whose API calls carry
the key themselves.
Errors are answered with OpenAI's error body (:mod:`realizar.server.errors`), Anthropic's under ``/v1/messages``.

Generations run concurrently on the continuous-batching engine (:class:`realizar.serving.ServingEngine`,
through :mod:`realizar.server.scheduler`): every request in flight advances in the same decode steps,
over one paged KV pool with a prefix cache. A client that disconnects, mid-stream or while waiting,
has its generation stopped and its KV blocks freed at once. Request bodies over ``max_body`` bytes
are refused with a 413 before they are read whole (:mod:`realizar.server.limits`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI

from realizar.server.anthropic import AnthropicErrorMiddleware
from realizar.server.auth import ApiKeyMiddleware
from realizar.server.errors import install_error_handlers
from realizar.server.limits import DEFAULT_MAX_BODY, BodyLimitMiddleware
from realizar.server.origin import OriginMiddleware
from realizar.server.metrics import ServerMetrics
from realizar.server.routes import PAGE_ROUTER, ROUTERS
from realizar.server.routes.page import STATIC_PREFIX, files as page_files
from realizar.server.scheduler import Scheduler
from realizar.server.state import ServerState

log = logging.getLogger("realizar.server")

__all__ = ["create_app"]

GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses")
KNOWN_ENDPOINTS = (*GENERATION_ENDPOINTS, "/v1/embeddings", "/v1/models", "/health", "/metrics", "/tokenize",
                   "/detokenize", "/")


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label a request's metrics carry: its path when it is one of :data:`KNOWN_ENDPOINTS`, the
    chat page's files as one, any other path as ``other`` (the labels stay few, whatever clients ask for)."""
    if path in KNOWN_ENDPOINTS:
        return path
    return STATIC_PREFIX.rstrip("/") if path.startswith(STATIC_PREFIX) else "other"


def _context_length(engine: Any, serving: Any = None) -> int:
    """The longest sequence the engine can hold: an engine process's figure, the engine's own, its model's (KV
    cache), or the config's."""
    limits = getattr(serving, "limits", None)
    if limits is not None and not callable(limits):
        return int(limits.context_length)
    for obj, attr in ((engine, "context_length"), (getattr(engine.generator, "model", None), "context_length")):
        value = getattr(obj, attr, None) if obj is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return int(engine.config.context_length)


def _vocab_size(engine: Any) -> int:
    n = getattr(engine.tokenizer, "vocab_size", None)
    return int(n) if isinstance(n, int) else int(engine.config.vocab_size)


class _MetricsMiddleware:
    """Counts responses by endpoint and status and times generation requests (pure ASGI, so that it
    neither buffers streaming responses nor hides client disconnects)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = endpoint_label(scope.get("path", ""))
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
            if endpoint in GENERATION_ENDPOINTS and status["code"] < 400:
                self.metrics.request_latency.labels(endpoint=endpoint).observe(time.perf_counter() - t0)


def create_app(
    engine: Any,
    *,
    model_name: str | Sequence[str] | None = None,
    max_queue: int = 256,
    default_max_tokens: int | None = None,
    api_key: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    serving: Any = None,
    max_batch: int | None = None,
    kv_memory: int | None = None,
    kv_dtype: str | None = None,
    block_size: int | None = None,
    max_batched_tokens: int | None = None,
    prefill_chunk: int | None = None,
    f16_weights: bool | None = None,
    kv_events: str | None = None,
    kv_events_topic: str = "",
    allowed_origins: Sequence[str] = (),
    loopback_hosts: bool = False,
    chat_page: bool = True,
) -> FastAPI:
    """A FastAPI app serving ``engine`` (see :func:`realizar.engine.load_engine`).

    ``model_name`` is the id clients pass as ``model`` (default: ``engine.name``), or several: the first is
    the model's id, the others aliases clients may pass too; ``max_queue`` caps
    the requests waiting for the model (more get a 429); ``default_max_tokens`` caps chat completions
    that give no ``max_tokens`` (default: the rest of the context, as OpenAI does); ``api_key``: when
    set, the ``/v1`` routes and tokenize answer 401 without ``Authorization: Bearer <api_key>``;
    ``max_body``: request bodies over this many bytes get a 413 before they are read whole.

    Generation runs on ``serving`` (a :class:`~realizar.serving.ServingEngine`; the app closes it at
    shutdown), by default one made for ``engine`` by :meth:`ServingEngine.from_engine` with
    ``max_batch`` sequences at most per step, a KV pool of ``kv_memory`` bytes in blocks of
    ``block_size`` positions stored as ``kv_dtype``, a per-step token budget of ``max_batched_tokens``
    (decode rows plus prefill chunks), prompts through the layers ``prefill_chunk`` tokens at most at
    once and ``f16_weights`` (f16 weight copies; None: :class:`realizar.config.ServingConfig`'s defaults, as for
    the others); with ``kv_events`` (a ZeroMQ endpoint) it
    publishes its prefix cache's changes there under ``kv_events_topic``
    (:mod:`realizar.serving.kv_events`). ``chat_page``: serve the chat page at ``/`` (False: ``/`` is a 404).
    """
    names = [model_name] if isinstance(model_name, str) else list(model_name or [])
    if any(not isinstance(n, str) or not n.strip() for n in names):
        raise ValueError(f"model names must be non-empty strings, got {model_name!r}")
    name = names[0] if names else str(getattr(engine, "name", None) or "realizar")
    device = str(getattr(engine, "device", "cpu"))
    metrics = ServerMetrics(name, device)
    if serving is None:
        from realizar.serving import ServingEngine

        publisher = None
        if kv_events is not None:
            from realizar.serving.kv_events import KVEventPublisher

            publisher = KVEventPublisher(kv_events, kv_events_topic,
                                         medium="CPU" if str(getattr(engine, "device", "cpu")) == "cpu" else "GPU")
        serving = ServingEngine.from_engine(engine, kv_memory=kv_memory, block_size=block_size, max_batch=max_batch,
                                            kv_dtype=kv_dtype, max_batched_tokens=max_batched_tokens,
                                            prefill_chunk=prefill_chunk, f16_weights=f16_weights,
                                            kv_events=publisher)  # fmt: skip
    metrics.attach(serving)
    scheduler = Scheduler(serving, metrics, max_queue=max_queue)
    state = ServerState(
        engine=engine,
        name=name,
        device=device,
        metrics=metrics,
        scheduler=scheduler,
        context_length=_context_length(engine, serving),
        vocab_size=_vocab_size(engine),
        created=int(time.time()),
        default_max_tokens=default_max_tokens,
        aliases=tuple(dict.fromkeys(n for n in names[1:] if n != name)),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # kernels loaded and step graphs captured before the server answers: its first prompt runs as fast
        # as later ones
        seconds = await asyncio.to_thread(serving.warm_up)
        if seconds:
            log.info("warmed up in %.1f s", seconds)
        yield
        scheduler.close()

    # no generated schema or docs pages: they answered without the API key (the API is documented in docs/)
    app = FastAPI(title="realizar", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state  # what the routes get through realizar.server.state.get_state
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_body=max_body)
    app.add_middleware(OriginMiddleware, allowed_origins=tuple(allowed_origins), loopback_hosts=loopback_hosts)
    app.add_middleware(AnthropicErrorMiddleware)  # (errors under /v1/messages in Anthropic's shape)
    app.add_middleware(_MetricsMiddleware, metrics=metrics)  # outermost: 401s are counted too
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    if chat_page:
        page_files()  # (read now: an install without them fails here, not at the first visit)
        app.include_router(PAGE_ROUTER)
    return app


def _version() -> str:
    from realizar import __version__

    return __version__
