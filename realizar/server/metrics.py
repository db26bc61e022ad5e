"""The server's Prometheus metrics, on a ``prometheus_client`` registry of their own (one per app,
so that several apps in one process do not share counts).

Besides the HTTP and per-request figures, :meth:`ServerMetrics.attach` exports the serving engine's
state, read from :meth:`~realizar.serving.ServingEngine.stats` at every scrape: sequences running and
waiting, KV blocks used / free / cached / total, the prefix cache (lookups, hits, hit rate), prompt
tokens prefilled vs taken from the cache, preemptions and steps; and, from the engine's ``on_step``
hook, the decode batch size of every step (a histogram).

Beside our ``realizar_*`` names the same figures are exported under vLLM's names and ``model_name`` label
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_queries`` / ``_hits`` in prompt tokens, ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``, ``vllm:request_success`` by
``finished_reason``, prompt / generation token counters and lengths, ``vllm:num_preemptions``), which is what
routers that balance vLLM replicas read (the Gateway API inference extension, vllm-router, sglang-router)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics", "CONTENT_TYPE", "share_between_processes", "shared"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
TOKEN_COUNT_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _EngineCollector(Collector):
    """The serving engine's state at scrape time (``stats()`` is a consistent snapshot)."""

    def __init__(self, stats: Callable[[], Any], model: str):
        self._stats = stats
        self._model = model

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        gauges = (
            ("realizar_requests_running", "Sequences in the running batch (prefilling or decoding).", s.running),
            ("realizar_queue_depth", "Sequences waiting for room in the batch (new or preempted).", s.waiting),
            ("realizar_kv_blocks_used", "KV cache blocks held by sequences.", s.blocks_used),
            ("realizar_kv_blocks_free", "KV cache blocks free (cached blocks nobody holds included).", s.blocks_free),
            ("realizar_kv_blocks_cached", "KV cache blocks registered in the prefix cache.", s.blocks_cached),
            ("realizar_kv_blocks_total", "KV cache blocks in the pool (the reserved null block excluded).",
             s.blocks_total),
            ("realizar_prefix_cache_hit_rate", "Fraction of prompt tokens looked up that were found in the prefix "
             "cache, since start.", s.prefix_hit_rate),
        )  # fmt: skip
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))
        counters = (
            ("realizar_prefix_cache_queries", "Admissions that looked their prompt up in the prefix cache.",
             s.prefix_queries),
            ("realizar_prefix_cache_hits", "Admissions that found at least one cached block.", s.prefix_hits),
            ("realizar_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
             s.prefix_query_tokens),
            ("realizar_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens),
            ("realizar_prompt_tokens_prefilled", "Positions computed by prefill (recomputed ones included).",
             s.prefilled_tokens),
            ("realizar_prompt_tokens_cached", "Prompt positions taken from the prefix cache instead of prefilled.",
             s.cached_tokens),
            ("realizar_preemptions", "Sequences preempted (blocks freed, recomputed later) for lack of KV blocks.",
             s.preemptions),
            ("realizar_engine_steps", "Scheduler iterations run.", s.steps),
        )  # fmt: skip
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=float(value))
        yield from self._vllm(s)

    def _vllm(self, s: Any) -> Iterator[Any]:
        """The same state under vLLM's names (``model_name`` label)."""
        used = s.blocks_used / s.blocks_total if s.blocks_total else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in the running batch.", s.running),
            ("vllm:num_requests_waiting", "Number of requests waiting for room in the batch.", s.waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: the fraction of KV blocks held by requests (1 = full).", used),
        ):  # fmt: skip
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(value))
            yield g
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.", s.prefix_query_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens found.", s.prefix_hit_tokens),
            ("vllm:num_preemptions", "Preempted requests (blocks freed, recomputed later).", s.preemptions),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], float(value))
            yield c


class ServerMetrics:
    """Every metric the OpenAI-compatible server exports."""

    def __init__(self, model: str, device: str):
        r = self.registry = CollectorRegistry()
        self.info = Gauge("realizar_model_info", "The served model and device (value is always 1).",
                          ("model", "device"), registry=r, multiprocess_mode="max")  # fmt: skip
        self.info.labels(model=model, device=device).set(1)
        self.requests = Counter("realizar_requests_total", "HTTP requests answered, by endpoint and status code.",
                                ("endpoint", "status"), registry=r)  # fmt: skip
        self.prompt_tokens = Counter("realizar_prompt_tokens_total", "Prompt tokens processed (prefill).", registry=r)
        self.generation_tokens = Counter("realizar_generation_tokens_total", "Tokens generated.", registry=r)
        self.cancelled = Counter("realizar_requests_cancelled_total",
                                 "Generations stopped because the client went away.", registry=r)  # fmt: skip
        self.batch_size = Histogram("realizar_batch_size", "Sequences advanced by one decode step, per step.",
                                    buckets=BATCH_BUCKETS, registry=r)  # fmt: skip
        self.prefill_chunk = Histogram("realizar_prefill_chunk_tokens", "Prompt tokens of a step's prefill chunk.",
                                       buckets=TOKEN_COUNT_BUCKETS, registry=r)  # fmt: skip
        self.request_latency = Histogram(
            "realizar_request_duration_seconds",
            "Time from receiving a generation request to its last byte, by endpoint.",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram("realizar_time_to_first_token_seconds",
                              "Time from receiving a generation request to its first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("realizar_time_per_output_token_seconds",
                              "Mean decode time per generated token after the first, per request.",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_len = Histogram("realizar_request_prompt_tokens", "Prompt length of generation requests.",
                                    buckets=TOKEN_COUNT_BUCKETS, registry=r)  # fmt: skip
        self.completion_len = Histogram("realizar_request_generation_tokens", "Generated tokens per request.",
                                        buckets=TOKEN_COUNT_BUCKETS, registry=r)  # fmt: skip
        self.model = model
        self.vllm = _VllmRequestMetrics(r, model)
        self._engine: _EngineCollector | None = None  # (attach)

    def attach(self, serving: Any) -> None:
        """Export ``serving``'s state (a :class:`~realizar.serving.ServingEngine`) and record its
        steps (its ``on_step`` hook; a hook it already had is still called)."""
        self._engine = _EngineCollector(serving.stats, self.model)
        self.registry.register(self._engine)
        previous = serving.on_step

        def on_step(step: Any) -> None:
            if step.decode_batch:
                self.batch_size.observe(step.decode_batch)
            if step.prefill_tokens:
                self.prefill_chunk.observe(step.prefill_tokens)
            if previous is not None:
                previous(step)

        serving.on_step = on_step

    # ---- per-request events, recorded under both names ----------------------------------------------
    def request_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm.prompt_tokens.inc(prompt_tokens)

    def first_token(self, seconds: float) -> None:
        """A request's first generated token, ``seconds`` after it was received."""
        self.ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        """The time between two consecutive tokens of one request."""
        self.vllm.itl.observe(seconds)

    def request_finished(self, result: Any, generated: int, seconds: float | None, reason: str) -> None:
        """A request's end: ``generated`` tokens streamed; with ``seconds`` (its end-to-end latency) and
        ``result`` (None for a failed or cancelled one) its lengths and finish reason."""
        self.generation_tokens.inc(generated)
        self.vllm.generation_tokens.inc(generated)
        self.vllm.success.labels(model_name=self.model, finished_reason=reason).inc()
        if seconds is not None:
            self.vllm.e2e.observe(seconds)
        if result is None:
            return
        self.prompt_len.observe(result.prompt_tokens)
        self.completion_len.observe(result.completion_tokens)
        self.vllm.prompt_len.observe(result.prompt_tokens)
        self.vllm.completion_len.observe(result.completion_tokens)
        if result.completion_tokens > 1 and result.decode_seconds > 0:
            self.tpot.observe(result.decode_seconds / (result.completion_tokens - 1))

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format; with several server processes (prometheus_client's
        multiprocess mode, :func:`share_between_processes`), every process's figures summed, and the engine's state."""
        if not shared():
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        if self._engine is not None:
            registry.register(self._engine)
        return generate_latest(registry)


def shared() -> bool:
    """Whether this process's metrics live in prometheus_client's multiprocess files (:func:`share_between_processes`)."""
    from prometheus_client import values

    return bool(getattr(values.ValueClass, "_multiprocess", False))


def share_between_processes(directory: str) -> None:
    """Keep this process's metrics, and those of the processes it starts afterwards, in ``directory``
    (prometheus_client's multiprocess mode), so any of several HTTP server processes answers ``/metrics`` with
    all of their figures. Call it before any :class:`ServerMetrics` is made."""
    import os

    from prometheus_client import values

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # (inherited by the processes started later)
    values.ValueClass = values.MultiProcessValue()


class _VllmRequestMetrics:
    """The request-level figures under vLLM's names, each labelled with the served model's name."""

    def __init__(self, r: CollectorRegistry, model: str):
        def hist(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, ("model_name",), buckets=buckets, registry=r).labels(model_name=model)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ("model_name",), registry=r).labels(model_name=model)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time from receiving a request to its first token.",
                         LATENCY_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two consecutive tokens of a request.",
                        TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Time from receiving a request to its end.",
                        LATENCY_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens of finished requests.", TOKEN_COUNT_BUCKETS)
        self.completion_len = hist("vllm:request_generation_tokens", "Generated tokens of finished requests.",
                                   TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests received.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason (stop, length, abort).",
                               ("model_name", "finished_reason"), registry=r)
