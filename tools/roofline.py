"""The memory-bandwidth ceiling the benchmarks compare against: a large device-to-device copy."""

from __future__ import annotations

import statistics

import numpy as np

from realizar import cuda


def copy_bandwidth(stream: cuda.Stream, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written: median of ``reps``
    event-timed copies of ``nbytes`` after two warm-up copies."""
    with cuda.GpuBuffer(nbytes, np.uint8) as a, cuda.GpuBuffer(nbytes, np.uint8) as b:
        a.fill_bytes(1)
        times = []
        for i in range(reps + 2):
            e0, e1 = cuda.Event(), cuda.Event()
            e0.record(stream)
            b.copy_from(a, stream=stream)
            e1.record(stream)
            e1.synchronize()
            if i >= 2:
                times.append(e0.elapsed_ms(e1) / 1e3)
    return 2 * nbytes / statistics.median(times)
