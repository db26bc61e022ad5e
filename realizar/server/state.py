"""What every route of one app shares: the engine, the scheduler, the metrics and the model's
limits, with the steps a generation request goes through (checks, sampling parameters, queueing,
waiting for the whole answer or streaming it as Server-Sent Events)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from realizar.errors import RealizarError
from realizar.generation import SamplingParams
from realizar.server import protocol as P
from realizar.server.metrics import ServerMetrics
from realizar.server.scheduler import Job, QueueFullError, Scheduler, ShuttingDownError

__all__ = ["INLINE_BODY", "ServerState", "EventStream", "get_state", "off_loop", "parse_body"]



@dataclass
class ServerState:
    engine: Any
    name: str  # the model id clients pass as ``model``
    device: str
    metrics: ServerMetrics
    scheduler: Scheduler
    context_length: int
    vocab_size: int
    created: int
    default_max_tokens: int | None  # for chat completions without max_tokens (None: the rest of the context)
    aliases: tuple[str, ...] = ()  # further ids clients may pass for the same model

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def check_model(self, model: str) -> None:
        if model not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise P.ServerError(404, f"the model {model!r} does not exist; this server serves {served}",
                                param="model", code="model_not_found")  # fmt: skip

    def check_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise P.ServerError(400, "the prompt is empty", param="prompt", code="invalid_value")
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise P.ServerError(400, f"token id {t} is outside the vocabulary (0..{self.vocab_size - 1})",
                                    param="prompt", code="invalid_value")  # fmt: skip
        return ids

    def sampling(
        self, req: P.GenerationRequest, n_prompt: int, max_tokens: int | None, default: int | None, param: str
    ) -> SamplingParams:
        """The request's sampling parameters, with ``max_tokens`` checked against (or, when absent,
        taken from) the room left in the context."""
        ctx = self.context_length
        room = ctx - n_prompt
        if room <= 0:
            raise P.ServerError(
                400,
                f"this model's maximum context length is {ctx} tokens, but the prompt has {n_prompt}",
                param="messages" if param == "max_completion_tokens" else "prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room if default is None else min(default, room)
        elif max_tokens > room:
            raise P.ServerError(
                400,
                f"this model's maximum context length is {ctx} tokens; you requested "
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
            seed=None if req.seed is None else req.seed % 2**64,  # OpenAI takes any int64
            stop=req.stop_tuple(),
            stop_token_ids=tuple(int(t) for t in (req.stop_token_ids or ())),
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            priority=int(req.priority or 0),
        )
        try:
            params.validate()
        except RealizarError as e:
            raise P.ServerError(400, str(e), code="invalid_value") from None
        return params

    def start(self, ids: list[int], params: SamplingParams) -> Job:
        job = Job(prompt_ids=ids, params=params)
        try:
            self.scheduler.submit(job)
        except ShuttingDownError as e:
            raise P.ServerError(503, f"{e}; retry later or on another replica", "server_error",
                                code="server_shutting_down") from None
        except QueueFullError as e:
            raise P.ServerError(429, f"the server is busy: {e}; retry later", "rate_limit_error",
                                code="queue_full") from None  # fmt: skip
        return job

    async def collect(self, job: Job, request: Request, chunks: list | None = None) -> tuple[str, Any]:
        """Wait for a whole generation, stopping it if the client goes away meanwhile; every
        :class:`~realizar.generation.TokenChunk` is appended to ``chunks`` when given."""
        watcher = asyncio.create_task(_watch_disconnect(request, lambda: self.scheduler.cancel(job)))
        pieces: list[str] = []
        try:
            async for kind, payload in job.events():
                if kind == "tokens":
                    pieces.extend(c.text for c in payload)
                    if chunks is not None:
                        chunks.extend(payload)
                elif kind == "done":
                    return "".join(pieces), payload
                elif kind == "error":
                    raise payload
                else:  # cancelled: the client is gone, nobody reads the answer
                    raise P.ServerError(499, "the client closed the request", code="client_closed")
        except asyncio.CancelledError:
            self.scheduler.cancel(job)
            raise
        finally:
            watcher.cancel()
        raise P.ServerError(500, "the generation ended without a result", "server_error")


# a prompt of token ids at least this long is checked in Python rather than by the validator
_LONG_PROMPT = 4096


def _validate(model: type[BaseModel], raw: bytes) -> BaseModel:
    """``raw`` validated as ``model``. A long ``prompt`` of token ids (up to a million in a 4 MB body) is
    taken out before the validator sees the body and checked here, element by element: the validator
    would hold Python's global lock for the whole list (a quarter second and more), while a Python loop
    lets the event loop's thread in every few milliseconds."""
    ids = None
    if len(raw) > 8 * _LONG_PROMPT:
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError):  # (nesting deeper than Python's stack: the validator reports it)
            data = None  # the validator reports it
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if isinstance(prompt, list) and len(prompt) > _LONG_PROMPT and all(type(t) is int for t in prompt):
            ids, data["prompt"] = prompt, prompt[:1]
            raw = json.dumps(data).encode()
    try:
        req = model.model_validate_json(raw)
    except ValidationError as e:
        # the shape FastAPI gives its own body errors, for the app's handler (realizar.server.errors)
        raise RequestValidationError([{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors()]) from None
    if ids is not None:
        req.prompt = ids
    return req


# a body up to this size is validated, templated and tokenized on the event loop (tens of microseconds to a
# millisecond); a larger one on a worker thread, so the loop keeps answering meanwhile
INLINE_BODY = 8192


async def parse_body(request: Request, model: type[BaseModel]) -> Any:
    """The request's JSON body validated as ``model``. The body (at most the server's ``max_body``
    bytes, see :mod:`realizar.server.limits`) is parsed and validated by :func:`off_loop`."""
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone, or refused by the body limit (which has answered 413 already)
        raise P.ServerError(499, "the client closed the request", code="client_closed") from None
    request.state.body_bytes = len(raw)
    return await off_loop(request, _validate, model, raw)


async def off_loop(request: Request, fn: Callable[..., Any], *args: Any, heavy: bool = False) -> Any:
    """``fn(*args)``, the work of one request's body: on the event loop when the body is small
    (:data:`INLINE_BODY`: a thread hand-over would cost more than the work) and not ``heavy`` (a grammar to
    compile, say), else on a worker thread."""
    if not heavy and getattr(request.state, "body_bytes", INLINE_BODY + 1) <= INLINE_BODY:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


async def get_state(request: Request) -> ServerState:
    """FastAPI dependency: the state of the app serving ``request``."""
    return request.app.state.server


class EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends — finished, failed, or cancelled
    because the client went away, even before the body iterator ever started."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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
