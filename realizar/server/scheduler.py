"""Generation requests on the continuous-batching engine, off the event loop.

Every generation request becomes a :class:`Job`: its prompt and sampling parameters are submitted
to the app's :class:`~realizar.serving.ServingEngine`, which runs every request in flight together
(one decode step advances them all). The engine hands each job's tokens to a :class:`Delivery` (the
``sink`` of :meth:`~realizar.serving.ServingEngine.submit`), which passes them to the event loop in
batches: the first token after a hand-over schedules the next one, so a decode step of B rows costs the
loop one wake-up and no thread per request. On the loop a job collects its tokens; its stream takes all
that have come at once (one SSE event for several tokens when the client is behind the engine). Cancelling
a job (the client went away) cancels its handle: the engine drops the sequence at once, waiting or
running, and frees its KV blocks.

Shutting down (:meth:`Scheduler.drain`): no job is admitted any more (:class:`ShuttingDownError`), those in
flight get a grace period to finish, and the rest end with a 503 error event (a stream then ends with it and
``[DONE]``, a whole-answer request with a JSON 503) instead of being cut off.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from realizar.generation import GenerationResult, SamplingParams, TokenChunk
from realizar.server.metrics import ServerMetrics

__all__ = ["Delivery", "Job", "QueueFullError", "Scheduler", "ShuttingDownError"]


class QueueFullError(RuntimeError):
    """Too many requests are already in flight."""


class ShuttingDownError(QueueFullError):
    """The server is shutting down: no new requests."""


def _shutdown_error() -> Exception:
    from realizar.server.protocol import ServerError

    return ServerError(503, "the server is shutting down before this request finished; retry it", "server_error",
                       code="server_shutting_down")


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    received_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    generated: int = 0
    handle: Any = None  # the engine's RequestHandle
    result: GenerationResult | None = None
    cancelled: bool = False
    shutdown: bool = False  # ended by the server's shutdown, not by its client
    _items: collections.deque = field(default_factory=collections.deque)  # ("token", chunk) ... then the end
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def post(self, kind: str, payload: Any) -> None:
        """(On the event loop) queue an event for :meth:`events`."""
        self._items.append((kind, payload))
        self._ready.set()

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """``("tokens", [TokenChunk, ...])`` for the tokens that have come since the last event (one or
        more), then ``("done", GenerationResult)``, or ``("error", exception)``, or ``("cancelled", None)``."""
        items = self._items
        while True:
            while not items:
                self._ready.clear()
                await self._ready.wait()
            if items[0][0] != "token":
                yield items.popleft()
                return
            chunks = []
            while items and items[0][0] == "token":
                chunks.append(items.popleft()[1])
            yield "tokens", chunks


class Delivery:
    """The engine's sink for one event loop's jobs: called from the engine's thread with each job's
    chunks (a chunk, then None at the end), it passes them to the loop in batches, one
    ``call_soon_threadsafe`` for all that came while the loop was busy."""

    def __init__(self, loop: asyncio.AbstractEventLoop, scheduler: "Scheduler"):
        self.loop, self.scheduler = loop, scheduler
        self._lock = threading.Lock()
        self._pending: list[tuple[Job, TokenChunk | None]] = []

    def push(self, job: Job, _handle: Any, chunk: TokenChunk | None) -> None:
        with self._lock:
            self._pending.append((job, chunk))
            first = len(self._pending) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:  # the loop is closed: the server is shutting down, nobody listens
                with self._lock:
                    self._pending.clear()
                if job.handle is not None and chunk is not None:
                    job.handle.cancel()

    def _flush(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        now = time.perf_counter()
        for job, chunk in batch:
            if chunk is None:
                self.scheduler._ended(job, now)
            else:
                self.scheduler._token(job, chunk, now)


class Scheduler:
    """Hands :class:`Job` s to ``serving`` (a :class:`~realizar.serving.ServingEngine`) and streams
    their tokens back. At most ``max_queue`` jobs beyond what the engine runs at once
    (``max_batch``) may be in flight; more are refused with :class:`QueueFullError`."""

    def __init__(self, serving: Any, metrics: ServerMetrics, max_queue: int = 256):
        self.serving = serving
        self.metrics = metrics
        self.max_queue = int(max_queue)
        self.max_in_flight = self.max_queue + int(serving.scheduler.max_batch)
        self._lock = threading.Lock()
        self._jobs: set[Job] = set()
        self._closed = False
        self.draining = False
        self._delivery: Delivery | None = None

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    @property
    def queue_depth(self) -> int:
        """Sequences waiting for room in the batch (new, or preempted)."""
        return int(self.serving.stats().waiting)

    @property
    def busy(self) -> bool:
        return self.serving.stats().running > 0

    def submit(self, job: Job) -> None:
        """Start ``job`` (on the event loop). Raises :class:`QueueFullError`, or the engine's
        :class:`~realizar.errors.InvalidRequestError` for a request that can never fit its KV pool."""
        loop = asyncio.get_running_loop()
        if self._delivery is None or self._delivery.loop is not loop:
            self._delivery = Delivery(loop, self)
        delivery = self._delivery
        with self._lock:
            if self._closed:
                raise ShuttingDownError("the server is shutting down")
            if len(self._jobs) >= self.max_in_flight:
                raise QueueFullError(f"{len(self._jobs)} requests are already in flight")
            job.handle = self.serving.submit(job.prompt_ids, job.params,
                                             sink=lambda handle, chunk: delivery.push(job, handle, chunk))
            self._jobs.add(job)
        self.metrics.request_started(len(job.prompt_ids))

    def cancel(self, job: Job) -> None:
        """Stop ``job`` at once (waiting or running); its KV blocks are freed."""
        if job.handle is not None:
            job.handle.cancel()

    def _token(self, job: Job, chunk: TokenChunk, now: float) -> None:
        """(On the loop) one more token of ``job``."""
        job.generated += 1
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.first_token(now - job.received_at)
        else:
            self.metrics.token_gap(now - job.last_token_at)
        job.last_token_at = now
        job.post("token", chunk)

    def _ended(self, job: Job, now: float) -> None:
        """(On the loop) ``job``'s handle is done: its last event, by how it ended."""
        with self._lock:
            self._jobs.discard(job)
        handle, generated, elapsed = job.handle, job.generated, now - job.received_at
        if handle.error is not None:
            self.metrics.request_finished(None, generated, None, "abort")
            job.post("error", handle.error)
            return
        result = handle.result
        if result is None or result.finish_reason == "cancelled":
            self.metrics.request_finished(None, generated, elapsed, "abort")
            if job.shutdown:
                job.post("error", _shutdown_error())
            else:
                job.cancelled = True
                self.metrics.cancelled.inc()
                job.post("cancelled", None)
            return
        job.result = result
        reason = "length" if result.finish_reason == "length" else "stop"
        self.metrics.request_finished(result, generated, elapsed, reason)
        job.post("done", result)

    async def drain(self, grace: float, settle: float = 2.0) -> None:
        """Stop admitting jobs; give those in flight ``grace`` seconds to finish, then end the rest with a 503
        error event and wait (``settle`` seconds at most) until their pumps have posted it."""
        with self._lock:
            self._closed = True
            self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while self.in_flight and loop.time() < end:
            await asyncio.sleep(0.05)
        with self._lock:
            left = list(self._jobs)
        for job in left:
            job.shutdown = True
            self.cancel(job)
        end = loop.time() + settle
        while self.in_flight and loop.time() < end:
            await asyncio.sleep(0.02)

    def close(self) -> None:
        """Stop accepting jobs and close the engine (jobs in flight end with an error)."""
        with self._lock:
            self._closed = True
        self.serving.close()
