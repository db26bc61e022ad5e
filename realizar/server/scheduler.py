"""One generation at a time, off the event loop.

Every generation request becomes a :class:`Job` handed to a single worker thread (a one-thread
executor, so jobs run in arrival order). The worker pushes each token into the job's
``asyncio.Queue`` with ``loop.call_soon_threadsafe``; the request handler awaits that queue, so the
event loop never blocks on the model. Cancelling a job (the client went away) removes it from the
queue if it has not started, or makes the worker stop after the current token — either way the
model is free for the next job at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from realizar.generation import GenerationResult, SamplingParams
from realizar.server.metrics import ServerMetrics

__all__ = ["Job", "QueueFullError", "Scheduler"]


class QueueFullError(RuntimeError):
    """Too many requests are already waiting."""


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    received_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    first_token_at: float | None = None
    future: Future | None = None
    result: GenerationResult | None = None
    cancelled: bool = False

    def _post(self, kind: str, payload: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody listens
            self.cancel.set()

    async def events(self) -> AsyncIterator[tuple[str, Any]]:
        """``("token", TokenChunk)`` for each token, then ``("done", GenerationResult)``, or
        ``("error", exception)``, or ``("cancelled", None)``."""
        while True:
            kind, payload = await self.queue.get()
            yield kind, payload
            if kind != "token":
                return


class Scheduler:
    """Runs :class:`Job` s one at a time on a dedicated worker thread."""

    def __init__(
        self,
        generator: Any,
        metrics: ServerMetrics,
        max_queue: int = 256,
        thread_init: Callable[[], None] | None = None,
    ):
        self.generator = generator
        self.metrics = metrics
        self.max_queue = max_queue
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="realizar-generate", initializer=thread_init)
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not started
        self._running: Job | None = None
        self._closed = False

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return self._pending

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._running is not None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise QueueFullError("the server is shutting down")
            if self._pending >= self.max_queue:
                raise QueueFullError(f"{self._pending} requests are already waiting")
            self._pending += 1
            self.metrics.queue_depth.set(self._pending)
        try:
            job.future = self._executor.submit(self._run, job)
        except RuntimeError:  # shut down meanwhile
            with self._lock:
                self._pending -= 1
                self.metrics.queue_depth.set(self._pending)
            raise QueueFullError("the server is shutting down") from None
        job.future.add_done_callback(lambda f, job=job: self._on_done(f, job))

    def cancel(self, job: Job) -> None:
        """Stop ``job``: drop it from the queue, or stop its generation after the current token."""
        job.cancel.set()
        if job.future is not None:
            job.future.cancel()  # succeeds only if it has not started; then _on_done fixes the counters

    def _on_done(self, fut: Future, job: Job) -> None:
        if fut.cancelled():
            with self._lock:
                self._pending -= 1
                self.metrics.queue_depth.set(self._pending)
            self._cancelled(job)

    def _run(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1
            self._running = job
            self.metrics.queue_depth.set(self._pending)
            self.metrics.running.set(1)
        job.started_at = time.perf_counter()
        self.metrics.queue_latency.observe(job.started_at - job.received_at)
        stream = None
        generated = 0
        try:
            if job.cancel.is_set():
                self._cancelled(job)
                return
            stream = self.generator.stream(job.prompt_ids, job.params)
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))
            for chunk in stream:
                generated += 1
                if job.first_token_at is None:
                    job.first_token_at = time.perf_counter()
                    self.metrics.ttft.observe(job.first_token_at - job.received_at)
                job._post("token", chunk)
                if job.cancel.is_set():
                    break
            result = stream.result
            if result is None:  # stopped early: the client went away
                self._cancelled(job)
                return
            job.result = result
            self.metrics.prompt_len.observe(result.prompt_tokens)
            self.metrics.completion_len.observe(result.completion_tokens)
            if result.completion_tokens > 1 and result.decode_seconds > 0:
                self.metrics.tpot.observe(result.decode_seconds / (result.completion_tokens - 1))
            job._post("done", result)
        except BaseException as e:  # noqa: BLE001 - handed to the request handler
            job._post("error", e)
        finally:
            if stream is not None:
                try:
                    stream.close()
                except Exception:  # noqa: BLE001
                    pass
            self.metrics.generation_tokens.inc(generated)
            with self._lock:
                self._running = None
                self.metrics.running.set(0)

    def _cancelled(self, job: Job) -> None:
        job.cancelled = True
        self.metrics.cancelled.inc()
        job._post("cancelled", None)

    def close(self) -> None:
        """Stop accepting jobs, cancel the waiting ones and the running one; do not wait."""
        with self._lock:
            self._closed = True
            running = self._running
        if running is not None:
            running.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
