"""Host and GPU time per decode-like step of N small kernels: eager launches vs captured vs manual graph.

    python tools/bench_graphs.py --kernels 300 --steps 200 --out docs/results/bench_graphs_h200.md

Host time is wall-clock around issuing one step (no synchronisation inside the step); GPU time is
CUDA events around many steps. The per-step copy of the step values (one 4-byte async copy from
pinned memory) is included in the graph rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from realizar import cuda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()

    dev = cuda.current_device()
    cache = cuda.module_cache(dev)
    axpy = cache.get("axpy", vec=4)
    n = 1024
    x, y = cuda.GpuBuffer.zeros(n), cuda.GpuBuffer.zeros(n)
    step = cuda.StepValues(("pos",))
    args = [axpy.args(x, y, 1e-3, n) for _ in range(a.kernels)]
    stream = cuda.Stream()

    def run_step() -> None:
        for arg in args:
            cuda.launch(axpy, 1, 256, arg, stream=stream)

    with cuda.capture(stream) as cap:
        run_step()
    captured = cap.graph.instantiate()
    with cuda.record_graph() as rec:
        run_step()
    manual = rec.graph.instantiate()
    with cuda.programmatic_dependent_launch(), cuda.capture(stream) as cap_pdl:
        run_step()
    captured_pdl = cap_pdl.graph.instantiate()
    stream.synchronize()

    def eager_step() -> None:
        step.upload(stream)
        run_step()

    variants = {
        "eager launches": eager_step,
        "captured graph replay": lambda: captured.replay(stream, step),
        "manual graph replay": lambda: manual.replay(stream, step),
        "captured graph replay, programmatic dependent launch": lambda: captured_pdl.replay(stream, step),
    }
    rows = []
    for name, fn in variants.items():
        for _ in range(10):
            fn()
        stream.synchronize()
        host = []
        for i in range(a.steps):
            step.set(pos=i)
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
            if i % 20 == 19:
                stream.synchronize()
        stream.synchronize()
        start, end = cuda.Event(), cuda.Event()
        start.record(stream)
        for _ in range(a.steps):
            fn()
        end.record(stream)
        end.synchronize()
        gpu_us = start.elapsed_ms(end) * 1e3 / a.steps
        rows.append((name, statistics.median(host), min(host), gpu_us))

    lines = [
        f"Device: {dev.name}; {a.kernels} kernels per step (axpy on {n} floats, 1 block each); "
        f"{a.steps} steps; per-step 4-byte step-value upload included.",
        "",
        "| variant | host µs/step (median) | host µs/step (min) | GPU µs/step (events) |",
        "|---|---:|---:|---:|",
    ] + [f"| {r[0]} | {r[1]:.1f} | {r[2]:.1f} | {r[3]:.1f} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
