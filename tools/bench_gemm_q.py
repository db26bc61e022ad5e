"""Small-M GEMM on quantized weights (``GemmOps.gemm_q``) at the batched decode step's shapes, against its
two alternatives: ``dequant_f16`` + ``gemm_f16`` (today's batched path) and M repeated GEMVs.

    python tools/bench_gemm_q.py [--types Q4_K,Q6_K,Q8_0,Q4_1] [--models 8b,1b,smol] [--ms 1,2,4,8,16,32,64,128]

Per weight type, model shape (qkv, o, gate_up as the fused SwiGLU GEMM, down) and M: µs per call (median
of CUDA-graph replays, :func:`realizar.cuda.bench.graph_median_us`, rotating over enough weight copies
(>= 3x the L2) that every call reads its weights from HBM), the weight bandwidth as % of the device's
copy bandwidth (cuMemcpyDtoD, bytes read + written, measured in the same run), TFLOP/s (2 M N K), and
the time of the same M through dequant_f16 + gemm_f16 and through M GEMV calls as ratios over gemm_q's
("deq+gemm x", "gemv x": above 1 means gemm_q is faster), and for M <= 8 the tensor-core GEMV's columns
kernel (``gemv_cols``, f16 x as the batched step passes it) with "gemv_cols x" = gemm_q's time over its
(above 1: gemv_cols is faster) and a check of its result against gemm_q's. Weights are uploaded in the layout their decode
GEMV reads (``GemvOps.upload``'s policy). A spot check compares gemm_q's result with dequant_f16 +
gemm_f16's at each shape. Per model and type, the last line sums one layer's four GEMMs at each M over
the M = 1 sum.
"""

from __future__ import annotations

import argparse

import numpy as np

from realizar import cuda
from realizar.cuda.bench import copy_bandwidth, graph_median_us
from realizar.gpu.gemv import cols_per_launch
from realizar.gpu.ops import GpuWeight, LayerOps
from realizar.models.random import random_weight

MODELS = {  # (label, out rows, in_dim, glu)
    "8b": [("qkv 6144x4096", 6144, 4096, False), ("o 4096x4096", 4096, 4096, False),
           ("gate_up 2x14336x4096", 2 * 14336, 4096, True), ("down 4096x14336", 4096, 14336, False)],
    "1b": [("qkv 3072x2048", 3072, 2048, False), ("o 2048x2048", 2048, 2048, False),
           ("gate_up 2x8192x2048", 2 * 8192, 2048, True), ("down 2048x8192", 2048, 8192, False)],
    "smol": [("qkv 960x576", 960, 576, False), ("o 576x576", 576, 576, False),
             ("gate_up 2x1536x576", 2 * 1536, 576, True), ("down 576x1536", 576, 1536, False)],
}
L2_BYTES = 60 << 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_1")
    ap.add_argument("--models", default="8b,1b,smol")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--small-types", default="Q4_K,Q4_1", help="types timed at the 1B / SmolLM2 shapes")
    ap.add_argument("--no-peers", action="store_true", help="skip dequant+gemm and the GEMV loop")
    args = ap.parse_args()
    dev = cuda.current_device()
    ops = LayerOps(dev)
    stream = cuda.Stream()
    bw = copy_bandwidth(stream)
    print(f"device: {dev.name}, copy bandwidth {bw / 1e9:.0f} GB/s")
    ms = [int(v) for v in args.ms.split(",")]
    rng = np.random.default_rng(0)
    for model in args.models.split(","):
        types = args.types.split(",") if model == "8b" else args.small_types.split(",")
        for wtype in types:
            print(f"\n## {model} {wtype}\n")
            print("| shape | layout | M | µs | % copy BW | TFLOP/s | deq+gemm µs | deq+gemm x | gemv µs | gemv x "
                  "| gemv_cols µs | gemv_cols % copy BW | gemv_cols x |")
            print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            layer = {m_: 0.0 for m_ in ms}
            cols_layer = {m_: 0.0 for m_ in ms}  # gemv_cols where it applies (M <= 8), else gemm_q
            for label, rows, kdim, glu in MODELS[model]:
                cols = rows // 2 if glu else rows
                raw = random_weight(rng, wtype, rows, kdim)
                layout = "rows"
                if kdim % 256 == 0:
                    try:
                        layout = ops.weight_layout(cols, kdim, wtype, glu=glu)
                    except Exception:  # noqa: BLE001
                        layout = "rows"
                w0 = GpuWeight(data=raw, ggml_type=wtype, shape=(rows, kdim), layout=layout)
                copies = [w0] + [GpuWeight(data=raw, ggml_type=wtype, shape=(rows, kdim), layout=layout)
                                 for _ in range(max(0, -(-3 * L2_BYTES // w0.nbytes) - 1))]
                mmax = max(ms)
                x16 = ops.to_device((rng.standard_normal((mmax, kdim)) * 0.5).astype(np.float16))
                x32 = ops.to_device((rng.standard_normal((mmax, kdim)) * 0.5).astype(np.float32))
                y = cuda.GpuBuffer(mmax * rows, np.float32)
                y2 = cuda.GpuBuffer(mmax * rows, np.float32)
                w16 = cuda.GpuBuffer(rows * kdim, np.float16)
                # spot check at M = 9 (or the largest M below)
                mc = min(9, mmax)
                ops.gemm_q(x16, w0, y, mc, glu=glu)
                ops.dequantize_f16(w0, w16, interleave=glu)
                ops.gemm_f16(x16, w16, y2, mc, rows, kdim, glu=glu)
                a = y.to_numpy()[: mc * cols]
                b = y2.to_numpy()[: mc * cols]
                rel = float(np.abs(a - b).max() / (np.abs(b).max() + 1e-30))
                print(f"<!-- {label}: gemm_q vs dequant+gemm_f16 at M={mc}: max |diff| / max |y| = {rel:.2e} -->")
                for m_ in ms:
                    t, _ = graph_median_us([lambda w=w: ops.gemm_q(x16, w, y, m_, glu=glu, stream=stream)
                                            for w in copies], stream)
                    layer[m_] += t
                    flops = 2 * m_ * rows * kdim / (t * 1e-6) / 1e12
                    pct = w0.nbytes / (t * 1e-6) / bw * 100
                    d_s = d_x = g_s = g_x = "-"
                    if not args.no_peers:
                        td, _ = graph_median_us(
                            [lambda w=w: (ops.dequantize_f16(w, w16, interleave=glu, stream=stream),
                                          ops.gemm_f16(x16, w16, y, m_, rows, kdim, glu=glu, stream=stream))
                             for w in copies], stream)
                        d_s, d_x = f"{td:.1f}", f"{td / t:.2f}"
                        if m_ <= 64:
                            def gemv_loop(w, m_=m_):
                                for i in range(m_):
                                    xi = (x32, i * kdim)
                                    yi = (y, i * cols)
                                    if glu:
                                        ops.gemv_glu(w, xi, yi, stream=stream)
                                    else:
                                        ops.gemv(w, xi, yi, stream=stream)
                            tg, _ = graph_median_us([lambda w=w: gemv_loop(w) for w in copies], stream)
                            g_s, g_x = f"{tg:.1f}", f"{tg / t:.2f}"
                    c_s = c_p = c_x = "-"
                    if m_ <= 8 and ops.mma_cols_config(cols, kdim, wtype, min(m_, cols_per_launch(wtype, glu)), glu=glu,
                                                       layout=layout) is not None:
                        tc, _ = graph_median_us([lambda w=w: ops.gemv_cols(w, x16, y2, m_, glu=glu, xh=True,
                                                                           stream=stream) for w in copies], stream)
                        c_s, c_p, c_x = f"{tc:.1f}", f"{w0.nbytes / (tc * 1e-6) / bw * 100:.0f}%", f"{t / tc:.2f}"
                        cols_layer[m_] += tc
                        ops.gemm_q(x16, w0, y, m_, glu=glu, stream=stream)
                        ops.gemv_cols(w0, x16, y2, m_, glu=glu, xh=True, stream=stream)
                        stream.synchronize()
                        a, b = y.to_numpy()[: m_ * cols], y2.to_numpy()[: m_ * cols]
                        rel = float(np.abs(a - b).max() / (np.abs(a).max() + 1e-30))
                        if not rel < 1e-2:
                            c_x += f" **MISMATCH {rel:.1e}**"
                    else:
                        cols_layer[m_] += t
                    print(f"| {label} | {layout} | {m_} | {t:.1f} | {pct:.0f}% | {flops:.1f} | {d_s} | {d_x} | "
                          f"{g_s} | {g_x} | {c_s} | {c_p} | {c_x} |", flush=True)
                for w in copies:
                    w.free()
                for buf in (x16, x32, y, y2, w16):
                    buf.free()
            base = layer[ms[0]]
            print("\nlayer (4 GEMMs): " + ", ".join(f"M={m_}: {layer[m_]:.0f} µs ({layer[m_] / base:.2f}x)"
                                                     for m_ in ms))
            print("layer with gemv_cols up to M=8: " + ", ".join(
                f"M={m_}: {cols_layer[m_]:.0f} µs ({cols_layer[m_] / base:.2f}x)" for m_ in ms if m_ <= 8))


if __name__ == "__main__":
    main()
