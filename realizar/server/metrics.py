"""The server's Prometheus metrics, on a ``prometheus_client`` registry of their own (one per app,
so that several apps in one process do not share counts).

Besides the HTTP and per-request figures, :meth:`ServerMetrics.attach` exports the serving engine's
state, read from :meth:`~realizar.serving.ServingEngine.stats` at every scrape: sequences running and
waiting, KV blocks used / free / cached / total, the prefix cache (lookups, hits, hit rate), prompt
tokens prefilled vs taken from the cache, preemptions and steps; and, from the engine's ``on_step``
hook, the decode batch size of every step (a histogram)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
TOKEN_COUNT_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _EngineCollector(Collector):
    """The serving engine's state at scrape time (``stats()`` is a consistent snapshot)."""

    def __init__(self, stats: Callable[[], Any]):
        self._stats = stats

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


class ServerMetrics:
    """Every metric the OpenAI-compatible server exports."""

    def __init__(self, model: str, device: str):
        r = self.registry = CollectorRegistry()
        self.info = Gauge("realizar_model_info", "The served model and device (value is always 1).",
                          ("model", "device"), registry=r)  # fmt: skip
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

    def attach(self, serving: Any) -> None:
        """Export ``serving``'s state (a :class:`~realizar.serving.ServingEngine`) and record its
        steps (its ``on_step`` hook; a hook it already had is still called)."""
        self.registry.register(_EngineCollector(serving.stats))
        previous = serving.on_step

        def on_step(step: Any) -> None:
            if step.decode_batch:
                self.batch_size.observe(step.decode_batch)
            if step.prefill_tokens:
                self.prefill_chunk.observe(step.prefill_tokens)
            if previous is not None:
                previous(step)

        serving.on_step = on_step

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)
