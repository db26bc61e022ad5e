"""ServingEngine: many concurrent requests over one batch backend, driven by a background thread.

    from realizar.engine import load_engine
    from realizar.serving import ServingEngine

    serving = ServingEngine.from_engine(load_engine(), max_batch=64)
    handle = serving.submit(prompt_ids, SamplingParams(max_tokens=32))   # returns at once
    for chunk in handle:                                                  # TokenChunk as they come
        print(chunk.text, end="")
    print(handle.result.finish_reason)
    results = serving.generate_batch([ids_a, ids_b], SamplingParams(max_tokens=8))
    serving.close()

Each request's text, stop strings, EOS, ``max_tokens``, logprobs, logits processors and penalties are
handled by :class:`realizar.generation.SequenceState`, exactly as :class:`~realizar.generation.Generator`
does for one sequence. A request that needs its logits on the host (logprobs, logits processors,
penalties) is sampled there by its own seeded :class:`~realizar.sampling.Sampler` (the same tokens as
``Generator`` with that seed); every other request is sampled by the backend
(:meth:`~realizar.serving.backend.BatchOutput.sample`, the counter-based RNG of
:func:`realizar.sampling.sample_rows`): the same tokens alone or in any batch. A request without a
seed gets a random one.

``GenerationResult.prefill_seconds`` of a served request is the time from submission to its first
token (queueing included); ``decode_seconds`` the time from the first token to the last. A cancelled
request ends with ``finish_reason == "cancelled"``.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from realizar.config import ServingConfig
from realizar.errors import InvalidRequestError, RealizarError
from realizar.generation import (
    GenerationResult, SamplingParams, SequenceState, TokenChunk, _eos_ids, encode_prompt,
)
from realizar.serving.backend import BatchBackend, RowSampling
from realizar.serving.blocks import ROOT_KEY
from realizar.serving.scheduler import Scheduler, StepOutput

__all__ = ["ServingEngine", "RequestHandle", "EngineStats", "StepStats", "EngineClosedError"]

_DEFAULTS = ServingConfig()


class EngineClosedError(RealizarError, RuntimeError):
    """The serving engine was closed before the request finished (or before it was submitted)."""


@dataclass(frozen=True)
class StepStats:
    """What one scheduler iteration did, handed to the ``on_step`` hook (metrics)."""

    decode_batch: int  # rows of the decode call
    prefill_tokens: int  # tokens of the prefill chunk (0: none)
    tokens_out: int  # tokens produced
    preempted: int
    running: int
    waiting: int
    blocks_used: int
    blocks_free: int
    seconds: float


@dataclass(frozen=True)
class EngineStats:
    """A snapshot: sequences running/waiting, KV blocks, prefix cache, counters since start."""

    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    prefix_queries: int
    prefix_hits: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    prefix_hit_rate: float
    prefilled_tokens: int
    cached_tokens: int
    decoded_tokens: int
    preemptions: int
    steps: int
    last_decode_batch: int


_DONE = object()


class RequestEnd:
    """How a request ended, as every handle shows it (in this process or another's): :attr:`done`, then
    :attr:`result` or :attr:`error`; :meth:`wait`."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def result(self) -> GenerationResult | None:
        return self._result

    @property
    def finish_reason(self) -> str | None:
        return None if self._result is None else self._result.finish_reason

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> GenerationResult:
        """Block until finished; the result, or the request's exception raised."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the request did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class RequestHandle(RequestEnd):
    """One submitted request: iterate it for :class:`TokenChunk` as they are produced (blocking);
    :attr:`result` holds the :class:`GenerationResult` once it is finished (None before);
    :meth:`cancel` stops it and frees its KV blocks at once; :meth:`wait` blocks until the end."""

    def __init__(self, engine: "ServingEngine", state: SequenceState, sink: Callable[[Any, Any], None] | None = None):
        super().__init__()
        self._engine = engine
        self.state = state
        self._queue: queue.Queue = queue.Queue()
        self._sink = sink
        self._finish_lock = threading.Lock()
        self._seq = None  # the scheduler's Sequence
        self._logprobs: np.ndarray | None = None
        self._spec: RowSampling | None = None
        self._t_submit = time.perf_counter()
        self._t_first: float | None = None

    # -- the consumer's side ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[TokenChunk]:
        if self._sink is not None:
            raise InvalidRequestError("this request's chunks go to the sink it was submitted with")
        while True:
            item = self._queue.get()
            if item is _DONE:
                self._queue.put(_DONE)  # a later iteration ends at once too
                if self._error is not None:
                    raise self._error
                return
            yield item

    @property
    def prompt_tokens(self) -> int:
        return len(self.state.prompt_ids)

    def cancel(self) -> None:
        """Stop generating (no-op when already finished); the stream ends, ``finish_reason`` is
        ``"cancelled"``."""
        self._engine._cancel(self)

    # -- the scheduler's side (the client interface of realizar.serving.scheduler) -----------------

    @property
    def needs_host_logits(self) -> bool:
        return self.state.needs_host_logits

    def row_sampling(self, step: int | None = None) -> RowSampling:
        """How the device draws this request's token of index ``step`` (default: the next one)."""
        if self._spec is None:  # checked once (at submit: the device's limits), then only the step changes
            self._spec = device_spec(self.state.params)
        return self._spec.at_step(len(self.state.generated) if step is None else step)

    def choose(self, logits: np.ndarray) -> int:
        logits, self._logprobs = self.state.process_logits(logits)
        return self.state.sample(logits)

    def accept(self, tok: int) -> bool:
        now = time.perf_counter()
        if self._t_first is None:
            self._t_first = now
        chunk = self.state.accept(tok, self._logprobs)
        self._logprobs = None
        self._put(chunk)
        if self.state.finished:
            self._finish(now)
        return self.state.finished

    def fail(self, exc: BaseException) -> None:
        if not self._done.is_set():
            self._error = exc
            self._done.set()
            self._put(_DONE)

    def _finish(self, now: float | None = None, reason: str | None = None) -> None:
        with self._finish_lock:  # a cancel on another thread may race the loop finishing it
            if self._done.is_set():
                return
            now = time.perf_counter() if now is None else now
            first = self._t_first if self._t_first is not None else now
            self._result = self.state.result(first - self._t_submit, now - first, reason)
            self._done.set()
            self._put(_DONE)

    def _put(self, item: Any) -> None:
        if self._sink is None:
            self._queue.put(item)
        else:
            self._sink(self, None if item is _DONE else item)


def device_spec(params: SamplingParams) -> RowSampling:
    """How the device samples a request of ``params`` (its first token); raises for values the device cannot
    take (e.g. a temperature whose float32 reciprocal overflows)."""
    return RowSampling(float(params.temperature), int(params.top_k), float(params.top_p), int(params.seed or 0), 0)


def admit_params(params: SamplingParams | None) -> SamplingParams:
    """``params`` checked for a serving engine, with a random seed where it has none (so a request is
    reproducible from its params): raises :class:`InvalidRequestError` for bad values."""
    params = params or SamplingParams()
    params.validate()
    if params.seed is None:
        params = dataclasses.replace(params, seed=secrets.randbits(63))
    if not params.needs_host_logits:
        device_spec(params)
    return params


class ServingEngine:
    """Continuous batching over ``backend`` (a :class:`~realizar.serving.backend.BatchBackend`).

    ``tokenizer`` needs ``encode`` and ``stream_decoder`` (as for :class:`~realizar.generation.Generator`);
    ``eos_token_ids`` default to the tokenizer's. ``max_batched_tokens``: the per-step token budget
    (prefill chunk + decode rows). ``on_step(StepStats)``: called after every iteration from the
    engine's thread (keep it quick). The thread starts with the first request and sleeps when idle;
    with ``background=False`` there is none and the caller drives :meth:`step` (tests, tools).
    ``kv_events``: a :class:`~realizar.serving.kv_events.KVEventPublisher` sent the prefix cache's changes
    after every step (vLLM's KV-event format, for prefix-aware routers); closed with the engine."""

    def __init__(
        self,
        backend: BatchBackend,
        tokenizer: Any,
        eos_token_ids: Sequence[int] | None = None,
        *,
        max_batched_tokens: int = _DEFAULTS.max_batched_tokens,
        max_batch: int | None = None,
        prefix_cache: bool = True,
        on_step: Callable[[StepStats], None] | None = None,
        background: bool = True,
        kv_events: Any = None,
        async_scheduling: bool = _DEFAULTS.async_scheduling,
    ):
        self.background = background
        self.backend = backend
        self.device: str | None = None  # where the model runs ("cpu", "cuda"; from_engine sets it)
        self.where: str | None = None  # the same for people, naming the GPU (Engine.where)
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids(tokenizer)
        self.scheduler = Scheduler(backend, max_batched_tokens=max_batched_tokens, prefix_cache=prefix_cache,
                                   max_batch=max_batch, async_scheduling=async_scheduling)  # fmt: skip
        self.on_step = on_step
        self.kv_events = kv_events
        if kv_events is not None:
            self.scheduler.pool.record_events()
        self._cv = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._active: set[RequestHandle] = set()
        self._last_batch = 0
        self._inbox: collections.deque[RequestHandle] = collections.deque()  # submitted, not yet queued
        self._cancels: collections.deque[RequestHandle] = collections.deque()  # cancelled during a step
        self._snapshot: EngineStats | None = None  # stats() while a step holds the lock
        self._wake = threading.Event()
        self._start_lock = threading.Lock()

    @classmethod
    def from_engine(cls, engine: Any, config: ServingConfig | None = None, **kwargs: Any) -> "ServingEngine":
        """A serving engine over a :class:`realizar.engine.Engine`'s model, on the batch backend the engine
        makes for ``config`` (:meth:`realizar.engine.Engine.batch_backend`). Keywords that name a
        :class:`~realizar.config.ServingConfig` setting override ``config``'s (None: keep it); the others go
        to the constructor."""
        names = set(ServingConfig.__dataclass_fields__)
        cfg = (config or ServingConfig()).with_(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        backend = engine.batch_backend(cfg)
        eos = getattr(getattr(engine, "generator", None), "eos_token_ids", None)
        serving = cls(backend, engine.tokenizer, eos, max_batched_tokens=cfg.max_batched_tokens,
                      async_scheduling=cfg.async_scheduling, **kwargs)
        serving.device, serving.where = str(engine.device), engine.where
        return serving

    # -- requests ------------------------------------------------------------------------------------

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
               sink: Callable[[RequestHandle, TokenChunk | None], None] | None = None) -> RequestHandle:
        """Queue a request; returns its :class:`RequestHandle` at once. Raises
        :class:`InvalidRequestError` for bad parameters or a request that could never fit.

        ``sink``: instead of the handle's blocking iterator, ``sink(handle, chunk)`` gets each
        :class:`TokenChunk` and then ``sink(handle, None)`` at the end (:attr:`RequestHandle.result` or
        :attr:`RequestHandle.error` set), called from the engine's thread, or from the thread that
        cancels the request; it must be quick and never raise (the HTTP server's hands them to its
        event loop a step at a time)."""
        params = admit_params(params)
        ids = encode_prompt(self.tokenizer, prompt)
        handle = RequestHandle(self, SequenceState(ids, params, self.tokenizer, self.eos_token_ids), sink)
        if self._closed:
            raise EngineClosedError("the serving engine is closed")
        if params.max_tokens == 0:  # nothing to run (as Generator: no prefill either)
            handle._finish()
            return handle
        self.scheduler.check(ids, params.max_tokens)  # a request that could never fit is refused here
        # Handed to the loop through the inbox, not the engine's lock: the loop holds that lock while a
        # step runs and takes it again at once, so a submitter waiting on it could wait many steps.
        self._inbox.append(handle)
        self._wake.set()
        if self.background and self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, name="realizar-serving", daemon=True)
                    self._thread.start()
        return handle

    def warm_up(self) -> float:
        """Prepare the backend for the first requests (its ``warm_up``: kernels loaded, step graphs captured),
        before any is submitted; the seconds it took (0 for a backend without one)."""
        warm = getattr(self.backend, "warm_up", None)
        if warm is None:
            return 0.0
        t0 = time.perf_counter()
        with self._cv:
            if self.scheduler.has_work or self._inbox:
                raise InvalidRequestError("warm_up runs before the first request")
            warm()
        return time.perf_counter() - t0

    def embed(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> np.ndarray:
        """Unit-norm embeddings ``[len(inputs), dimensions or hidden]`` of token-id sequences
        (:mod:`realizar.embeddings`): each input is prefilled on the backend between two steps, through KV blocks of
        its own taken from the pool and given back (:meth:`~realizar.serving.backend.BatchBackend.hidden_rows`), and
        its final-norm rows pooled as the model's metadata says. Runs in the calling thread, one input per hold of
        the engine, so generations go on between inputs. A pool too full for an input raises
        :class:`~realizar.errors.KVPoolExhaustedError`."""
        from realizar.embeddings import pool, unit_vectors
        from realizar.errors import UnsupportedError

        cfg = self.backend.config
        hidden_rows = getattr(self.backend, "hidden_rows", None)
        if hidden_rows is None:
            raise UnsupportedError(f"{type(self.backend).__name__} computes no hidden rows (no embeddings)")
        rows = []
        for ids in inputs:
            with self._cv:
                if self._closed:
                    raise EngineClosedError("the serving engine is closed")
                blocks = self.scheduler.pool.allocate(self.scheduler.pool.blocks_for(len(ids)))
                try:
                    rows.append(pool(hidden_rows(ids, blocks), cfg.pooling))
                finally:
                    self.scheduler.pool.free(blocks)
        return unit_vectors(rows, cfg.hidden_size, dimensions)

    def _drain_inbox(self) -> None:
        """Apply the cancels that came during a step and queue the submitted requests with the
        scheduler (caller holds the engine's lock)."""
        while self._cancels:
            self._cancel_locked(self._cancels.popleft())
        while self._inbox:
            handle = self._inbox.popleft()
            if handle._done.is_set():  # cancelled before it was queued
                continue
            try:
                params = handle.state.params
                handle._seq = self.scheduler.add(handle.state.prompt_ids, params.max_tokens, handle, params.priority)
            except BaseException as exc:  # noqa: BLE001 - checked at submit; a failure is the request's
                handle.fail(exc)
                continue
            self._active.add(handle)

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Submit every prompt (with one params for all, or one each) and wait for all results (with
        ``background=False``, this thread runs the steps until they are done)."""
        if params is None or isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        handles = []
        try:
            for p, sp in zip(prompts, plist):
                handles.append(self.submit(p, sp))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        if not self.background:
            while not all(h.done for h in handles):
                self.step()
        return [h.wait() for h in handles]

    def _cancel(self, handle: RequestHandle) -> None:
        """Stop ``handle``: its stream ends now; its blocks are freed now when no step is running,
        else by the loop before its next step (a cancel never waits for a step)."""
        if not self._cv.acquire(blocking=False):
            handle._finish(reason="cancelled")  # the stream ends now; the blocks go before the next step
            self._cancels.append(handle)
            self._wake.set()
            return
        try:
            self._cancel_locked(handle)
        finally:
            self._cv.release()

    def _cancel_locked(self, handle: RequestHandle) -> None:
        if handle._seq is not None:
            self.scheduler.cancel(handle._seq)  # (a no-op for a sequence already retired)
        self._active.discard(handle)
        handle._finish(reason="cancelled")  # (a no-op for a finished handle)

    # -- the loop --------------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Run one scheduler iteration now, in the calling thread (the background loop does this;
        also for tests and tools that drive the engine by hand)."""
        t0 = time.perf_counter()
        with self._cv:
            self._drain_inbox()
            out = self.scheduler.step()
            for h in [h for h in self._active if h._done.is_set()]:
                self._active.discard(h)
            self._last_batch = out.decode_batch
            pool = self.scheduler.pool
            stats = StepStats(
                decode_batch=out.decode_batch, prefill_tokens=sum(n for _, _, n in out.prefills),
                tokens_out=len(out.tokens), preempted=len(out.preempted), running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting), blocks_used=pool.num_used, blocks_free=pool.num_available,
                seconds=time.perf_counter() - t0,
            )  # fmt: skip
            self._snapshot = self._stats_locked()
            events, pool.events = pool.events, ([] if pool.events is not None else None)
        if events and self.kv_events is not None:
            self.kv_events.publish_pool_events(events, pool.block_size, ROOT_KEY)
        if self.on_step is not None:
            self.on_step(stats)
        return out

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._wake.clear()  # before draining: a submit or cancel after this sets it again
                self._drain_inbox()
                idle = not self.scheduler.has_work
            if self._closed:
                return
            if idle:
                self._wake.wait()
                continue
            try:
                self.step()
            except BaseException as exc:  # a backend failure: every request in flight gets it
                self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cv:
            while self._inbox:
                self._active.add(self._inbox.popleft())
            for h in list(self._active):
                if h._seq is not None:
                    self.scheduler.cancel(h._seq)
                h.fail(exc)
            self._active.clear()

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still in flight end with :class:`EngineClosedError`."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_all(EngineClosedError("the serving engine was closed"))
        if self.kv_events is not None:
            self.kv_events.close()

    def __enter__(self) -> "ServingEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- metrics --------------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """Counters now, or as of the end of the last step while one is running (a metrics scrape
        never waits for a step). ``waiting`` always counts the requests submitted since, which the engine
        queues at its next step."""
        snap = None
        if not self._cv.acquire(blocking=False):
            snap = self._snapshot
            if snap is None:
                self._cv.acquire()
        if snap is None:
            try:
                snap = self._stats_locked()
            finally:
                self._cv.release()
        return dataclasses.replace(snap, waiting=snap.waiting + len(self._inbox))

    def _stats_locked(self) -> EngineStats:
        s, p = self.scheduler, self.scheduler.pool.stats()
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting), blocks_total=p.usable, blocks_used=p.used,
            blocks_free=p.free, blocks_cached=p.cached, prefix_queries=p.queries, prefix_hits=p.hits,
            prefix_hit_tokens=p.hit_tokens, prefix_query_tokens=p.query_tokens, prefix_hit_rate=p.hit_rate,
            prefilled_tokens=s.prefilled_tokens, cached_tokens=s.cached_tokens, decoded_tokens=s.decoded_tokens,
            preemptions=s.preemptions, steps=s.steps, last_decode_batch=self._last_batch,
        )  # fmt: skip
