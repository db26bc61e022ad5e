"""A small, thread-safe Prometheus metrics registry rendering the text exposition format (0.0.4).

Hand-written so that the server needs no extra dependency; ``prometheus_client``'s parser reads it.
"""

from __future__ import annotations

import math
import threading
from typing import Iterable, Sequence

__all__ = ["Counter", "Gauge", "Histogram", "Registry", "ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
TOKEN_COUNT_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v))


def _labels(names: Sequence[str], values: Sequence[str], extra: Iterable[tuple[str, str]] = ()) -> str:
    pairs = [*zip(names, values), *extra]
    if not pairs:
        return ""
    return "{" + ",".join(f'{n}="{_escape(v)}"' for n, v in pairs) + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class _ValueMetric(_Metric):
    """A metric holding one number per label set (the common part of Counter and Gauge)."""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {}
        if not self.labelnames:
            self._values[()] = 0

    def _add(self, amount: float, labels: dict[str, str]) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels(self.labelnames, k)} {_fmt(v)}" for k, v in items]


class Counter(_ValueMetric):
    """A monotonically increasing count. ``name`` should end in ``_total``."""

    kind = "counter"

    def inc(self, amount: float = 1, **labels: str) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self._add(amount, labels)


class Gauge(_ValueMetric):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = value

    def inc(self, amount: float = 1, **labels: str) -> None:
        self._add(amount, labels)

    def dec(self, amount: float = 1, **labels: str) -> None:
        self._add(-amount, labels)


class Histogram(_Metric):
    """Observations counted into cumulative ``le`` buckets, with ``_sum`` and ``_count``."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float], labelnames: Sequence[str] = ()):
        super().__init__(name, help, labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets))
        # key -> [per-bucket counts (not cumulative), sum, count]
        self._data: dict[tuple[str, ...], list] = {}
        if not self.labelnames:
            self._data[()] = [[0] * len(self.buckets), 0.0, 0]

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                entry = self._data[key] = [[0] * len(self.buckets), 0.0, 0]
            for i, b in enumerate(self.buckets):
                if value <= b:
                    entry[0][i] += 1
                    break
            entry[1] += value
            entry[2] += 1

    def count(self, **labels: str) -> int:
        with self._lock:
            entry = self._data.get(self._key(labels))
            return entry[2] if entry else 0

    def render(self) -> list[str]:
        lines = self.header()
        with self._lock:
            items = sorted((k, (list(e[0]), e[1], e[2])) for k, e in self._data.items())
        for key, (counts, total, n) in items:
            running = 0
            for b, c in zip(self.buckets, counts):
                running += c
                lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, [('le', _fmt(b))])} {running}")
            lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, [('le', '+Inf')])} {n}")
            lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_fmt(total)}")
            lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {n}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def register(self, metric: _Metric) -> _Metric:
        if any(m.name == metric.name for m in self._metrics):
            raise ValueError(f"metric {metric.name} registered twice")
        self._metrics.append(metric)
        return metric

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines.extend(m.render())  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"


class ServerMetrics:
    """Every metric the OpenAI-compatible server exports."""

    def __init__(self, model: str, device: str):
        r = self.registry = Registry()
        self.info = r.register(Gauge("realizar_model_info", "The served model and device (value is always 1).", ("model", "device")))
        self.info.set(1, model=model, device=device)
        self.requests = r.register(
            Counter("realizar_requests_total", "HTTP requests answered, by endpoint and status code.", ("endpoint", "status"))
        )
        self.prompt_tokens = r.register(Counter("realizar_prompt_tokens_total", "Prompt tokens processed (prefill)."))
        self.generation_tokens = r.register(Counter("realizar_generation_tokens_total", "Tokens generated."))
        self.cancelled = r.register(
            Counter("realizar_requests_cancelled_total", "Generations stopped because the client went away.")
        )
        self.queue_depth = r.register(Gauge("realizar_queue_depth", "Generation requests waiting for the model."))
        self.running = r.register(Gauge("realizar_requests_running", "Generation requests running on the model (0 or 1)."))
        self.request_latency = r.register(
            Histogram(
                "realizar_request_duration_seconds",
                "Time from receiving a generation request to its last byte, by endpoint.",
                LATENCY_BUCKETS,
                ("endpoint",),
            )
        )
        self.queue_latency = r.register(
            Histogram("realizar_queue_wait_seconds", "Time a generation request waited for the model.", LATENCY_BUCKETS)
        )
        self.ttft = r.register(
            Histogram(
                "realizar_time_to_first_token_seconds",
                "Time from receiving a generation request to its first generated token.",
                LATENCY_BUCKETS,
            )
        )
        self.tpot = r.register(
            Histogram(
                "realizar_time_per_output_token_seconds",
                "Mean decode time per generated token after the first, per request.",
                TOKEN_LATENCY_BUCKETS,
            )
        )
        self.prompt_len = r.register(
            Histogram("realizar_request_prompt_tokens", "Prompt length of generation requests.", TOKEN_COUNT_BUCKETS)
        )
        self.completion_len = r.register(
            Histogram("realizar_request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS)
        )

    def render(self) -> str:
        return self.registry.render()
