"""Sanitizer cases of the transformer-layer kernels: small launches of every kernel over awkward
shapes, each checked against its float64 oracle.

    compute-sanitizer --tool memcheck  python tools/sanitize_layers.py
    compute-sanitizer --tool racecheck python tools/sanitize_layers.py --small
    REALIZAR_DEVICE=emulate python tools/sanitize_layers.py --small   # the PTX emulator's memcheck/racecheck

The small-M GEMM straight from quantized weights (``gemm_q``, the batched decode step): Q4_K, Q6_K, Q8_0,
Q4_1 and F16 weights in every layout they are stored in (GGUF rows of partial chunks and unaligned
segments, tile-major, [gate; up] glu-tiles or rows through the SwiGLU epilogue) for 1, 7 and 33 tokens
(the last in a 64-token tile: tokens past M), strided X and Y, K split over warps, each epilogue (bias,
residual from a buffer or in place, f16 output), against a float64 oracle over the dequantized weights and
the f16 X, output columns past the row untouched. The tensor-core GEMV over several columns of x
(``gemv_cols``, the batched decode step's small batches): Q4_K, Q6_K, Q8_0 and Q4_1 weights (every type of
the tensor-core GEMV without ``--small``) in the layouts LayerOps stores them (tile-major, [gate; up]
glu-tiles, Q4_K / Q5_K GGUF rows) for 1, 3 and 8 columns (more than a launch takes in several, at column
offsets), an odd number of rows (outputs), f32 or f16 x at a padded stride, bias / residual from a buffer
or in place / the SwiGLU epilogue, f32 or f16 output, K parts that do not divide the units and both ring
fills on sm_90, every output against the float64 oracle and the padding past the rows untouched
(``--gemv-cols``: only these). Per-row device sampling (``sample_rows``): greedy,
temperature + top-k and top-p rows of logits with a row stride (NaN padding, never read), against the NumPy
mirror (greedy exactly; sampled rows too, but for a top-p cut within rounding).
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from ptx_gen.kernels.gemv.gemv_mma_layout import MAX_COLS, MMA_TYPES
from ptx_gen.kernels.gemv.quant_layout import K_QUANTS, WEIGHT_TYPES
from realizar import cuda
from realizar.gpu.gemm import GemmQConfig
from realizar.gpu.gemv import COLS_WIDE_TILES, cols_per_launch
from realizar.gpu.ops import GemvConfig, GpuWeight, LayerOps, MmaConfig, inv_freq_table
from realizar.gpu.sampling import pack_specs
from realizar.models.random import dequant, random_weight
from realizar.sampling import RowSampling, sample_rows, top_p_margin


def silu(g):
    g = np.asarray(g, np.float64)
    return g / (1.0 + np.exp(-g))


def rmsnorm_oracle(x, weight, eps, residual=None):
    """float64 RMSNorm of ``x`` (+ ``residual``) and the summed input."""
    x = np.asarray(x, np.float64)
    if residual is not None:
        x = x + residual
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight, x


def _gemv_case(ops, rng, wt: str, out_dim: int, in_dim: int, cfg, layout: str = "rows") -> None:
    """y = W x + y (in place) with launch shape ``cfg``, checked against float64."""
    raw = random_weight(rng, wt, out_dim, in_dim)
    x = rng.standard_normal(in_dim).astype(np.float32)
    r = rng.standard_normal(out_dim).astype(np.float32)
    w = GpuWeight(data=raw, ggml_type=wt, shape=(out_dim, in_dim), layout=layout)
    with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer.from_numpy(r) as dy:
        ops.gemv(w, dx, dy, residual=dy, config=cfg)
        ref = dequant(raw, wt, out_dim, in_dim).astype(np.float64) @ x + r
        assert np.abs(dy.to_numpy() - ref).max() <= 1e-4 * np.abs(ref).max(), (wt, out_dim, cfg)
    w.free()


def cases(cache, rng, small: bool) -> None:
    ops = LayerOps()
    types = WEIGHT_TYPES if not small else ("Q8_0", "Q4_1", "Q6_K", "F16")
    for wt in types:
        in_dim = 1536 if wt in K_QUANTS else 1632  # rows not 16-byte aligned for most 32-blocks; K split 4 ways
        configs = ((3, GemvConfig(1, 4)), (37, GemvConfig(4, 4)), (5, GemvConfig(2, 2)),
                   (9, GemvConfig(2, 4, 4)), (11, GemvConfig(2, 8, 8)), (6, GemvConfig(1, 4, 2)))
        for out_dim, cfg in configs:
            _gemv_case(ops, rng, wt, out_dim, in_dim, cfg)
        # embedding of the last row (the end of the allocation)
        vocab, hidden = 3, in_dim
        raw = random_weight(rng, wt, vocab, hidden)
        table = GpuWeight(data=raw, ggml_type=wt, shape=(vocab, hidden))
        with cuda.GpuBuffer.from_numpy(np.array([2, 0], np.uint32)) as toks, cuda.GpuBuffer(2 * hidden) as out:
            ops.embedding(table, toks, out, 2)
            np.testing.assert_allclose(out.to_numpy((2, hidden)), dequant(raw, wt, vocab, hidden)[[2, 0]], rtol=1e-6,
                                       atol=1e-6)
        table.free()
    # the tensor-core GEMV: ring wrap-around, K parts, rows past the end, both ring fills on sm_90
    bulk_ok = ops.device.target.compute_capability >= (9, 0)
    for wt in ("Q4_K", "Q8_0", "Q6_K"):
        for out_dim, cfg in ((37, MmaConfig(1, 2, 2, 2)), (70, MmaConfig(2, 4, 4, 1)),
                             (19, MmaConfig(1, 2, 2, 1, bulk_ok)), (45, MmaConfig(2, 2, 2, 2, bulk_ok))):
            if wt == "Q6_K":  # (2-byte aligned blocks: cp.async only; rows of 2048 multiples)
                _gemv_case(ops, rng, wt, out_dim, 2048 * 3, dataclasses.replace(cfg, bulk=False))
            else:
                _gemv_case(ops, rng, wt, out_dim, 256 * cfg.kparts * 3, cfg)
            # tile-major weights (the last tile zero-filled past out_dim), one CTA an SM
            _gemv_case(ops, rng, wt, out_dim, 256 * cfg.kparts * 3, dataclasses.replace(cfg, solo=True), "tiles")
    # the 32-value block types over re-encoded tile-major weights (TILED_B32), and 16-warp CTAs whose K
    # parts do not divide the units with the late launch trigger
    for wt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        _gemv_case(ops, rng, wt, 45, 256 * 6, MmaConfig(1, 4, 2, 1), "tiles")
        _gemv_case(ops, rng, wt, 37, 256 * 5, MmaConfig(1, 2, 2, 2, bulk_ok), "tiles")
    _gemv_case(ops, rng, "Q4_K", 40, 256 * 19, MmaConfig(1, 16, 2, 2, bulk_ok, solo=True, late=True), "tiles")
    # one ring stage before the grid wait, the rest after x's first loads (ahead): bulk and cp.async rings,
    # warps with units past the ring and without
    for wt, out_dim, in_dim, cfg in (
            ("Q4_K", 40, 256 * 19, MmaConfig(1, 16, 2, 2, bulk_ok, solo=True, late=True, ahead=1)),
            ("Q5_0", 45, 256 * 6, MmaConfig(1, 4, 2, 2, bulk_ok, ahead=1)),
            ("Q8_0", 37, 256 * 3, MmaConfig(1, 3, 2, 1, bulk_ok, ahead=1)),
            ("Q6_K", 19, 256 * 4, MmaConfig(1, 2, 3, 1, ahead=2)),
            ("Q5_K", 33, 256 * 2, MmaConfig(1, 2, 2, 2, ahead=1))):
        _gemv_case(ops, rng, wt, out_dim, in_dim, cfg, "tiles")
    # fused gate/up and the prefill GEMM
    raw = random_weight(rng, "Q4_K", 2 * 7, 256)
    w = GpuWeight(data=raw, ggml_type="Q4_K", shape=(14, 256))
    X = rng.standard_normal((5, 256)).astype(np.float32)
    with cuda.GpuBuffer.from_numpy(X) as dx, cuda.GpuBuffer(7) as dy, cuda.GpuBuffer(5 * 14) as dz:
        ops.gemv_glu(w, dx, dy)
        wd = dequant(raw, "Q4_K", 14, 256).astype(np.float64)
        ref = silu(wd[:7] @ X[0]) * (wd[7:] @ X[0])
        assert np.abs(dy.to_numpy() - ref).max() <= 1e-4 * np.abs(ref).max()
        ops.gemm(w, dx, dz, 5, tokens_per_cta=3)
        assert np.abs(dz.to_numpy((5, 14)) - X @ wd.T).max() <= 1e-4 * np.abs(X @ wd.T).max()
        wg = GpuWeight(data=raw, ggml_type="Q4_K", shape=(14, 256), layout="glu-tiles")
        dy.poison()
        ops.gemv_glu(wg, dx, dy, config=MmaConfig(1, 1, 2, 2, bulk_ok))
        assert np.abs(dy.to_numpy() - ref).max() <= 1e-4 * np.abs(ref).max()
        wg.free()
    w.free()
    # norms, rope, elementwise, argmax
    for hidden in (64, 4100):
        x = rng.standard_normal((2, hidden)).astype(np.float32)
        wn = rng.standard_normal(hidden).astype(np.float32)
        with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer.from_numpy(wn) as dw, cuda.GpuBuffer(2 * hidden) as dy, \
                cuda.GpuBuffer.from_numpy(x) as dr:
            ops.rmsnorm(dx, dw, dy, 1e-5, hidden=hidden, rows=2, residual=dr)
            ref, _ = rmsnorm_oracle(x, wn, 1e-5, x)
            np.testing.assert_allclose(dy.to_numpy((2, hidden)), ref, rtol=1e-4, atol=1e-4)
    q = rng.standard_normal((2, 3, 80)).astype(np.float32)
    k = rng.standard_normal((2, 1, 80)).astype(np.float32)
    with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(k) as dk, \
            cuda.GpuBuffer.from_numpy(inv_freq_table(80, 1e4)) as inv, \
            cuda.GpuBuffer.from_numpy(np.array([5, 9], np.uint32)) as pos:
        ops.rope(dq, dk, inv, pos, 3, 1, 80, neox=True, n_tokens=2)
        ops.rope(dq, dk, inv, 3, 3, 1, 80, neox=False, n_tokens=2)
    n = 1001
    g, u = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    with cuda.GpuBuffer.from_numpy(g) as dg, cuda.GpuBuffer.from_numpy(u) as du, cuda.GpuBuffer(n) as do, \
            cuda.GpuBuffer(1, np.uint32) as best:
        ops.swiglu(dg, du, do, n)
        np.testing.assert_allclose(do.to_numpy(), silu(g) * u, rtol=1e-5, atol=1e-6)
        ops.residual_add(dg, du, dg, n)
        ops.bias_add(dg, du, 7, 143)
        ops.argmax(do, best, n)
        assert int(best.to_numpy()[0]) == int(np.argmax(do.to_numpy()))


def prefill_cases(rng, small: bool) -> None:
    """The batched-prefill kernels on ragged shapes: f16 weight expansion (every layout), the tensor-core
    GEMM with each epilogue, batched RMSNorm to f16."""
    ops = LayerOps()
    for wt in (("Q4_K", "Q8_0", "Q4_1") if small else WEIGHT_TYPES):
        in_dim = 512 if wt in K_QUANTS else 96
        for layout in ("rows", "tiles", "glu-tiles") if wt in ("Q4_K", "Q8_0", "Q6_K") and in_dim % 256 == 0 else ("rows",):
            out_dim = 38
            raw = random_weight(rng, wt, out_dim, in_dim)
            w = GpuWeight(data=raw, ggml_type=wt, shape=(out_dim, in_dim), layout=layout)
            with cuda.GpuBuffer(out_dim * in_dim, np.float16) as out:
                out.poison()
                ops.dequantize_f16(w, out, interleave=layout == "glu-tiles")
                want = dequant(raw, wt, out_dim, in_dim).astype(np.float16)
                if layout == "glu-tiles":
                    want = np.stack([want[:out_dim // 2], want[out_dim // 2:]], 1).reshape(out_dim, in_dim)
                assert np.array_equal(out.to_numpy((out_dim, in_dim)).view(np.uint16), want.view(np.uint16)), (wt, layout)
            w.free()
    m, n, k = 37, 70, 200
    x = rng.standard_normal((m, k)).astype(np.float16)
    w16 = rng.standard_normal((n, k)).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float32)
    full = x.astype(np.float64) @ w16.astype(np.float64).T
    with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer.from_numpy(w16) as dw, cuda.GpuBuffer.from_numpy(b) as db, \
            cuda.GpuBuffer(m * n) as dy, cuda.GpuBuffer(m * n // 2, np.float16) as dh:
        dy.fill_bytes(0)
        ops.gemm_f16(dx, dw, dy, m, n, k, bias=db, residual=dy)
        np.testing.assert_allclose(dy.to_numpy((m, n)), full + b, rtol=1e-4, atol=1e-3)
        ops.gemm_f16(dx, dw, dh, m, n, k, glu=True, out_f16=True)
        g, u = full[:, 0::2], full[:, 1::2]
        np.testing.assert_allclose(dh.to_numpy((m, n // 2)).astype(np.float64), silu(g) * u, rtol=2e-2, atol=2e-2)
    hidden = 576
    xs = rng.standard_normal((3, hidden)).astype(np.float32)
    wn = rng.standard_normal(hidden).astype(np.float32)
    with cuda.GpuBuffer.from_numpy(xs) as dx, cuda.GpuBuffer.from_numpy(wn) as dw, \
            cuda.GpuBuffer(3 * hidden, np.float16) as dy:
        ops.rmsnorm(dx, dw, dy, 1e-5, rows=3, out_f16=True)
        ref, _ = rmsnorm_oracle(xs, wn, 1e-5)
        np.testing.assert_allclose(dy.to_numpy((3, hidden)).astype(np.float64), ref, rtol=2e-3, atol=2e-3)


# gemm_q: per layout ("rows-glu": [gate; up] GGUF rows through the SwiGLU epilogue), the three token counts'
# (m, epilogue, config, lda pad, ldy pad); config None: the launch policy's (gemm_q_config)
_GQ_RUNS = {
    "rows": ((1, "plain", None, 0, 0), (7, "bias+residual", GemmQConfig(8, 2, 2, 3), 8, 0),
             (33, "bias+f16", GemmQConfig(64, 1, 2, 2), 0, 3)),
    "tiles": ((1, "in_place", None, 0, 0), (7, "f16", GemmQConfig(8, 1, 2, 2), 0, 5),
              (33, "bias+residual", GemmQConfig(64, 2, 1, 3), 8, 0)),
    "glu-tiles": ((1, "glu", None, 0, 0), (7, "glu+f16", GemmQConfig(16, 2, 2, 2), 0, 2),
                  (33, "glu", GemmQConfig(64, 1, 2, 3), 8, 0)),
    "rows-glu": ((1, "glu+f16", None, 0, 0), (7, "glu", GemmQConfig(8, 1, 2, 3), 8, 1),
                 (33, "glu", GemmQConfig(64, 2, 1, 2), 0, 0)),
}
# (weight type, in_dim of GGUF rows, in_dim tile-major): 32-value block rows of partial chunks (576), F16 rows
# of an 8-value tail (264), K-quants of 3 chunks (K split 2 ways: a part of 2 chunks and one of 1)
_GQ_TYPES = (("Q4_K", 768, 768), ("Q6_K", 768, 768), ("Q8_0", 576, 512), ("Q4_1", 576, 512), ("F16", 264, None))
GEMM_Q_CASES = [(wt, layout, m, epi, cfg, lda_pad, ldy_pad, kdim if layout.startswith("rows") else tdim)
                for wt, kdim, tdim in _GQ_TYPES
                for layout in (("rows", "tiles", "glu-tiles") if wt in MMA_TYPES else ("rows", "rows-glu"))
                for m, epi, cfg, lda_pad, ldy_pad in _GQ_RUNS[layout]]
GEMM_Q_CASES_SMALL = [c for c in GEMM_Q_CASES if c[0] in ("Q4_K", "Q8_0", "F16") and c[2] != 1]


def gemm_q_cases(rng, shapes) -> None:
    """``GemmOps.gemm_q`` over ``shapes`` (entries of GEMM_Q_CASES), each against the float64 oracle."""
    ops = LayerOps()
    for wt, layout, m, epi, cfg, lda_pad, ldy_pad, in_dim in shapes:
        glu = "glu" in epi
        out_dim = 38 if glu else 37  # a partial row strip (16 rows; 8 outputs with glu)
        cols = out_dim // 2 if glu else out_dim
        lda, ldy = in_dim + lda_pad, cols + ldy_pad
        out_f16 = "f16" in epi
        raw = random_weight(rng, wt, out_dim, in_dim)
        w = GpuWeight(data=raw, ggml_type=wt, shape=(out_dim, in_dim), layout=layout.replace("rows-glu", "rows"))
        x = ((rng.standard_normal((m, lda)) + 0.1) / (64 if out_f16 else 1)).astype(np.float16)  # (f16 range)
        b = rng.standard_normal(cols).astype(np.float32)
        r = rng.standard_normal((m, ldy)).astype(np.float32)
        ytype = np.float16 if out_f16 else np.float32
        y0 = r.copy() if epi == "in_place" else np.full((m, ldy), np.nan, ytype)
        what = f"gemm_q {wt} {layout} {out_dim}x{in_dim} m={m} {epi} {cfg}"
        with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer.from_numpy(b) as db, \
                cuda.GpuBuffer.from_numpy(r) as dr, cuda.GpuBuffer.from_numpy(y0) as dy:
            residual = dy if epi == "in_place" else dr if "residual" in epi else None
            ops.gemm_q(dx, w, dy, m, lda=lda, ldy=ldy, bias=db if "bias" in epi else None, residual=residual,
                       out_f16=out_f16, glu=glu, config=cfg)
            got = dy.to_numpy((m, ldy))
        w.free()
        assert np.array_equal(got[:, cols:].view(np.uint8), y0[:, cols:].view(np.uint8)), f"{what}: wrote past the row"
        ref, scale = _oracle(raw, wt, out_dim, in_dim, x, cols, glu, b if "bias" in epi else None,
                             None if residual is None else r[:, :cols])
        # f16 weights and X, f32 products and sums (2**-11 each, summed); f16 output: one more rounding
        err = np.abs(got[:, :cols].astype(np.float64) - ref) / (scale + 1e-30)
        finite = bool(np.isfinite(err).all())
        if not finite or err.max() >= (2.0 ** -9 if out_f16 else 2.0 ** -10):
            raise AssertionError(f"{what}: relative error {np.nanmax(err):.2e} (finite: {finite})")


def _oracle(raw, wt: str, rows: int, in_dim: int, x: np.ndarray, outs: int, glu: bool, bias, residual):
    """float64 (ref, scale) of the GEMM cases [tokens or columns, outs]: ``x[:, :in_dim] W^T`` (W the ``rows``
    dequantized rows of ``raw``) (+ bias) (+ residual), or with ``glu`` (W = [G; U], rows = 2 outs)
    silu(x G^T) * (x U^T); scale: the size of what is summed (for glu the product of both sides')."""
    wd = dequant(raw, wt, rows, in_dim).astype(np.float64)
    xs = x[:, :in_dim].astype(np.float64)
    full, scale = xs @ wd.T, np.abs(xs) @ np.abs(wd).T
    if glu:
        g, u = full[:, :outs], full[:, outs:]
        with np.errstate(over="ignore"):  # (silu of a large negative gate: 0)
            ref = silu(g) * u
        return ref, (np.abs(g) + scale[:, :outs]) * (np.abs(u) + scale[:, outs:])
    ref = full
    if bias is not None:
        ref, scale = ref + bias, scale + np.abs(bias)
    if residual is not None:
        ref, scale = ref + residual, scale + np.abs(residual)
    return ref, scale


# gemv_cols: per kind (plain or the fused gate/up GEMV), the three column counts' (cols, epilogue, f16 x, f16
# output, config, ldx pad, ldy pad): one f32 column of f32 out is the one-column kernel (no strides). As
# gemv_cols's policy would, the config's 32-row warps become 16-row ones beyond COLS_WIDE_TILES columns and more
# columns than a launch takes (cols_per_launch) run in launches of that many, at column offsets; bulk fills
# only on sm_90
_GC_RUNS = {
    "plain": ((1, "bias", False, False, MmaConfig(1, 3, 2, 2, bulk=True), 0, 0),
              (3, "residual", False, True, MmaConfig(2, 2, 2, 2), 4, 3),
              (8, "in_place", True, False, MmaConfig(1, 2, 4, 1, bulk=True), 8, 1)),
    "glu": ((1, "glu", False, False, MmaConfig(1, 3, 2, 2), 0, 0),
            (3, "glu", False, True, MmaConfig(2, 1, 2, 2, bulk=True), 4, 2),
            (8, "glu", True, True, MmaConfig(1, 2, 2, 2, solo=True), 8, 5)),
}
# (weight type, its plain layout, its gate/up layout) as LayerOps.upload stores them where the tensor-core GEMV
# runs (Q4_K / Q5_K: GGUF rows where a warp streams at most two units); rows of 768 values (3 units)
_GC_TYPES = (("Q4_K", "rows", "rows"), ("Q6_K", "tiles", "glu-tiles"), ("Q8_0", "tiles", "glu-tiles"),
             ("Q4_1", "tiles", "glu-tiles"), ("Q4_K", "tiles", "glu-tiles"), ("Q5_K", "rows", "glu-tiles"),
             ("Q4_0", "tiles", "glu-tiles"), ("Q5_0", "tiles", "glu-tiles"), ("Q5_1", "tiles", "glu-tiles"))


def _gemv_cols_runs(types) -> list[tuple]:
    """(wtype, layout, *run) for every run of _GC_RUNS over ``types`` (entries of _GC_TYPES)."""
    return [(wt, glu_layout if kind == "glu" else layout, *run) for wt, layout, glu_layout in types
            for kind in ("plain", "glu") for run in _GC_RUNS[kind]]


GEMV_COLS_CASES = _gemv_cols_runs(_GC_TYPES)
GEMV_COLS_CASES_SMALL = _gemv_cols_runs(_GC_TYPES[:4])


def gemv_cols_cases(rng, shapes) -> None:
    """``GemvOps.gemv_cols`` over ``shapes`` (entries of GEMV_COLS_CASES), each against the float64 oracle:
    y[c] = W x[c] (+ bias) (+ residual[c]), or silu(G x[c]) * (U x[c]), within 1e-6 of the size of what is
    summed (f16 output: plus its rounding); the padding past the rows keeps its bytes."""
    ops = LayerOps()
    bulk_ok = ops.device.target.compute_capability >= (9, 0)
    for wt, layout, cols, epi, xh, out_f16, cfg, ldx_pad, ldy_pad in shapes:
        glu = epi == "glu"
        in_dim, out_dim = 768, 19 if glu else 37  # (glu: 19 outputs of 38 weight rows)
        rows = 2 * out_dim if glu else out_dim
        ldx, ldy = in_dim + ldx_pad, out_dim + ldy_pad
        per = cols_per_launch(wt, glu)
        raw = random_weight(rng, wt, rows, in_dim)
        w = GpuWeight(data=raw, ggml_type=wt, shape=(rows, in_dim), layout=layout)
        x = ((rng.standard_normal((cols, ldx)) + 0.1) / (64 if out_f16 else 1)).astype(np.float16 if xh else np.float32)
        b = rng.standard_normal(out_dim).astype(np.float32)
        r = rng.standard_normal((cols, ldy)).astype(np.float32)
        y0 = r.copy() if epi == "in_place" else np.full((cols, ldy), np.nan, np.float16 if out_f16 else np.float32)
        launches = [(c0, min(per, cols - c0)) for c0 in range(0, cols, per)]
        configs = [dataclasses.replace(cfg, bulk=cfg.bulk and bulk_ok,
                                       tiles=1 if not glu and n > COLS_WIDE_TILES.get(wt, MAX_COLS) else cfg.tiles)
                   for _, n in launches]
        what = (f"gemv_cols {wt} {layout} {out_dim}x{in_dim} cols={cols} {epi} xh={xh} out_f16={out_f16} "
                f"launches {launches} {sorted(set(configs), key=str)}")
        with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer.from_numpy(b) as db, \
                cuda.GpuBuffer.from_numpy(r) as dr, cuda.GpuBuffer.from_numpy(y0) as dy:
            residual = dy if epi == "in_place" else dr if epi == "residual" else None
            for (c0, n), c in zip(launches, configs):
                ops.gemv_cols(w, (dx, c0 * ldx), (dy, c0 * ldy), n, ldx=ldx, ldy=ldy,
                              bias=db if epi == "bias" else None,
                              residual=None if residual is None else (residual, c0 * ldy), glu=glu, xh=xh,
                              out_f16=out_f16, config=c)
            got = dy.to_numpy((cols, ldy))
        w.free()
        assert np.array_equal(got[:, out_dim:].view(np.uint8), y0[:, out_dim:].view(np.uint8)), \
            f"{what}: wrote past the rows"
        ref, scale = _oracle(raw, wt, rows, in_dim, x, out_dim, glu, b if epi == "bias" else None,
                             None if residual is None else r[:, :out_dim])
        # (the bound of the columns kernel's tests, tests/layer_oracles.check_gemv_cols)
        tol = 1e-6 * scale + (2.0**-11 * np.abs(ref) + 2.0**-24 if out_f16 else 0.0)
        err = np.abs(got[:, :out_dim].astype(np.float64) - ref)
        if not (err <= tol).all():  # (NaN: an output never written)
            raise AssertionError(f"{what}: {np.sum(~(err <= tol))} of {err.size} wrong, worst "
                                 f"{np.nanmax(err / scale):.2e} of the scale (finite: {bool(np.isfinite(err).all())})")


# per-row device sampling: (vocab, row stride); the first is one past a block of 1024 threads' sweep
SAMPLE_SHAPES = [(1025, 1031), (300, 307)]
SAMPLE_SHAPES_SMALL = SAMPLE_SHAPES[1:]
TOP_P_BOUNDARY = 1e-5  # top-p cuts closer than this (relative mass) may go either way between f32 and f64 sums


def sample_cases(rng, shapes) -> None:
    """``SampleOps.sample_rows`` on B=3 rows (greedy with a tied maximum, temperature + top-k, top-p) of
    strided logits, against the NumPy mirror ``realizar.sampling.sample_rows``."""
    ops = LayerOps()
    for vocab, ld in shapes:
        x = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
        x[0, [vocab - 1, vocab // 2]] = x[0].max() + 1  # greedy ties: the lowest index
        x[1, rng.choice(vocab, vocab // 4, replace=False)] = -np.inf  # masked tokens
        x[1, 0] = 2.5
        specs = [RowSampling(), RowSampling(0.8, top_k=20, seed=2**63 + 5, step=9),
                 RowSampling(1.3, top_p=0.7, seed=11, step=2)]
        rows = np.full((3, ld), np.nan, np.float32)  # the padding past the vocabulary is never read
        rows[:, :vocab] = x
        with cuda.GpuBuffer.from_numpy(rows) as dl, cuda.GpuBuffer.from_numpy(pack_specs(specs)) as ds, \
                cuda.GpuBuffer(3, np.uint32) as out:
            out.poison()
            ops.sample_rows(dl, ds, out, 3, vocab, ld=ld)
            got = out.to_numpy().astype(np.int64)
        want = sample_rows(x, specs)
        for r, s in enumerate(specs):
            what = f"sample_rows vocab {vocab} ld {ld} row {r} {s}: token {got[r]}, the mirror {want[r]}"
            if got[r] == want[r]:
                continue
            if s.temperature == 0.0 or not top_p_margin(x[r], s) < TOP_P_BOUNDARY:
                raise AssertionError(what)
            # a top-p cut within rounding: the kernel's token must still be one the top-k cut keeps
            z = x[r] * (np.float32(1) / np.float32(s.temperature))
            if not (got[r] < vocab and z[got[r]] >= np.sort(z)[::-1][min(vocab, max(1, s.top_k or vocab)) - 1]):
                raise AssertionError(what + " (past the top-k cut)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="fewer weight types (racecheck is slow)")
    ap.add_argument("--gemm-q", action="store_true", help="only the gemm_q and sample_rows cases")
    ap.add_argument("--gemv-cols", action="store_true", help="only the gemv_cols cases")
    a = ap.parse_args()
    every = not (a.gemm_q or a.gemv_cols)
    if every:
        cases(cuda.module_cache(), np.random.default_rng(0), a.small)
        prefill_cases(np.random.default_rng(1), a.small)
    if every or a.gemm_q:
        gemm_q_cases(np.random.default_rng(2), GEMM_Q_CASES_SMALL if a.small else GEMM_Q_CASES)
        sample_cases(np.random.default_rng(3), SAMPLE_SHAPES_SMALL if a.small else SAMPLE_SHAPES)
    if every or a.gemv_cols:
        gemv_cols_cases(np.random.default_rng(4), GEMV_COLS_CASES_SMALL if a.small else GEMV_COLS_CASES)
    cuda.current_device().synchronize()
    print("ok layer sanitize cases")


if __name__ == "__main__":
    main()
