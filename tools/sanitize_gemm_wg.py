"""Sanitizer cases of the warpgroup-MMA batch GEMMs over quantized weights (sm_90a): ``gemm_wg`` and the
warp-specialized ``gemm_ws``, small launches over every launch-shape kind the policy picks, each output checked
against its float64 oracle.

    compute-sanitizer --tool memcheck  python tools/sanitize_gemm_wg.py
    compute-sanitizer --tool racecheck python tools/sanitize_gemm_wg.py --small

The cases: Q4_K (with and without the f16x2 decoder), Q6_K, Q8_0 and Q4_1 weights in the layouts the model keeps
(tile-major, [gate; up] glu-tiles through the SwiGLU epilogue with f16 output, GGUF rows), token counts that end
inside a tile (tokens past M: outputs never written; every second case's X buffer holds NaN rows up to the tile's
end, which the tensor map then spans and reads, the others' map ends at M and fills the rest with zeros), one and two
consumer warpgroups, 64-, 128- and 256-token tiles, ring depths 2-8, one to four producer warpgroups a strip
(psplit), producers fencing 2 or 4 stages at once (pfence), X multicast to a cluster pair (xcast), K split over two and four CTAs (their partial
sums through a workspace, counters left at zero), X by 16-byte copies and by a tensor map, the residual
epilogue in place; every element against the float64 oracle over the dequantized weights and the f16 X (relative to
the sum of the absolute products), the NaN
poison past the rows untouched. A device that is not sm_90 has nothing to check (said, exit 0). The CPU tests run
:func:`case` on the emulated sm_90 device (tests/test_tools_cpu.py).
"""

from __future__ import annotations

import argparse

import numpy as np

from realizar import cuda
from realizar.gpu.gemm_wg import WgConfig, WsConfig, split_room
from realizar.gpu.ops import GpuWeight, LayerOps
from realizar.models.random import dequant, random_weight

# (kernel, wtype, layout, out_dim, in_dim, m, config): out_dim counts [gate; up] rows for glu-tiles
CASES_SMALL = [
    ("gemm_ws", "Q4_K", "tiles", 192, 512, 70, WsConfig(64, 1, 2, 2, True, True)),
    ("gemm_ws", "Q4_K", "glu-tiles", 256, 512, 200, WsConfig(256, 2, 3, 2, True, False)),
    ("gemm_ws", "Q6_K", "tiles", 128, 256, 130, WsConfig(128, 2, 4, 2, False, False)),
    ("gemm_wg", "Q8_0", "tiles", 128, 512, 45, WgConfig(64, 1, 2, 2, 2)),
    ("gemm_ws", "Q4_K", "tiles", 256, 1024, 150, WsConfig(128, 2, 3, 2, True, True, 2)),
    # Stream-K: 210 tiles over at most 132 CTAs (tiles split between two)
    ("gemm_ws", "Q4_K", "tiles", 4480, 512, 130, WsConfig(64, 1, 3, 2, True, True, streamk=True)),
]
CASES = CASES_SMALL + [
    ("gemm_ws", "Q4_K", "rows", 320, 768, 300, WsConfig(256, 1, 4, 3, True, True)),
    ("gemm_ws", "Q4_1", "tiles", 192, 512, 33, WsConfig(64, 2, 3, 2, True, False)),
    ("gemm_ws", "Q8_0", "glu-tiles", 128, 256, 129, WsConfig(128, 1, 2, 3, False, False)),
    ("gemm_wg", "Q4_K", "glu-tiles", 256, 512, 140, WgConfig(128, 2, 1, 3, 2)),
    ("gemm_wg", "Q6_K", "rows", 64, 1024, 7, WgConfig(64, 1, 2, 4, 2)),
    ("gemm_ws", "Q4_K", "tiles", 128, 1024, 100, WsConfig(64, 1, 6, 2, True, True, 4)),
    ("gemm_ws", "Q6_K", "rows", 192, 768, 90, WsConfig(128, 1, 8, 2, True, False)),
    ("gemm_ws", "Q4_K", "tiles", 128, 1024, 140, WsConfig(128, 1, 4, 2, True, True, 2, 4)),
    ("gemm_ws", "Q4_K", "glu-tiles", 256, 768, 70, WsConfig(64, 2, 3, 2, True, True, 1, 2)),
    ("gemm_ws", "Q4_K", "tiles", 256, 1024, 200, WsConfig(128, 2, 5, 2, True, True, 2, 1, 4)),
    ("gemm_ws", "Q6_K", "glu-tiles", 128, 512, 90, WsConfig(64, 1, 3, 2, False, False, 1, 1, 2)),
    ("gemm_ws", "Q4_K", "tiles", 192, 1024, 140, WsConfig(128, 2, 4, 2, True, True, 4, 1, 2, 2)),
    ("gemm_ws", "Q4_K", "glu-tiles", 256, 512, 200, WsConfig(256, 2, 3, 2, True, True, 1, 1, 2, 2)),
    # Stream-K on the 8B gate/up's launch shape: 140 tiles over 132 CTAs
    ("gemm_ws", "Q4_K", "glu-tiles", 8960, 512, 300, WsConfig(256, 2, 3, 2, True, True, pfence=2, streamk=True)),
]


def _oracle(raw, wtype, out_dim, in_dim, x, glu, residual):
    """float64 reference and the scale of what was summed for each output (the error is relative to it)."""
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    xs = np.asarray(x, np.float64)
    y, scale = xs @ w.T, np.abs(xs) @ np.abs(w).T
    if glu:
        ffn = out_dim // 2
        g, u = y[:, :ffn], y[:, ffn:]
        y, scale = g / (1.0 + np.exp(-g)) * u, (np.abs(g) + scale[:, :ffn]) * (np.abs(u) + scale[:, ffn:])
    return (y, scale) if residual is None else (y + residual, scale + np.abs(residual))


def case(ops, rng, kernel, wtype, layout, out_dim, in_dim, m, cfg, pad_x: bool = False) -> None:
    """One launch of ``kernel`` with launch shape ``cfg``: glu-tiles through the SwiGLU epilogue to f16, the others
    with the residual added in place; checked element by element, the rows past ``m`` still NaN. ``pad_x``: X's
    buffer holds NaN rows past ``m`` up to the end of the last token tile."""
    glu = layout == "glu-tiles"
    cols = out_dim // 2 if glu else out_dim
    raw = random_weight(rng, wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout, device=ops.device)
    x = ((rng.standard_normal((m, in_dim)) + 0.1) / (64 if glu else 1)).astype(np.float16)  # (f16 out: no overflow)
    r = None if glu else rng.standard_normal((m, cols)).astype(np.float32)
    ytype = np.float16 if glu else np.float32
    y_host = np.full((m + 3, cols), np.nan, ytype)
    if r is not None:
        y_host[:m] = r
    pad = -m % cfg.mt if pad_x else 0
    dx = ops.to_device(np.concatenate([x, np.full((pad, in_dim), np.nan, np.float16)]))
    dy = ops.to_device(y_host)
    room = split_room(cfg, cols, m, glu) if kernel == "gemm_ws" else (0, 0)
    split = {"split": ops.split_space(*room)} if room[0] else {}
    getattr(ops, kernel)(dx, w, dy, m, glu=glu, out_f16=glu, config=cfg, residual=None if glu else dy, **split)
    got = dy.to_numpy().reshape(m + 3, cols)
    if split:
        assert not split["split"].counters.to_numpy().any(), "counters not left at zero"
    for buf in (dx, dy, w, *split.values()):
        buf.free()
    ref, scale = _oracle(raw, wtype, out_dim, in_dim, x, glu, r)
    what = f"{kernel} {wtype} {layout} {out_dim}x{in_dim} m={m} {cfg}"
    assert np.isnan(got[m:]).all(), f"{what}: wrote past its {m} rows"
    body = got[:m].astype(np.float64)
    assert not np.isnan(body).any(), f"{what}: outputs left unwritten (NaN)"
    err = (np.abs(body - ref) / (scale + 1e-30)).max()
    tol = 2.0 ** -9 if glu else 2.0 ** -10  # (the GPU tests' tolerances: f16 output; f16 MMA operands, f32 sums)
    assert err < tol, f"{what}: max relative error {err:.2e} (tolerance {tol:.0e})"


def cases(rng, which) -> int:
    ops = LayerOps()
    if ops.device.target.compute_capability != (9, 0):
        print(f"gemm_wg and gemm_ws are sm_90a kernels; this device is {ops.device.target}: nothing to check")
        return 0
    for i, c in enumerate(which):
        case(ops, rng, *c, pad_x=i % 2 == 1)
    return len(which)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="the first six cases (racecheck is slow)")
    a = ap.parse_args()
    n = cases(np.random.default_rng(0), CASES_SMALL if a.small else CASES)
    cuda.current_device().synchronize()
    print(f"ok gemm_wg sanitize cases: {n}")


if __name__ == "__main__":
    main()
