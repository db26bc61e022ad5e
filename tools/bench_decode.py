"""Decode tokens/s of the GPU model at real model shapes (random weights), against llama.cpp's figures
and the weight-bandwidth roofline.

    python tools/bench_decode.py --out docs/results/bench_decode_h200.md [--shapes smollm2-135m,llama-3.2-1b]
    python tools/bench_decode.py --gguf path/to/model.gguf      # a real file instead

Shapes: the three of ``BENCH_SHAPES`` and the 8B shape as a Q5_K_M-like mix (Q5_K, attn_v/ffn_down of
some layers Q6_K) and all Q4_0 (``DECODE_SHAPES``). Weights are random GGUF blocks with sane f16 scales
(quantized kernels read every byte whatever the values, so speed does not depend on them). Each shape: 8 prompt tokens, then ``--tokens`` greedy
decode steps through ``forward_gpu_resident_to_token_id`` (one graph replay + a 4-byte read back per
token), wall-clock from the host as llama-bench's tg measures it; GPU time per token from CUDA events.
The llama.cpp column is llama-bench tg on an H200 from ../shared/GUIDE.md (same shapes, random weights).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from realizar import cuda
from realizar.cuda.bench import copy_bandwidth
from realizar.gpu.model import GpuModel
from realizar.models.random import DECODE_SHAPES, bench_model, token_read_bytes

# llama-bench tg128 tok/s on an H200, random weights at the same shapes (../shared/GUIDE.md, 2026-11-21)
LLAMA_CPP_TG = {"smollm2-135m": 957, "llama-3.2-1b": 903, "llama-3-8b": 277}


def bench(model: GpuModel, tokens: int, prompt: int = 8) -> tuple[float, float]:
    """(host tokens/s, GPU µs per token) of ``tokens`` greedy steps after ``prompt`` fed one by one
    (also tools/profile_step.py's and tools/bench_serving.py's single-stream rate)."""
    tok = 1
    for pos in range(prompt):
        tok = model.forward_gpu_resident_to_token_id(tok, pos)
    t0 = time.perf_counter()
    for pos in range(prompt, prompt + tokens):
        tok = model.forward_gpu_resident_to_token_id(tok, pos)
    wall = time.perf_counter() - t0
    stream = model.sequence.stream
    e0, e1 = cuda.Event(device=stream.device), cuda.Event(device=stream.device)
    e0.record(stream)
    for pos in range(prompt, prompt + tokens):  # GPU time: replays back to back, no read-back between them
        model._run_step(tok, pos)
    e1.record(stream)
    e1.synchronize()
    return tokens / wall, e0.elapsed_ms(e1) * 1e3 / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(DECODE_SHAPES))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--gguf", type=Path, help="benchmark a real GGUF file instead")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    dev = cuda.current_device()
    bw = copy_bandwidth(cuda.Stream(dev))
    rows = []
    if a.gguf:
        from realizar.models.loader import load_model

        loaded = load_model(a.gguf)
        t = loaded.tensors
        jobs = [(a.gguf.name, loaded.config, t, token_read_bytes(loaded.config, t), None)]
    else:
        jobs = [(s, *bench_model(s), LLAMA_CPP_TG.get(s)) for s in a.shapes.split(",")]
    for name, cfg, tensors, wbytes, peer in jobs:
        model = GpuModel(cfg, tensors, max_len=4096, device=dev, pdl=False)
        tps_plain, gpu_plain = bench(model, a.tokens)  # graph without programmatic dependent launch
        model.pdl = True  # a new sequence (and graphs) with it
        model.release_kv()
        tps, gpu_us = bench(model, a.tokens)
        print(f"{name}: without PDL {tps_plain:.0f} tok/s host, {gpu_plain:.0f} µs GPU/token", flush=True)
        roof = bw / wbytes
        rows.append((name, wbytes / 1e6, tps, gpu_us, roof, peer))
        print(f"{name}: {tps:.0f} tok/s host, {gpu_us:.0f} µs GPU/token, roofline {roof:.0f} tok/s", flush=True)
        del model
    lines = [f"Device: {dev.name}; copy bandwidth {bw / 1e12:.2f} TB/s (1 GiB D2D, read+write); "
             f"{a.tokens} greedy tokens after 8, graph replay per token.", "",
             "| model shape | weights MB | tok/s (host wall) | GPU µs/token | roofline tok/s | % roofline | "
             "llama.cpp tok/s | × llama.cpp |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, mb, tps, gpu_us, roof, peer in rows:
        ratio = f"{tps / peer:.2f}" if peer else "-"
        lines.append(f"| {name} | {mb:.0f} | {tps:.0f} | {gpu_us:.0f} | {roof:.0f} | {100 * tps / roof:.0f}% | "
                     f"{peer or '-'} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        a.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
