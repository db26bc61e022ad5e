"""The OpenAI-compatible HTTP server: ``create_app(engine)`` returns a FastAPI application.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (Prometheus text). Errors are answered with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``: 400 for invalid requests (bad JSON, bad
parameters, prompt + max_tokens past the context), 404 for an unknown model or path, 429 when the
queue is full, 500 for a failure inside the engine.

Generations run one at a time on a worker thread (:mod:`realizar.server.scheduler`); a client that
disconnects, mid-stream or while waiting, has its generation stopped and frees the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from realizar.errors import ContextOverflowError, InvalidRequestError, RealizarError, TokenizerError
from realizar.generation import SamplingParams
from realizar.server import protocol as P
from realizar.server.metrics import CONTENT_TYPE, ServerMetrics
from realizar.server.scheduler import Job, QueueFullError, Scheduler

__all__ = ["create_app"]

log = logging.getLogger("realizar.server")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
GENERATION_ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
KNOWN_ENDPOINTS = (*GENERATION_ENDPOINTS, "/v1/models", "/health", "/metrics")


def _context_length(engine: Any) -> int:
    """The longest sequence the engine can hold: its own figure, its model's (KV cache), or the config's."""
    for obj, attr in ((engine, "context_length"), (getattr(engine.generator, "model", None), "context_length")):
        value = getattr(obj, attr, None) if obj is not None else None
        if isinstance(value, int) and value > 0:
            return value
    return int(engine.config.context_length)


def _vocab_size(engine: Any) -> int:
    tok = engine.tokenizer
    n = getattr(tok, "vocab_size", None)
    return int(n) if isinstance(n, int) else int(engine.config.vocab_size)


def _device_thread_init(engine: Any) -> Callable[[], None] | None:
    """The worker thread must have the engine's CUDA context current before it launches anything."""
    if str(getattr(engine, "device", "cpu")).startswith("cuda"):

        def init() -> None:
            from realizar import cuda

            cuda.current_device()  # makes the primary context current in this thread

        return init
    return None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(err.get("msg", "")), None
    param = loc[0] if loc else None
    where = ".".join(loc)
    msg = str(err.get("msg", "invalid value"))
    return (f"{where}: {msg}" if where else msg), param


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
        path = scope.get("path", "")
        endpoint = path if path in KNOWN_ENDPOINTS else "other"
        status = {"code": 500}
        t0 = time.perf_counter()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.inc(endpoint=endpoint, status=str(status["code"]))
            if endpoint in GENERATION_ENDPOINTS and status["code"] < 400:
                self.metrics.request_latency.observe(time.perf_counter() - t0, endpoint=endpoint)


def create_app(
    engine: Any,
    *,
    model_name: str | None = None,
    max_queue: int = 256,
    default_max_tokens: int | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine`` (see :func:`realizar.engine.load_engine`).

    ``model_name`` is the id clients pass as ``model`` (default: ``engine.name``); ``max_queue`` caps
    the requests waiting for the model (more get a 429); ``default_max_tokens`` caps chat completions
    that give no ``max_tokens`` (default: the rest of the context, as OpenAI does).
    """
    name = model_name or str(getattr(engine, "name", None) or "realizar")
    device = str(getattr(engine, "device", "cpu"))
    metrics = ServerMetrics(name, device)
    scheduler = Scheduler(engine.generator, metrics, max_queue=max_queue, thread_init=_device_thread_init(engine))
    context_length = _context_length(engine)
    vocab_size = _vocab_size(engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.close()

    app = FastAPI(title="realizar", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.scheduler = scheduler
    app.state.model_name = name
    app.add_middleware(_MetricsMiddleware, metrics=metrics)

    # -- errors ---------------------------------------------------------------------------------

    def error_response(err: P.ServerError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(P.ServerError)
    async def _server_error(request: Request, exc: P.ServerError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(P.ServerError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(
            P.error_body(str(exc.detail), kind, None, code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RealizarError)
    async def _realizar_error(request: Request, exc: RealizarError) -> JSONResponse:
        return error_response(_as_server_error(exc))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error while serving %s", request.url.path)
        return error_response(P.ServerError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    # -- helpers ------------------------------------------------------------------------------

    def check_model(model: str) -> None:
        if model != name:
            raise P.ServerError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                                param="model", code="model_not_found")

    def check_ids(ids: list[int]) -> list[int]:
        if not ids:
            raise P.ServerError(400, "the prompt is empty", param="prompt", code="invalid_value")
        for t in ids:
            if not 0 <= t < vocab_size:
                raise P.ServerError(400, f"token id {t} is outside the vocabulary (0..{vocab_size - 1})",
                                    param="prompt", code="invalid_value")
        return ids

    def sampling(req: P._Request, n_prompt: int, max_tokens: int | None, default: int | None, param: str) -> SamplingParams:
        room = context_length - n_prompt
        if room <= 0:
            raise P.ServerError(
                400,
                f"this model's maximum context length is {context_length} tokens, but the prompt has {n_prompt}",
                param="messages" if param == "max_completion_tokens" else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room if default is None else min(default, room)
        elif max_tokens > room:
            raise P.ServerError(
                400,
                f"this model's maximum context length is {context_length} tokens; you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion)",
                param=param,
                code="context_length_exceeded",
            )
        params = SamplingParams(
            max_tokens=int(max_tokens),
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_k=0 if req.top_k is None else int(req.top_k),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            repetition_penalty=1.0 if req.repetition_penalty is None else float(req.repetition_penalty),
            seed=req.seed,
            stop=req.stop_tuple(),
            stop_token_ids=tuple(int(t) for t in (req.stop_token_ids or ())),
        )
        try:
            params.validate()
        except RealizarError as e:
            raise P.ServerError(400, str(e), code="invalid_value") from None
        return params

    def start(ids: list[int], params: SamplingParams) -> Job:
        job = Job(prompt_ids=ids, params=params, loop=asyncio.get_running_loop())
        try:
            scheduler.submit(job)
        except QueueFullError as e:
            raise P.ServerError(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                                code="queue_full") from None
        return job

    async def collect(job: Job, request: Request) -> tuple[str, Any]:
        """Wait for a whole generation, stopping it if the client goes away meanwhile."""
        watcher = asyncio.create_task(_watch_disconnect(request, lambda: scheduler.cancel(job)))
        pieces: list[str] = []
        try:
            async for kind, payload in job.events():
                if kind == "token":
                    pieces.append(payload.text)
                elif kind == "done":
                    return "".join(pieces), payload
                elif kind == "error":
                    raise payload
                else:  # cancelled: the client is gone, nobody reads the answer
                    raise P.ServerError(499, "the client closed the request", code="client_closed")
        except asyncio.CancelledError:
            scheduler.cancel(job)
            raise
        finally:
            watcher.cancel()
        raise P.ServerError(500, "the generation ended without a result", "server_error")

    async def sse(job: Job, render: Callable[[str, Any], list[dict]]) -> AsyncIterator[str]:
        """Server-Sent Events for ``job``: ``render(kind, payload)`` gives the chunks of each event."""
        finished = False
        try:
            for chunk in render("start", None):
                yield _sse(chunk)
            async for kind, payload in job.events():
                if kind == "error":
                    err = _as_server_error(payload)
                    if err.status >= 500:
                        log.error("generation failed: %r", payload)
                    yield _sse(err.body())
                    break
                if kind == "cancelled":
                    break
                for chunk in render(kind, payload):
                    yield _sse(chunk)
            finished = True
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                scheduler.cancel(job)

    # -- endpoints ----------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "model": name,
            "device": device,
            "context_length": context_length,
            "queue_depth": scheduler.queue_depth,
            "busy": scheduler.busy,
        }

    @app.get("/metrics")
    async def metrics_endpoint() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(name, created, context_length)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return _model_card(name, created, context_length)

    @app.post("/v1/completions")
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        req.refuse_unsupported()
        check_model(req.model)
        prompt = req.single_prompt()
        tok = engine.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise P.ServerError(400, "prompt must not be empty", param="prompt", code="invalid_value")
            ids = check_ids(await asyncio.to_thread(tok.encode, prompt))
            prompt_text = prompt
        else:
            ids = check_ids(prompt)
            prompt_text = await asyncio.to_thread(tok.decode, ids) if req.echo else ""
        params = sampling(req, len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        rid, ts = P.new_id("cmpl"), P.now()
        echo = prompt_text if req.echo else ""
        job = start(ids, params)

        if not req.stream:
            text, result = await collect(job, request)
            return P.completion_response(rid, ts, name, echo + text, result.finish_reason,
                                         P.usage(result.prompt_tokens, result.completion_tokens))

        include_usage = req.include_usage()

        def render(kind: str, payload: Any) -> list[dict]:
            if kind == "start":
                return [P.completion_chunk(rid, ts, name, echo, None)] if echo else []
            if kind == "token":
                return [P.completion_chunk(rid, ts, name, payload.text, None)] if payload.text else []
            out = [P.completion_chunk(rid, ts, name, "", payload.finish_reason)]
            if include_usage:
                out.append(P.usage_chunk(rid, ts, name, "text_completion",
                                         P.usage(payload.prompt_tokens, payload.completion_tokens)))
            return out

        return _EventStream(sse(job, render), lambda: scheduler.cancel(job))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Any:
        req.refuse_unsupported()
        check_model(req.model)
        messages = req.plain_messages()
        try:
            ids = await asyncio.to_thread(_chat_prompt, engine, messages)
        except RealizarError as e:
            raise P.ServerError(400, f"cannot apply the chat template: {e}", param="messages",
                                code="invalid_value") from None
        ids = check_ids(list(ids))
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = sampling(req, len(ids), req.requested_max_tokens(), default_max_tokens, param)
        rid, ts = P.new_id("chatcmpl"), P.now()
        job = start(ids, params)

        if not req.stream:
            text, result = await collect(job, request)
            return P.chat_response(rid, ts, name, text, result.finish_reason,
                                   P.usage(result.prompt_tokens, result.completion_tokens))

        include_usage = req.include_usage()

        def render(kind: str, payload: Any) -> list[dict]:
            if kind == "start":
                return [P.chat_chunk(rid, ts, name, {"role": "assistant", "content": ""}, None)]
            if kind == "token":
                return [P.chat_chunk(rid, ts, name, {"content": payload.text}, None)] if payload.text else []
            out = [P.chat_chunk(rid, ts, name, {}, payload.finish_reason)]
            if include_usage:
                out.append(P.usage_chunk(rid, ts, name, "chat.completion.chunk",
                                         P.usage(payload.prompt_tokens, payload.completion_tokens)))
            return out

        return _EventStream(sse(job, render), lambda: scheduler.cancel(job))

    return app


# ----------------------------------------------------------------------------------------------


def _version() -> str:
    from realizar import __version__

    return __version__


def _model_card(name: str, created: int, context_length: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "realizar",
            "context_length": context_length}


def _chat_prompt(engine: Any, messages: list[dict]) -> list[int]:
    render = getattr(engine, "chat_prompt", None)
    if callable(render):
        return list(render(messages))
    return list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends — finished, failed, or cancelled
    because the client went away, even before the body iterator ever started."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _as_server_error(exc: BaseException) -> P.ServerError:
    if isinstance(exc, P.ServerError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return P.ServerError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, (InvalidRequestError, TokenizerError)):
        return P.ServerError(400, str(exc), code="invalid_value")
    return P.ServerError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


async def _watch_disconnect(request: Request, on_disconnect: Callable[[], None]) -> None:
    """Wait for the client to go away (the request body has been read by then) and call back."""
    try:
        while True:
            message = await request.receive()
            if message.get("type") == "http.disconnect":
                on_disconnect()
                return
    except asyncio.CancelledError:
        pass
    except Exception:  # noqa: BLE001 - a watcher never takes the request down
        pass
