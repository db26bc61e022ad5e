"""Decode tokens/s of the GPU model at real model shapes (random weights), against llama.cpp's figures
and the weight-bandwidth roofline.

    python tools/bench_decode.py --out docs/results/bench_decode_h200.md [--shapes smollm2-135m,llama-3.2-1b]
    python tools/bench_decode.py --gguf path/to/model.gguf      # a real file instead

Weights are random GGUF blocks with sane f16 scales (quantized kernels read every byte whatever the
values, so speed does not depend on them). Each shape: 8 prompt tokens, then ``--tokens`` greedy
decode steps through ``forward_gpu_resident_to_token_id`` (one graph replay + a 4-byte read back per
token), wall-clock from the host as llama-bench's tg measures it; GPU time per token from CUDA events.
The llama.cpp column is llama-bench tg on an H200 from ../shared/GUIDE.md (same shapes, random weights).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from realizar import cuda
from realizar.gpu.model import GpuModel
from realizar.models.config import ModelConfig
from realizar.models.quants import LAYOUTS, row_nbytes
from realizar.models.tensor import QuantTensor
from realizar.cuda.bench import copy_bandwidth

T = {lay.name: t for t, lay in LAYOUTS.items()}

# name: (config kwargs, weight type, embedding type, output type, llama.cpp tok/s on H200)
SHAPES = {
    "smollm2-135m": (dict(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=1e5, rope_type="normal",
                          rms_norm_eps=1e-5, context_length=8192, tied_embeddings=True), "Q4_1", "Q8_0", None, 957),
    "llama-3.2-1b": (dict(architecture="llama", vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32,
                          num_kv_heads=8, head_dim=64, intermediate_size=8192, rope_theta=5e5, rope_type="normal",
                          rms_norm_eps=1e-5, context_length=8192, tied_embeddings=True), "Q4_K", "Q6_K", None, 903),
    "llama-3-8b": (dict(architecture="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=5e5, rope_type="normal",
                        rms_norm_eps=1e-5, context_length=8192, tied_embeddings=False), "Q4_K", "Q4_K", "Q6_K", 277),
}


def random_tensor(rng: np.random.Generator, name: str, wtype: str, shape: tuple[int, ...]) -> QuantTensor:
    """Random blocks of ``wtype`` with every f16 scale field set to a small finite value."""
    t = T[wtype]
    lay = LAYOUTS[t]
    if wtype == "F32":
        data = (rng.standard_normal(int(np.prod(shape))) * 0.02).astype(np.float32).view(np.uint8)
        return QuantTensor(name, t, shape, data)
    nbytes = shape[0] * row_nbytes(t, shape[1])
    blocks = rng.integers(0, 256, size=nbytes, dtype=np.uint8).reshape(-1, lay.type_size)
    for f in lay.fields:
        if f.dtype == "f16":
            blocks[:, f.offset:f.offset + 2] = np.frombuffer(np.float16(0.002 if f.name != "dmin" else 0.001).tobytes(),
                                                             np.uint8)
    if wtype == "F16":
        blocks = (rng.standard_normal(blocks.shape[0]) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return QuantTensor(name, t, shape, blocks.reshape(-1))


def build(shape: str, seed: int = 0) -> tuple[ModelConfig, dict, int]:
    cfg_kw, wtype, etype, otype, _ = SHAPES[shape]
    cfg = ModelConfig(**cfg_kw)
    rng = np.random.default_rng(seed)
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    tensors = {"token_embd.weight": random_tensor(rng, "token_embd.weight", etype, (v, h)),
               "output_norm.weight": random_tensor(rng, "output_norm.weight", "F32", (h,))}
    if otype:
        tensors["output.weight"] = random_tensor(rng, "output.weight", otype, (v, h))
    for i in range(cfg.num_layers):
        for n, shp in (("attn_q", (cfg.q_dim, h)), ("attn_k", (cfg.kv_dim, h)), ("attn_v", (cfg.kv_dim, h)),
                       ("attn_output", (h, cfg.q_dim)), ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
            tensors[f"blk.{i}.{n}.weight"] = random_tensor(rng, f"blk.{i}.{n}.weight", wtype, shp)
        for n in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{n}.weight"] = random_tensor(rng, n, "F32", (h,))
    weight_bytes = sum(t.nbytes for n, t in tensors.items() if n != "token_embd.weight")
    if cfg.tied_embeddings:
        weight_bytes += tensors["token_embd.weight"].nbytes  # the LM head reads the whole table
    return cfg, tensors, weight_bytes


def bench(model: GpuModel, tokens: int) -> tuple[float, float]:
    """(host tokens/s, GPU µs per token)."""
    tok = 1
    for pos in range(8):
        tok = model.forward_gpu_resident_to_token_id(tok, pos)
    t0 = time.perf_counter()
    for pos in range(8, 8 + tokens):
        tok = model.forward_gpu_resident_to_token_id(tok, pos)
    wall = time.perf_counter() - t0
    e0, e1 = cuda.Event(), cuda.Event()
    e0.record(model.stream)
    for pos in range(8, 8 + tokens):  # GPU time: replays back to back, no read-back between them
        model.step_values.set(token=tok, pos=pos, seq_len=pos + 1)
        model._graph.replay(model.stream, model.step_values)
    e1.record(model.stream)
    e1.synchronize()
    return tokens / wall, e0.elapsed_ms(e1) * 1e3 / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
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
        wb = sum(x.nbytes for n, x in t.items() if n != "token_embd.weight" or loaded.config.tied_embeddings)
        jobs = [(a.gguf.name, loaded.config, t, wb, None)]
    else:
        jobs = [(s, *build(s), SHAPES[s][4]) for s in a.shapes.split(",")]
    for name, cfg, tensors, wbytes, peer in jobs:
        model = GpuModel(cfg, tensors, max_len=4096, device=dev, pdl=False)
        tps_plain, gpu_plain = bench(model, a.tokens)  # graph without programmatic dependent launch
        model.pdl, model._graph = True, None  # re-capture with it
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
