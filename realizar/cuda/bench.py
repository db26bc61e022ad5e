"""Measurement helpers shared by the benchmarks: event timing, and the memory-bandwidth ceiling they
compare against."""

from __future__ import annotations

import statistics

import numpy as np

from realizar.cuda.graph import capture
from realizar.cuda.memory import GpuBuffer
from realizar.cuda.stream import Event, Stream

__all__ = ["copy_bandwidth", "graph_median_us", "median_us"]


def copy_bandwidth(stream: Stream, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written: median of ``reps``
    event-timed copies of ``nbytes`` after two warm-up copies."""
    with GpuBuffer(nbytes, np.uint8) as a, GpuBuffer(nbytes, np.uint8) as b:
        a.fill_bytes(1)
        times = []
        for i in range(reps + 2):
            e0, e1 = Event(), Event()
            e0.record(stream)
            b.copy_from(a, stream=stream)
            e1.record(stream)
            e1.synchronize()
            if i >= 2:
                times.append(e0.elapsed_ms(e1) / 1e3)
    return 2 * nbytes / statistics.median(times)


def median_us(run, stream: Stream, calls: int, reps: int) -> float:
    """Median over ``reps`` of (event time of ``run()`` / ``calls``) in µs, after one warm-up ``run()``;
    ``run`` issues ``calls`` calls on ``stream``."""
    start, end = Event(device=stream.device), Event(device=stream.device)
    run()
    stream.synchronize()
    samples = []
    for _ in range(reps):
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        samples.append(start.elapsed_ms(end) * 1e3 / calls)
    return statistics.median(samples)


def graph_median_us(fns, stream: Stream, use_graph: bool = True, reps: int = 7) -> tuple[float, str]:
    """(median µs per launch, "graph" or "eager"): ``fns`` each issue one launch on ``stream``; they are
    captured into one CUDA graph whose replays are event-timed (the first replay dropped), or, where
    capture fails or ``use_graph`` is off, issued back to back (then the host's launch cost counts)."""
    for fn in fns[: min(len(fns), 8)]:  # warm-up (and module loads before any capture)
        fn()
    stream.synchronize()
    exe = None
    if use_graph:
        try:
            with capture(stream) as cap:
                for fn in fns:
                    fn()
            exe = cap.graph.instantiate()
        except Exception as exc:  # noqa: BLE001 - fall back to eager timing
            print(f"  (graph capture failed: {exc}; timing back-to-back launches)")
    times = []
    for i in range(reps + 1):
        e0, e1 = Event(), Event()
        e0.record(stream)
        if exe is not None:
            exe.replay(stream)
        else:
            for fn in fns:
                fn()
        e1.record(stream)
        e1.synchronize()
        if i:
            times.append(e0.elapsed_ms(e1) * 1e3 / len(fns))
    return statistics.median(times), "graph" if exe is not None else "eager"
