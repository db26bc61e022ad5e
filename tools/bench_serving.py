"""Serving throughput and latency on the GPU: batched decode at the backend, and many concurrent requests
through the serving engine and the HTTP server, beside llama.cpp's batched figures.

    python tools/bench_serving.py --out docs/results/bench_serving_h200.md
    python tools/bench_serving.py --shapes smollm2-135m --batches 1,8,64 --parts batched

Parts (``--parts``):

* ``batched`` — what ``llama-batched-bench -npp 128 -ntg 128`` measures: B sequences each prefilled with
  ``--prompt`` random tokens, then ``--gen`` decode steps of all B at once through
  :class:`realizar.gpu.batch.GpuBatchBackend` (one graph replay per step, greedy sampling on the GPU,
  4 bytes a sequence read back). Aggregate decode tok/s = B x gen / wall time of the decode steps;
  the ratio to our B = 1 and to llama.cpp's figure at the same B.
* ``engine`` — C concurrent requests (prompt ``--prompt`` tokens, ``--gen`` output tokens; and a mixed
  load of prompts 32..1024 / outputs 16..256) submitted at once to :class:`realizar.serving.ServingEngine`:
  aggregate output tok/s, time to first token and inter-token latency p50/p99.
* ``http`` — the same requests as streaming completions through the OpenAI-compatible server
  (uvicorn in this process, ``httpx`` streaming clients).

Random weights at the real shapes (``realizar.models.random.BENCH_SHAPES``). llama.cpp's figures:
``llama-batched-bench -npp 128 -ntg 128`` (flash attention on) on an H200 with random weights,
2026-11-25 (../shared/GUIDE.md); not re-run here.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from realizar import cuda
from realizar.gpu.batch import GpuBatchBackend
from realizar.gpu.model import GpuModel
from realizar.models.random import BENCH_SHAPES, bench_model

# llama-batched-bench -npp 128 -ntg 128, aggregate tok/s at B = 1 / 8 / 32 / 64 / 128 (../shared/GUIDE.md)
LLAMA_CPP_BATCHED = {
    "smollm2-135m": {1: 819, 8: 4618, 32: 8256, 64: 11598, 128: 13599},
    "llama-3.2-1b": {1: 814, 8: 3634, 32: 8964, 64: 12691, 128: 14198},
    "llama-3-8b": {1: 281, 8: 984, 32: 3379, 64: 4765, 128: 5507},
}
LLAMA_CPP_ORIGIN = ("llama.cpp: `llama-batched-bench -npp 128 -ntg 128` (flash attention on), H200, random weights "
                    "at the same shapes, 2026-11-25 (../shared/GUIDE.md); not re-run here")


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def bench_batched(backend: GpuBatchBackend, batches: list[int], prompt: int, gen: int, rng) -> dict[int, dict]:
    """{B: {"tok_s", "step_ms", "prefill_s"}}: B sequences prefilled then decoded together."""
    from realizar.sampling import RowSampling

    bs = backend.block_size
    per_seq = -(-(prompt + gen) // bs)
    out = {}
    for b in batches:
        if b > backend.max_batch or 1 + b * per_seq > backend.num_blocks:
            print(f"  B={b}: skipped (max_batch {backend.max_batch}, {backend.num_blocks} blocks)", flush=True)
            continue
        tables = [list(range(1 + r * per_seq, 1 + (r + 1) * per_seq)) for r in range(b)]
        tokens = []
        t0 = time.perf_counter()
        for r in range(b):
            ids = [int(t) for t in rng.integers(0, backend.config.vocab_size, prompt)]
            tokens.append(int(backend.prefill(ids, 0, tables[r]).sample([RowSampling()])[0]))
        prefill_s = time.perf_counter() - t0
        specs = [RowSampling()] * b
        # warm-up: the bucket's first step captures its graph
        backend.decode(tokens, [prompt] * b, tables).sample(specs)
        t0 = time.perf_counter()
        for step in range(1, gen):
            tokens = backend.decode(tokens, [prompt + step] * b, tables).sample(specs).tolist()
        wall = time.perf_counter() - t0
        steps = gen - 1
        out[b] = {"tok_s": b * steps / wall, "step_ms": 1e3 * wall / steps, "prefill_s": prefill_s}
        print(f"  B={b}: {out[b]['tok_s']:.0f} tok/s aggregate, {out[b]['step_ms']:.2f} ms/step "
              f"(prefill of {b}x{prompt} tokens {prefill_s:.2f} s)", flush=True)
    return out


def batched_table(name: str, res: dict[int, dict]) -> list[str]:
    peer = LLAMA_CPP_BATCHED.get(name, {})
    one = res.get(1, {}).get("tok_s")
    lines = [f"### {name}: batched decode (prompt 128, 128 generated per sequence)", "",
             "| B | aggregate tok/s | ms / step | x our B=1 | llama.cpp tok/s | x llama.cpp |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b, r in sorted(res.items()):
        p = peer.get(b)
        vs_one = f"{r['tok_s'] / one:.1f}" if one else "-"
        vs_peer = f"{r['tok_s'] / p:.2f}" if p else "-"
        lines.append(f"| {b} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | {vs_one} | {p or '-'} | {vs_peer} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(BENCH_SHAPES))
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--parts", default="batched")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--kv-dtype", default="f16")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = cuda.current_device()
    batches = [int(b) for b in a.batches.split(",")]
    parts = a.parts.split(",")
    lines = [f"# bench_serving — {dev.name}, {datetime.date.today()}", "",
             f"Command: `python {' '.join(shlex.quote(x) for x in sys.argv)}`", "", LLAMA_CPP_ORIGIN, ""]
    rng = np.random.default_rng(0)
    for name in a.shapes.split(","):
        cfg, tensors, _ = bench_model(name)
        model = GpuModel(cfg, tensors, max_len=a.prompt + a.gen, device=dev, kv_cache=False)
        need = max(batches) * -(-(a.prompt + a.gen) // a.block_size) + 1
        backend = GpuBatchBackend(model, num_blocks=need, block_size=a.block_size, kv_dtype=a.kv_dtype,
                                  max_batch=max(batches), max_context=a.prompt + a.gen)
        print(f"{name}: {backend.num_blocks} blocks of {a.block_size}, kv {a.kv_dtype}", flush=True)
        if "batched" in parts:
            lines += batched_table(name, bench_batched(backend, batches, a.prompt, a.gen, rng))
        backend.close()
        del backend, model, tensors
        gc.collect()
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
