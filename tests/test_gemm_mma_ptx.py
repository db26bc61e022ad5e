"""CPU tests of the tensor-core prefill GEMM ``gemm_f16``: ptxas over the tilings (no spills), the
emulated kernel against a float64 oracle over hypothesis-drawn ragged shapes, every epilogue, NaN-poisoned
outputs, the host call's checks and tile policy; plus the emulator's f16 ``mma`` and sized ``cp.async``
themselves."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.builder import Module
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.kernels.gemm.gemm_mma import check_tiling
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.gemm import GemmConfig, gemm_config
from realizar.gpu.ops import LayerOps
from tests.layer_kernels_ptx_cases import _assemble_all
from tests.helpers import examples, tiered

TILINGS = [(128, 128, 2, 2, 3), (64, 128, 1, 4, 4), (64, 64, 2, 2, 4), (128, 256, 2, 4, 3), (32, 64, 1, 2, 2),
           (128, 64, 2, 2, 2), (32, 64, 1, 2, 6), (64, 64, 2, 2, 6)]


def _silu(g):
    return g / (1 + np.exp(-g))


@pytest.mark.parametrize("tiling", tiered(TILINGS, {0}))
@pytest.mark.parametrize("flags", [{}, {"bias": True, "residual": True}, {"glu": True, "out_f16": True}])
def test_gemm_assembles_without_spills(tiling, flags):
    bm, bn, wm, wn, stages = tiling
    _assemble_all("gemm_f16", bm=bm, bn=bn, warps_m=wm, warps_n=wn, stages=stages, **flags)


def test_bad_tilings_are_refused():
    for bad in [(48, 64, 1, 2, 2), (64, 64, 1, 1, 2), (64, 64, 8, 1, 2), (256, 256, 2, 2, 3), (64, 64, 2, 2, 7)]:
        with pytest.raises(ValueError):
            check_tiling(*bad)
    with pytest.raises(ValueError, match="bias"):
        catalog.emit("gemm_f16", glu=True, bias=True)
    with pytest.raises(ShapeError):
        GemmConfig(48, 64)


def _run(m, n, k, tiling, rng, *, bias=False, residual=None, out_f16=False, glu=False, lda=None, ldy=None):
    bm, bn, wm, wn, stages = tiling
    kern = catalog.emit("gemm_f16", bm=bm, bn=bn, warps_m=wm, warps_n=wn, stages=stages, bias=bias,
                        residual=residual is not None, out_f16=out_f16, glu=glu)
    lda = lda or k
    cols = n // 2 if glu else n
    ldy = ldy or cols
    x = (rng.standard_normal((m, lda)) + 0.1).astype(np.float16)
    w = (rng.standard_normal((n, k)) * 0.5 + 0.05).astype(np.float16)
    b = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal((m, ldy)).astype(np.float32)
    ytype = np.float16 if out_f16 else np.float32
    mem = Memory()
    y = mem.alloc_array(r.copy() if residual == "in_place" else np.full((m, ldy), np.nan, ytype))
    params = dict(x=mem.alloc_array(x), w=mem.alloc_array(w), y=y, m=m, n=n, k=k, lda=lda, ldy=ldy)
    if bias:
        params["bias"] = mem.alloc_array(b)
    if residual is not None:
        params["residual"] = y if residual == "in_place" else mem.alloc_array(r)
    simt_run(kern.ptx, grid=(-(-m // bm), -(-n // bn)), block=(kern.meta["block"],), params=params, memory=mem,
             shared_bytes=kern.launch.dyn_smem)
    out = mem.read(y, ytype, m * ldy).reshape(m, ldy).astype(np.float64)
    xs, ws = x[:, :k].astype(np.float64), w.astype(np.float64)
    full, scale = xs @ ws.T, np.abs(xs) @ np.abs(ws).T
    if glu:
        g, u = full[:, 0::2], full[:, 1::2]
        ref, scale = _silu(g) * u, (np.abs(g) + scale[:, 0::2]) * (np.abs(u) + scale[:, 1::2])
    else:
        ref = full + (b if bias else 0) + (r if residual is not None else 0)
        scale = scale + (np.abs(b) if bias else 0) + (np.abs(r) if residual is not None else 0)
    body = out[:, :cols]
    assert np.isfinite(body).all(), "unwritten (NaN-poisoned) outputs"
    if ldy > cols and residual != "in_place":
        assert np.isnan(out[:, cols:]).all(), "wrote past the output columns"
    tol = 2.0 ** -10 if out_f16 else 1e-6  # f16 output rounding; f32 accumulation order
    err = np.abs(body - ref) / (scale + 1e-30)
    assert err.max() < tol, f"max relative error {err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}"


@settings(max_examples=examples(12), deadline=None)
@given(m=st.sampled_from([1, 2, 7, 63, 64, 65, 130]), n=st.integers(1, 40).map(lambda v: 4 * v),
       k=st.integers(1, 20).map(lambda v: 8 * v), tiling=st.sampled_from(TILINGS[1:]),
       epilogue=st.sampled_from(["plain", "bias", "residual", "in_place", "f16", "bias_f16"]),
       seed=st.integers(0, 2**31))
def test_gemm_matches_oracle(m, n, k, tiling, epilogue, seed):
    _run(m, n, k, tiling, np.random.default_rng(seed), bias="bias" in epilogue,
         residual={"residual": "buffer", "in_place": "in_place"}.get(epilogue), out_f16="f16" in epilogue)


@settings(max_examples=examples(6), deadline=None)
@given(m=st.sampled_from([1, 7, 65]), n=st.integers(1, 48).map(lambda v: 2 * v), k=st.sampled_from([64, 136, 256]),
       tiling=st.sampled_from(TILINGS[1:]), out_f16=st.booleans(), seed=st.integers(0, 2**31))
def test_gemm_swiglu_matches_oracle(m, n, k, tiling, out_f16, seed):
    _run(m, n, k, tiling, np.random.default_rng(seed), glu=True, out_f16=out_f16)


def test_gemm_big_tile_and_strides():
    rng = np.random.default_rng(3)
    _run(300, 200, 200, TILINGS[0], rng, residual="buffer")
    _run(70, 64, 64, TILINGS[2], rng, lda=80, ldy=72)  # strided X rows, Y wider than n


def test_host_gemm_on_the_emulated_device():
    dev = cuda.EmulatedDevice()
    ops = LayerOps(dev)
    rng = np.random.default_rng(5)
    m, n, k = 9, 48, 40
    x = rng.standard_normal((m, k)).astype(np.float16)
    w = rng.standard_normal((n, k)).astype(np.float16)
    xb, wb = ops.to_device(x), ops.to_device(w)
    y = ops.to_device(np.full(m * n, np.nan, np.float32))
    ops.gemm_f16(xb, wb, y, m, n, k)
    got = y.copy_to_host(np.empty(m * n, np.float32)).reshape(m, n)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match="multiples of 8"):
        ops.gemm_f16(xb, wb, y, m, n, 36)
    with pytest.raises(ShapeError, match="needs"):
        ops.gemm_f16(xb, wb, y, m + 1, n, k)
    with pytest.raises(ShapeError, match="float16"):
        ops.gemm_f16(y, wb, y, m, n, k)
    with pytest.raises(ShapeError, match="even n"):
        ops.gemm_f16(xb, wb, y, m, n - 1, k, glu=True)


def test_policy_fills_the_gpu():
    assert gemm_config(2048, 4096) == GemmConfig(128, 128, 2, 2, 3)
    small = gemm_config(64, 576)
    assert small.bm * small.bn <= 64 * 64
    assert gemm_config(512, 4096, max_smem=99 * 1024).smem <= 99 * 1024
    # a decode batch of 64 rows: the 8B O / down weights (4096 rows) get 32-token tiles, 128 CTAs instead
    # of 64; the FFN's 28672 rows fill the SMs with 64 x 128 tiles
    assert gemm_config(64, 4096) == GemmConfig(32, 64, 1, 2, 6)
    assert gemm_config(64, 28672) == GemmConfig(64, 128, 1, 4, 4)
    assert gemm_config(65, 4096) == GemmConfig(64, 64, 2, 2, 4)


def _tiny_kernel(body) -> str:
    m = Module("sm_90")
    k = m.kernel("t", [("src", "u64"), ("dst", "u64"), ("n", "u32")], max_threads=32)
    body(k)
    k.ret()
    return m.emit()


def test_emulated_mma_f16_matches_numpy():
    def body(k):
        lane = k.tid()
        src, dst = k.global_ptr("src"), k.global_ptr("dst")
        regs = [k.load("global", "b32", k.add(src, k.mul_wide(k.add(lane, 32 * i), 4))) for i in range(6)]
        d = k.mma_f16(regs[:4], regs[4:6], [0.5, 0.5, 0.5, 0.5])
        for i, v in enumerate(d):
            k.store("global", "f32", k.add(dst, k.mul_wide(k.add(lane, 32 * i), 4)), v)
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((16, 16)).astype(np.float16), rng.standard_normal((16, 8)).astype(np.float16)
    g, t = np.arange(32) // 4, np.arange(32) % 4
    pair = lambda lo, hi: np.stack([lo, hi], 1).astype(np.float16).view(np.uint32)[:, 0]  # noqa: E731
    frags = [pair(A[g, 2 * t], A[g, 2 * t + 1]), pair(A[g + 8, 2 * t], A[g + 8, 2 * t + 1]),
             pair(A[g, 8 + 2 * t], A[g, 9 + 2 * t]), pair(A[g + 8, 8 + 2 * t], A[g + 8, 9 + 2 * t]),
             pair(B[2 * t, g], B[2 * t + 1, g]), pair(B[8 + 2 * t, g], B[9 + 2 * t, g])]
    mem = Memory()
    src, dst = mem.alloc_array(np.concatenate(frags)), mem.alloc(4 * 128)
    simt_run(_tiny_kernel(body), grid=(1,), block=(32,), params=dict(src=src, dst=dst, n=0), memory=mem)
    got = mem.read(dst, np.float32, 128).reshape(4, 32)
    D = A.astype(np.float64) @ B.astype(np.float64) + 0.5
    want = np.stack([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_emulated_sized_cp_async_zero_fills():
    def body(k):
        lane = k.tid()
        smem = k.shared_array("t_buf", "u8", 32 * 16)
        off = k.mul(lane, 16)
        size = k.selp(16, 0, k.setp("lt", lane, k.param("n")), "u32")
        k.cp_async(k.add(smem, off), k.add(k.global_ptr("src"), k.mul_wide(k.min(lane, 3), 16)), src_size=size)
        k.cp_async_wait_all()
        words = k.load("shared", "u32", k.add(smem, off), vec=4)
        k.store("global", "u32", k.add(k.global_ptr("dst"), k.mul_wide(off, 1)), list(words))
    mem = Memory()
    data = np.arange(1, 17, dtype=np.uint32)
    src, dst = mem.alloc_array(data), mem.alloc(32 * 16)
    simt_run(_tiny_kernel(body), grid=(1,), block=(32,), params=dict(src=src, dst=dst, n=4), memory=mem)
    got = mem.read(dst, np.uint32, 128).reshape(32, 4)
    np.testing.assert_array_equal(got[:4].reshape(-1), data)
    assert not got[4:].any(), "bytes past the source size must be zero"
