"""One decode step of GpuModel and of GpuBatchBackend at one row, side by side: host tokens/s, GPU µs per
step (graph replays back to back), and, under Nsight Compute, the time of every kernel of one eager step.

    python tools/profile_step.py --shapes smollm2-135m,llama-3-8b
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python tools/profile_step.py --shapes llama-3-8b --ncu > kernels.csv

With ``--ncu`` only the two eager steps run, each between cuProfilerStart and cuProfilerStop, so ncu sees
nothing else (weight uploads, graph captures). Random weights at the real shapes.

``--batch B`` profiles GpuBatchBackend's decode step of B rows instead (B sequences prefilled with the 128-token
context first): GPU µs per step from graph replays, or with ``--ncu`` one eager step in the profiler range;
``tools/ncu_summary.py`` sums ncu's CSV by kernel family. ``--events`` times every kernel of the step in sequence
instead (the step's launches recorded once, then replayed eagerly with a CUDA event after each, caches as the step
leaves them; the median of 20 replays per kernel, summed by family as ncu_summary does):

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        python tools/profile_step.py --shapes llama-3-8b --batch 256 --ncu > kernels.csv
    python tools/ncu_summary.py kernels.csv
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

from cuda.bindings import driver

from bench_decode import bench as decode_rate  # tools/ is on the path when run as a script
from ncu_summary import times_table

from realizar import cuda
from realizar.cuda.bench import median_us
from realizar.cuda.launch import recording
from realizar.cuda.stream import Event
from realizar.gpu.batch import GpuBatchBackend
from realizar.gpu.model import GpuModel
from realizar.models.random import BENCH_SHAPES, bench_model
from realizar.sampling import RowSampling

PROMPT = 128


def backend_rate(backend: GpuBatchBackend, tokens: int) -> tuple[float, float, float]:
    """(host tok/s, GPU µs/step, host µs of decode()+staging per step) of one row through decode().sample()."""
    bs = backend.block_size
    table = list(range(1, 1 + -(-(PROMPT + tokens + 1) // bs)))
    spec = [RowSampling()]
    tok = int(backend.prefill(list(range(1, PROMPT + 1)), 0, table).sample(spec)[0])
    tok = int(backend.decode([tok], [PROMPT], [table]).sample(spec)[0])  # captures bucket 1
    t0 = time.perf_counter()
    for pos in range(PROMPT + 1, PROMPT + tokens):
        tok = int(backend.decode([tok], [pos], [table]).sample(spec)[0])
    wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    for pos in range(PROMPT + 1, PROMPT + 1 + 200):
        backend.decode([tok], [pos], [table])  # staging only, no launch
    stage_us = (time.perf_counter() - t0) / 200 * 1e6
    graph = backend.graphs.graph((1, True, False))  # one greedy row: the variant ending in the argmax
    e0, e1 = cuda.Event(), cuda.Event()
    e0.record(backend.stream)
    for _ in range(tokens):
        graph.launch(backend.stream)
    e1.record(backend.stream)
    e1.synchronize()
    return (tokens - 1) / wall, e0.elapsed_ms(e1) * 1e3 / tokens, stage_us


def in_sequence_us(records: list, stream, reps: int = 20) -> list[tuple[str, float]]:
    """(kernel name, median µs) of every recorded launch replayed in order on ``stream``, an event after each; one
    untimed replay first so the host runs ahead of the GPU (a launch costs the host less than any kernel here)."""
    if any(r.stream is not stream for r in records):
        raise RuntimeError("the step launched on more than one stream; in-sequence times would mix them")
    events = [[Event(device=stream.device) for _ in range(len(records) + 1)] for _ in range(reps)]
    for rep in range(-1, reps):
        if rep >= 0:
            events[rep][0].record(stream)
        for i, r in enumerate(records):
            r.relaunch()
            if rep >= 0:
                events[rep][i + 1].record(stream)
    stream.synchronize()
    return [(r.kernel.source.entry, statistics.median(ev[i].elapsed_ms(ev[i + 1]) * 1e3 for ev in events))
            for i, r in enumerate(records)]


def batch_step(model: GpuModel, b: int, tokens: int, ncu: bool, events: bool = False) -> float | None:
    """GpuBatchBackend's decode step of ``b`` rows after ``b`` prefilled contexts: GPU µs per step, the median of 5
    runs of ``tokens`` graph replays of its bucket (None with ``ncu``: one eager step runs inside the profiler range
    instead; with ``events`` it prints the in-sequence kernel times of one eager step and returns None)."""
    bs = 32
    per_seq = -(-(PROMPT + tokens + 2) // bs)
    backend = GpuBatchBackend(model, num_blocks=1 + b * per_seq, block_size=bs, kv_dtype="f16", max_batch=b,
                              max_context=PROMPT + tokens + 2, use_graph=not (ncu or events), f16_weights=False)
    tables = [list(range(1 + r * per_seq, 1 + (r + 1) * per_seq)) for r in range(b)]
    spec = [RowSampling()]
    ids = [int(backend.prefill([1 + (r + i) % 1000 for i in range(PROMPT)], 0, tables[r]).sample(spec)[0])
           for r in range(b)]
    specs = spec * b
    ids = backend.decode(ids, [PROMPT] * b, tables).sample(specs).tolist()  # loads the kernels (captures the graph)
    try:
        if ncu:
            driver.cuProfilerStart()
            backend.decode(ids, [PROMPT + 1] * b, tables).sample(specs)
            driver.cuProfilerStop()
            return None
        if events:
            with recording() as records:
                backend.decode(ids, [PROMPT + 1] * b, tables).sample(specs)
            print("\n".join(times_table(in_sequence_us(records, backend.stream))))
            return None
        graph = backend.graphs.graph(backend.graphs.keys()[-1])  # (the step just captured: the most recent)
        return median_us(lambda: [graph.launch(backend.stream) for _ in range(tokens)], backend.stream, tokens, 5)
    finally:
        backend.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(BENCH_SHAPES))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--ncu", action="store_true", help="only one eager step of each, inside profiler ranges")
    ap.add_argument("--out", type=Path, help="also write the lines to this file")
    ap.add_argument("--batch", type=int, help="profile GpuBatchBackend's decode step of this many rows instead")
    ap.add_argument("--events", action="store_true", help="with --batch: every kernel's time in sequence, by event")
    a = ap.parse_args()
    dev = cuda.current_device()
    if a.batch:
        for name in a.shapes.split(","):
            cfg, tensors, _ = bench_model(name)
            model = GpuModel(cfg, tensors, max_len=PROMPT + a.tokens + 2, device=dev, use_graph=False)
            us = batch_step(model, a.batch, a.tokens, a.ncu, a.events)
            if us is not None:
                print(f"- {name}: decode step of {a.batch} rows {us:.1f} µs GPU ({a.batch / us * 1e6:.0f} tok/s)")
            model.release_kv()
        return
    lines = [f"# profile_step — {dev.name}, {datetime.date.today()}", "",
             f"Command: `python {' '.join(shlex.quote(x) for x in sys.argv)}`", "",
             f"Greedy decode after a {PROMPT}-token context, {a.tokens} steps; GPU µs from CUDA events over graph "
             "replays back to back; backend: GpuBatchBackend at one row (f16 paged KV, 32-position blocks).", ""]
    for name in a.shapes.split(","):
        cfg, tensors, _ = bench_model(name)
        model = GpuModel(cfg, tensors, max_len=1024, device=dev, use_graph=not a.ncu)
        backend = GpuBatchBackend(model, num_blocks=64, block_size=32, kv_dtype="f16", max_batch=1,
                                  max_context=1024, use_graph=not a.ncu, f16_weights=False)
        if a.ncu:
            model.forward_gpu_resident_to_token_id(1, 0)  # loads every kernel
            backend.decode([1], [0], [[1]]).sample([RowSampling()])
            driver.cuProfilerStart()
            model.forward_gpu_resident_to_token_id(1, 1)
            driver.cuProfilerStop()
            driver.cuProfilerStart()
            backend.decode([1], [1], [[1]]).sample([RowSampling()])
            driver.cuProfilerStop()
        else:
            m_tps, m_us = decode_rate(model, a.tokens, PROMPT)
            b_tps, b_us, stage_us = backend_rate(backend, a.tokens)
            line = (f"- {name}: GpuModel {m_tps:.0f} tok/s host, {m_us:.1f} µs GPU/step | backend 1 row "
                    f"{b_tps:.0f} tok/s host ({100 * b_tps / m_tps:.0f}%), {b_us:.1f} µs GPU/step "
                    f"({100 * m_us / b_us:.0f}% of GpuModel's speed), decode() staging {stage_us:.1f} µs")
            print(line, flush=True)
            lines.append(line)
        backend.close()
        model.release_kv()
        del model, backend, tensors
    if a.out and not a.ncu:
        a.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
