"""Sanitizer cases of the transformer-layer kernels: small launches of every kernel over awkward
shapes, each checked against its float64 oracle.

    compute-sanitizer --tool memcheck  python tools/sanitize_layers.py
    compute-sanitizer --tool racecheck python tools/sanitize_layers.py --small
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from ptx_gen.kernels.quant_layout import K_QUANTS, WEIGHT_TYPES
from realizar import cuda
from realizar.gpu.ops import GemvConfig, GpuWeight, LayerOps, MmaConfig, inv_freq_table
from realizar.models.random import dequant, random_weight


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="fewer weight types (racecheck is slow)")
    a = ap.parse_args()
    cases(cuda.module_cache(), np.random.default_rng(0), a.small)
    prefill_cases(np.random.default_rng(1), a.small)
    cuda.current_device().synchronize()
    print("ok layer sanitize cases")


if __name__ == "__main__":
    main()
