"""The server's Prometheus metrics, on a ``prometheus_client`` registry of their own (one per app,
so that several apps in one process do not share counts)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
TOKEN_COUNT_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


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
        self.queue_depth = Gauge("realizar_queue_depth", "Generation requests waiting for the model.", registry=r)
        self.running = Gauge("realizar_requests_running", "Generation requests running on the model (0 or 1).",
                             registry=r)  # fmt: skip
        self.request_latency = Histogram(
            "realizar_request_duration_seconds",
            "Time from receiving a generation request to its last byte, by endpoint.",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_latency = Histogram("realizar_queue_wait_seconds", "Time a generation request waited for the model.",
                                       buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
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

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return generate_latest(self.registry)
