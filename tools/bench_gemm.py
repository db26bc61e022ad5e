"""Prefill GEMM throughput: the tensor-core f16 GEMM (``gemm_f16``) and the weight expansion before it
(``dequant_f16``), at the layer shapes of the benchmark models, against torch's f16 matmul (cuBLAS) in
the same run and the f16 tensor-core peak.

    python tools/bench_gemm.py --out docs/results/bench_gemm_h200.md [--tokens 512,2048] [--sweep]

Each row times ``Y[M, N] = X[M, K] W[N, K]^T`` with CUDA events (warm-up, median of 10 runs of 5 launches);
``--sweep`` also times every tile of the policy's list and reports the best. TFLOP/s counts 2 M N K.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import numpy as np

from realizar import cuda
from realizar.cuda.bench import median_us
from realizar.gpu.gemm import _SMALL_M_TILES, _TILES, GemmConfig, gemm_config
from realizar.gpu.ops import LayerOps

# (label, N, K, glu): the prefill GEMMs of SmolLM2-135M, Llama-3.2-1B and Llama-3-8B
SHAPES = [("smollm2 qkv", 960, 576, False), ("smollm2 gate/up", 3072, 576, True), ("smollm2 down", 576, 1536, False),
          ("1b qkv", 3072, 2048, False), ("1b o", 2048, 2048, False), ("1b gate/up", 16384, 2048, True),
          ("1b down", 2048, 8192, False), ("8b qkv", 6144, 4096, False), ("8b o", 4096, 4096, False),
          ("8b gate/up", 28672, 4096, True), ("8b down", 4096, 14336, False)]
PEAK_F16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def _median_us(fn, stream, reps: int = 10, inner: int = 5) -> float:
    """Median µs per call of ``fn`` over ``reps`` event-timed runs of ``inner`` back-to-back calls."""

    def run():
        for _ in range(inner):
            fn()

    return median_us(run, stream, inner, reps)


def _check(ops, x, w, y, m, n, k, glu, cfg, stream) -> float:
    """Largest error of 64 output rows against float64 on the host, relative to sum |x||w| of the element."""
    ops.gemm_f16(x, w, y, m, n, k, glu=glu, out_f16=glu, config=cfg, stream=stream)
    stream.synchronize()
    rows = min(m, 64)
    xh = x.copy_to_host(np.empty(m * k, np.float16)).reshape(m, k)[:rows].astype(np.float64)
    wh = w.copy_to_host(np.empty(n * k, np.float16)).reshape(n, k).astype(np.float64)
    cols = n // 2 if glu else n
    yh = y.copy_to_host(np.empty(m * cols, np.float16 if glu else np.float32)).reshape(m, cols)[:rows]
    full, scale = xh @ wh.T, np.abs(xh) @ np.abs(wh).T
    if glu:
        g, u = full[:, 0::2], full[:, 1::2]
        full, scale = g / (1 + np.exp(-g)) * u, (np.abs(g) + scale[:, 0::2]) * (np.abs(u) + scale[:, 1::2])
    return float(np.max(np.abs(yh - full) / scale))


def _torch_us(m: int, n: int, k: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(5):
            torch.nn.functional.linear(x, w)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / 5)
    del x, w
    torch.cuda.empty_cache()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--sweep", action="store_true", help="time every tile of the policy's list")
    ap.add_argument("--peak", type=float, default=None, help="f16 tensor-core peak in TFLOP/s")
    args = ap.parse_args()
    dev = cuda.current_device()
    ops, stream = LayerOps(dev), cuda.Stream(dev)
    peak = args.peak * 1e12 if args.peak else next((v for k_, v in PEAK_F16.items() if k_ in dev.name), 989e12)
    rng = np.random.default_rng(0)
    lines = [f"# Prefill GEMM (f16 tensor cores), {dev.name}, {datetime.date.today()}", "",
             f"Command: `python tools/bench_gemm.py --tokens {args.tokens}{' --sweep' if args.sweep else ''}`; "
             f"peak {peak / 1e12:.0f} TFLOP/s (dense f16).", "",
             "| shape | M | N x K | tile | µs | TFLOP/s | % peak | torch µs | ours / torch | max error |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for m in (int(t) for t in args.tokens.split(",")):
        for label, n, k, glu in SHAPES:
            x = ops.to_device(rng.standard_normal((m, k)).astype(np.float16))
            w = ops.to_device((rng.standard_normal((n, k)) * 0.05).astype(np.float16))
            y = ops.buffer(m * (n // 2 if glu else n), np.float16 if glu else np.float32)
            cfgs = [gemm_config(m, n, ops.sm_count, dev.max_shared_per_block_optin)]
            if args.sweep:
                cfgs += [c for c in (*_TILES, *_SMALL_M_TILES, GemmConfig(128, 256, 2, 4, 3), GemmConfig(256, 128, 4, 2, 3),
                                     GemmConfig(128, 128, 2, 2, 4), GemmConfig(128, 128, 2, 4, 3))
                         if c not in cfgs and c.smem <= dev.max_shared_per_block_optin]
            best = None
            for cfg in cfgs:
                us = _median_us(lambda: ops.gemm_f16(x, w, y, m, n, k, glu=glu, out_f16=glu, config=cfg, stream=stream),
                                stream)
                if args.sweep:
                    print(f"  {label} M={m} {cfg}: {us:.1f} us")
                if best is None or us < best[0]:
                    best = (us, cfg)
            us, cfg = best
            err = _check(ops, x, w, y, m, n, k, glu, cfg, stream)
            tus = _torch_us(m, n, k)
            flop = 2 * m * n * k
            tile = f"{cfg.bm}x{cfg.bn} w{cfg.warps_m}x{cfg.warps_n} s{cfg.stages}"
            row = (f"| {label} | {m} | {n} x {k} | {tile} | {us:.1f} | {flop / us / 1e6:.0f} | {100 * flop / us / 1e-6 / peak:.0f}% "
                   f"| {'-' if tus is None else f'{tus:.1f}'} | {'-' if tus is None else f'{tus / us:.2f}x'} | {err:.1e} |")
            print(row, flush=True)
            lines.append(row)
            for b in (x, w, y):
                b.free()
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
