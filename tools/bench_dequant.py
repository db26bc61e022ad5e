"""Benchmark of the f16 dequantization (``LayerOps.dequantize_f16``): the prefill weight shapes of the
three bench models, per weight type and layout, against the device's copy bandwidth.

    python tools/bench_dequant.py [--types Q4_K,Q6_K] [--out table.md] [--check] [--sweep]

Bytes counted: the weight's bytes read once plus the f16 matrix written once. Each measurement replays
a CUDA graph of at least 20 launches timed with CUDA events (median of 5 replays after a warm-up),
rotating over enough copies of weight and output (>= 3x the L2 size in total) that the L2 cannot
serve them. "% copy" divides by the device-to-device copy bandwidth measured in the same run (bytes
read + written). ``--check`` compares every element of one launch per case with the f16 rounding of
the float32 reference dequantization (bitwise). ``--sweep`` also times the kernel at other CTA sizes
(warps) and rounds per warp (to tune ``realizar.gpu.dequant.dequant_warps`` and the default rounds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ptx_gen.kernels.dequant.dequant import DEFAULT_ROUNDS, total_rounds
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES
from realizar import cuda
from realizar.cuda.bench import copy_bandwidth, graph_median_us
from realizar.gpu.ops import GpuWeight, LayerOps
from realizar.models.random import dequant, random_weight

SHAPES = [  # (label, out_dim, in_dim, [gate; up])
    ("SmolLM2 qkv 960x576", 960, 576, False),
    ("SmolLM2 gate/up 3072x576", 3072, 576, True),
    ("SmolLM2 down 576x1536", 576, 1536, False),
    ("1B qkv 3072x2048", 3072, 2048, False),
    ("1B gate/up 16384x2048", 16384, 2048, True),
    ("8B o 4096x4096", 4096, 4096, False),
    ("8B gate/up 28672x4096", 28672, 4096, True),
    ("8B down 4096x14336", 4096, 14336, False),
]
TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q4_1", "F16", "Q5_K", "Q4_0", "BF16")
L2_BYTES = 60 << 20


def _launcher(ops: LayerOps, w: GpuWeight, o, interleave: bool, stream, shape: dict | None):
    """One launch of the host op (``shape`` None) or of the kernel of ``shape`` (warps, rounds)."""
    if shape is None:
        return lambda: ops.dequantize_f16(w, o, interleave=interleave, stream=stream)
    kern = ops.kernel("dequant_f16", wtype=w.wtype, in_dim=w.in_dim, layout=w.layout, interleave=interleave, **shape)
    grid = -(-total_rounds(w.wtype, w.in_dim, w.layout, w.out_dim) // kern.meta["rounds_per_cta"])
    values = {"w": w.ptr, "out": o.ptr, "out_dim": w.out_dim}
    return lambda: ops.launch(kern, grid, values, stream)


def _time(fns, stream) -> float:
    """Median seconds per launch: replays of a CUDA graph of the launches (back to back without graphs)."""
    return graph_median_us(fns, stream, reps=5)[0] / 1e6


def _check(ops: LayerOps, raw, wtype, out_dim, in_dim, layout, interleave) -> str:
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
    o = cuda.GpuBuffer(out_dim * in_dim, np.float16)
    o.fill_bytes(0x7E)  # 0x7E7E: an f16 NaN
    ops.dequantize_f16(w, o, interleave=interleave)
    got = o.to_numpy().reshape(out_dim, in_dim).view(np.uint16)
    ref = dequant(raw, wtype, out_dim, in_dim).astype(np.float16)
    if interleave:
        ref = np.stack([ref[: out_dim // 2], ref[out_dim // 2:]], axis=1).reshape(out_dim, in_dim)
    bad = int((got != ref.view(np.uint16)).sum())
    w.free()
    o.free()
    return "ok" if bad == 0 else f"{bad} differ"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time warps 1..16 x rounds (default, x2) per case")
    args = ap.parse_args()
    dev = cuda.current_device()
    ops = LayerOps(dev)
    stream = cuda.Stream(dev)
    bw = copy_bandwidth(stream)
    rng = np.random.default_rng(0)
    lines = [f"device: {dev.name}, copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", "",
             "| shape | type | layout | interleave | launch | µs | GB/s | % copy | check |",
             "|---|---|---|---|---|---:|---:|---:|---|"]
    print("\n".join(lines), flush=True)
    for wtype in args.types.split(","):
        for label, out_dim, in_dim, glu in SHAPES:
            if wtype in ("Q4_K", "Q5_K", "Q6_K") and in_dim % 256:
                continue
            raw = random_weight(rng, wtype, out_dim, in_dim)
            tiled = wtype in MMA_TYPES and in_dim % 256 == 0
            layouts = ["rows"] + (["glu-tiles" if glu else "tiles"] if tiled else [])
            for layout in layouts:
                w0 = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout)
                nbytes = w0.buffer.nbytes + 2 * out_dim * in_dim
                copies = max(1, -(-3 * L2_BYTES // nbytes))
                pairs = [(w0 if i == 0 else GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim),
                                                      layout=layout), cuda.GpuBuffer(out_dim * in_dim, np.float16))
                         for i in range(copies)]
                check = _check(ops, raw, wtype, out_dim, in_dim, layout, glu) if args.check else ""
                shapes = [None]
                if args.sweep:
                    g = DEFAULT_ROUNDS[wtype]
                    shapes += [dict(warps=wp, rounds=r) for wp in (1, 2, 4, 8, 16) for r in (g, 2 * g)]
                for shape in shapes:
                    try:
                        fns = [_launcher(ops, *pairs[i % len(pairs)], glu, stream, shape)
                               for i in range(max(20, 2 * copies))]
                    except ValueError:
                        continue  # (a sweep shape the kernel cannot take)
                    t = _time(fns, stream)
                    tag = "op" if shape is None else f"w{shape['warps']} g{shape['rounds']}"
                    line = (f"| {label} | {wtype} | {layout} | {glu} | {tag} | {t * 1e6:.1f} | "
                            f"{nbytes / t / 1e9:.0f} | {100 * nbytes / t / bw:.0f} | {check} |")
                    print(line, flush=True)
                    lines.append(line)
                for w, o in pairs:
                    w.free()
                    o.free()
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
