"""Generation requests on the continuous-batching engine, off the event loop.

Every generation request becomes a :class:`Job`: its prompt and sampling parameters are submitted
to the app's :class:`~realizar.serving.ServingEngine`, which runs every request in flight together
(one decode step advances them all). A small pump thread per job reads the engine's
:class:`~realizar.serving.RequestHandle` (a blocking iterator) and pushes each token into the job's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``; the request handler awaits that queue, so the
event loop never blocks on the model. Cancelling a job (the client went away) cancels its handle:
the engine drops the sequence at once, waiting or running, and frees its KV blocks.

Shutting down (:meth:`Scheduler.drain`): no job is admitted any more (:class:`ShuttingDownError`), those in
flight get a grace period to finish, and the rest end with a 503 error event (a stream then ends with it and
``[DONE]``, a whole-answer request with a JSON 503) instead of being cut off.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from realizar.generation import GenerationResult, SamplingParams
from realizar.server.metrics import ServerMetrics

__all__ = ["Job", "QueueFullError", "Scheduler", "ShuttingDownError"]


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
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    received_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    handle: Any = None  # the engine's RequestHandle
    result: GenerationResult | None = None
    cancelled: bool = False
    shutdown: bool = False  # ended by the server's shutdown, not by its client

    def _post(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody listens
            if self.handle is not None:
                self.handle.cancel()

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """``("token", TokenChunk)`` for each token, then ``("done", GenerationResult)``, or
        ``("error", exception)``, or ``("cancelled", None)``."""
        while True:
            kind, payload = await self.queue.get()
            yield kind, payload
            if kind != "token":
                return


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
        """Start ``job``. Raises :class:`QueueFullError`, or the engine's
        :class:`~realizar.errors.InvalidRequestError` for a request that can never fit its KV pool."""
        with self._lock:
            if self._closed:
                raise ShuttingDownError("the server is shutting down")
            if len(self._jobs) >= self.max_in_flight:
                raise QueueFullError(f"{len(self._jobs)} requests are already in flight")
            job.handle = self.serving.submit(job.prompt_ids, job.params)
            self._jobs.add(job)
        self.metrics.request_started(len(job.prompt_ids))
        threading.Thread(target=self._pump, args=(job,), name="realizar-stream", daemon=True).start()

    def cancel(self, job: Job) -> None:
        """Stop ``job`` at once (waiting or running); its KV blocks are freed."""
        if job.handle is not None:
            job.handle.cancel()

    def _pump(self, job: Job) -> None:
        handle = job.handle
        generated = 0
        last = None
        ok = False
        try:
            for chunk in handle:
                generated += 1
                now = time.perf_counter()
                if job.first_token_at is None:
                    job.first_token_at = now
                    self.metrics.first_token(now - job.received_at)
                else:
                    self.metrics.token_gap(now - last)
                last = now
                job._post("token", chunk)
            ok = True
        except BaseException as e:  # noqa: BLE001 - the engine failed this request: the handler answers
            job._post("error", e)
            return
        finally:
            with self._lock:
                self._jobs.discard(job)
            if not ok:
                self.metrics.request_finished(None, generated, None, "abort")
        result = handle.result
        elapsed = time.perf_counter() - job.received_at
        if job.shutdown and (result is None or result.finish_reason == "cancelled"):
            self.metrics.request_finished(None, generated, elapsed, "abort")
            job._post("error", _shutdown_error())
            return
        if result is None or result.finish_reason == "cancelled":
            job.cancelled = True
            self.metrics.cancelled.inc()
            self.metrics.request_finished(None, generated, elapsed, "abort")
            job._post("cancelled", None)
            return
        job.result = result
        reason = "length" if result.finish_reason == "length" else "stop"
        self.metrics.request_finished(result, generated, elapsed, reason)
        job._post("done", result)

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
