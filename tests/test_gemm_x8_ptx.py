"""CPU tests of the int8 batch GEMM: ``quantize_x8`` (X to the x8 format) and ``gemm_x8`` (Y = X W^T on the
tile-major quantized weights) in the PTX emulator, and their host ops ``GemmX8Ops`` on the emulated device.

Oracles: the format's NumPy definition (``quantize_x8_ref``: codes and records compared byte for byte) and,
for the GEMM, float64 over the exactly dequantized weights (GGUF's reference dequantization) and the
dequantized x8 X (``d q``): the kernel's integer sums are exact, so only f32 rounding of the scaled sums
remains. Hypothesis draws types, token counts, shapes, CTA shapes and epilogues; outputs are NaN-poisoned
and every element is checked, nothing past the output written. ptxas: no spills at the policy's shapes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.kernels.gemm.gemm_x8 import X8_TYPES, check_shape, smem_bytes
from ptx_gen.kernels.gemm.x8 import RECORD, dequantize_x8, quantize_x8_ref, records
from ptx_gen.kernels.gemv.gemv_mma_layout import tile_major
from ptx_gen.ptxas import assemble
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.gemm_x8 import X8Config, x8_buffers, x8_config
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.helpers import examples, tiered
from tests.layer_oracles import dequant, random_weight

TARGETS = ("sm_80", "sm_89", "sm_90")
CONFIGS = [X8Config(1, 1, 1, 2), X8Config(1, 1, 2, 3), X8Config(2, 1, 1, 2), X8Config(1, 2, 2, 2),
           X8Config(2, 2, 1, 4)]


def _silu(g):
    return g / (1 + np.exp(-g))


def _x(rng, m, k, zero_unit=False):
    x = rng.standard_normal((m, k)) * rng.uniform(0.1, 4.0, size=(m, 1)) + 0.1
    if zero_unit and k >= 256:
        x[0, :256] = 0.0  # a unit of zeros: d = 0, codes 0
    return x


# ---------------------------------------------------------------------------------------------
# quantize_x8


def _quantize_emulated(x: np.ndarray, xh: bool, lda: int, ldq: int):
    m, k = x.shape
    units = k // 256
    kern = catalog.emit("quantize_x8", in_dim=k, xh=xh)
    dtype = np.float16 if xh else np.float32
    xx = np.full((m, lda), np.nan, dtype)
    xx[:, :k] = x
    mem = Memory()
    q = mem.alloc_array(np.full(m * ldq, 0xA5, np.uint8))
    s = mem.alloc_array(np.full(m * units * RECORD, 0xA5, np.uint8))
    simt_run(kern.ptx, grid=(-(-units // kern.meta["units_per_cta"]), m), block=(kern.meta["block"],),
             params=dict(x=mem.alloc_array(xx), q=q, s=s, lda=lda, ldq=ldq), memory=mem)
    return (mem.read(q, np.uint8, m * ldq).reshape(m, ldq), mem.read(s, np.uint8, m * units * RECORD).reshape(m, units, RECORD))


@settings(max_examples=examples(20), deadline=None)
@given(m=st.integers(1, 5), units=st.integers(1, 10), xh=st.booleans(), pad=st.sampled_from([0, 8, 24]),
       seed=st.integers(0, 2**32 - 1))
def test_quantize_x8_matches_definition(m, units, xh, pad, seed):
    rng = np.random.default_rng(seed)
    k = 256 * units
    x = _x(rng, m, k, zero_unit=True).astype(np.float16 if xh else np.float32)
    q, s = _quantize_emulated(x, xh, k + pad, k + 2 * pad)
    codes, d, sums = quantize_x8_ref(x)
    assert (q[:, :k].view(np.int8) == codes).all(), f"codes differ at {np.argwhere(q[:, :k].view(np.int8) != codes)[:4]}"
    assert (q[:, k:] == 0xA5).all(), "wrote past a row's codes"
    rec = records(d, sums)
    assert (s[..., :20] == rec[..., :20]).all(), "records differ"
    assert (s[..., 20:] == 0xA5).all(), "wrote the records' padding"
    assert np.abs(codes.astype(np.int32)).max() <= 127
    assert (d[0, 0] == 0) and (codes[0, :256] == 0).all()


def test_quantize_x8_definition():
    """The format itself: d q reproduces X within half a code step, sums and digits as documented."""
    rng = np.random.default_rng(1)
    x = _x(rng, 3, 512).astype(np.float32)
    codes, d, sums = quantize_x8_ref(x)
    back = dequantize_x8(codes, d)
    step = np.repeat(d.astype(np.float64), 256, axis=1)
    assert (np.abs(back - x) <= 0.5 * step * (1 + 1e-6)).all()
    assert (sums == codes.astype(np.int32).reshape(3, 2, 8, 32).sum(-1)).all()
    rec = records(d, sums)
    lo, hi = rec[..., 0:8].view(np.int8).astype(np.int32), rec[..., 8:16].view(np.int8).astype(np.int32)
    assert (256 * hi + lo == sums).all()


# ---------------------------------------------------------------------------------------------
# gemm_x8 in the emulator


def _oracle(raw, wtype, out_dim, in_dim, xh, glu, bias, res):
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    full, scale = xh @ w.T, np.abs(xh) @ np.abs(w).T
    if glu:
        ffn = out_dim // 2
        g, u = full[:, :ffn], full[:, ffn:]
        return _silu(g) * u, (np.abs(g) + scale[:, :ffn]) * (np.abs(u) + scale[:, ffn:])
    ref = full + (bias if bias is not None else 0) + (res if res is not None else 0)
    return ref, scale + (np.abs(bias) if bias is not None else 0) + (np.abs(res) if res is not None else 0)


def _run(wtype, out_dim, in_dim, m, rng, cfg: X8Config, *, glu=False, bias=False, residual=None, out_f16=False,
         ldq=None, ldy_pad=0):
    raw = random_weight(rng, wtype, out_dim, in_dim)
    data = tile_major(raw, wtype, out_dim, in_dim, glu=glu)
    data = np.concatenate([data, np.zeros(-data.size % 16, np.uint8)])
    x = _x(rng, m, in_dim) / (64 if out_f16 else 1)
    codes, d, sums = quantize_x8_ref(x)
    ldq = ldq or in_dim
    q = np.zeros((m, ldq), np.int8)
    q[:, :in_dim] = codes
    kern = catalog.emit("gemm_x8", wtype=wtype, in_dim=in_dim, layout="glu-tiles" if glu else "tiles", wn=cfg.wn,
                        wm=cfg.wm, tn=cfg.tn, stages=cfg.stages, bias=bias, residual=residual is not None,
                        out_f16=out_f16, glu=glu)
    cols = out_dim // 2 if glu else out_dim
    ldy = cols + ldy_pad
    ytype = np.float16 if out_f16 else np.float32
    b = rng.standard_normal(cols).astype(np.float32)
    r = rng.standard_normal((m, ldy)).astype(np.float32)
    pad = 64
    y0 = np.full(m * ldy + pad, np.nan, ytype)
    if residual == "in_place":
        y0[: m * ldy] = r.reshape(-1)
    mem = Memory()
    y = mem.alloc_array(y0)
    params = dict(w=mem.alloc_array(data), xq=mem.alloc_array(q.view(np.uint8)), xs=mem.alloc_array(records(d, sums)),
                  y=y, m=m, n=out_dim, ldq=ldq, ldy=ldy)
    if bias:
        params["bias"] = mem.alloc_array(b)
    if residual is not None:
        params["residual"] = y if residual == "in_place" else mem.alloc_array(r)
    grid = (-(-m // kern.meta["tokens_per_cta"]), -(-cols // kern.meta["rows_per_cta"]))
    simt_run(kern.ptx, grid=grid, block=(kern.meta["block"],), params=params, memory=mem,
             shared_bytes=kern.launch.dyn_smem)
    flat = mem.read(y, ytype, m * ldy + pad).astype(np.float64)
    assert np.isnan(flat[m * ldy:]).all(), "wrote past the output"
    out = flat[: m * ldy].reshape(m, ldy)
    ref, scale = _oracle(raw, wtype, out_dim, in_dim, dequantize_x8(codes, d), glu, b if bias else None,
                         r[:, :cols] if residual is not None else None)
    body = out[:, :cols]
    assert np.isfinite(body).all(), f"unwritten (NaN-poisoned) outputs at {np.argwhere(~np.isfinite(body))[:4].tolist()}"
    if ldy > cols and residual != "in_place":
        assert np.isnan(out[:, cols:]).all(), "wrote past the output columns"
    err = np.abs(body - ref) / (scale + 1e-30)
    # exact integer sums; f32 scale products and sums across units (f16 output: one more rounding)
    tol = 2.0 ** -10 if out_f16 else 2.0 ** -18
    assert err.max() < tol, (f"{wtype} {out_dim}x{in_dim} m={m} {cfg}: max relative error {err.max():.2e} at "
                             f"{np.unravel_index(err.argmax(), err.shape)}")


@settings(max_examples=examples(30), deadline=None)
@given(data=st.data(), wtype=st.sampled_from(X8_TYPES), cfg=st.sampled_from(CONFIGS), seed=st.integers(0, 2**32 - 1))
def test_gemm_x8_matches_oracle(data, wtype, cfg, seed):
    glu = data.draw(st.booleans())
    m = data.draw(st.integers(1, 2 * cfg.tokens + 3))
    in_dim = 256 * data.draw(st.integers(1, 3))
    out_dim = (2 if glu else 1) * data.draw(st.integers(1, 80))
    epi = "plain" if glu else data.draw(st.sampled_from(["plain", "bias", "residual", "in_place", "f16", "bias_res"]))
    _run(wtype, out_dim, in_dim, m, np.random.default_rng(seed), cfg, glu=glu, bias="bias" in epi,
         residual={"residual": "buffer", "in_place": "in_place", "bias_res": "buffer"}.get(epi),
         out_f16="f16" in epi or (glu and data.draw(st.booleans())), ldq=in_dim + 16 * data.draw(st.integers(0, 2)),
         ldy_pad=data.draw(st.sampled_from([0, 5])))


@pytest.mark.parametrize("wtype", X8_TYPES)
def test_gemm_x8_main_shapes(wtype):
    """Ragged M and N in multi-warp CTAs, several units, every epilogue kind once."""
    rng = np.random.default_rng(7)
    _run(wtype, 100, 768, 37, rng, X8Config(2, 2, 2, 3), bias=True, ldy_pad=3)
    _run(wtype, 66, 512, 21, rng, X8Config(2, 1, 2, 2), glu=True, out_f16=True)
    _run(wtype, 48, 256, 9, rng, X8Config(1, 2, 1, 2), residual="in_place")


# ---------------------------------------------------------------------------------------------
# ptxas


@pytest.mark.parametrize("wtype,in_dim,glu", tiered(
    [(wt, d, glu) for wt in X8_TYPES for d, glu in ((4096, False), (4096, True), (14336, False))], {0, 9}, unpack=True))
def test_no_spills_at_real_shapes(wtype, in_dim, glu):
    """The policy's CTA shapes for every token count assemble without spills on sm_80/89/90."""
    for m in (33, 64, 128, 2048):
        for tgt in TARGETS:
            smem = 99 * 1024 if tgt == "sm_89" else 227 * 1024
            cfg = x8_config(wtype, m, smem)
            k = catalog.emit("gemm_x8", target=tgt, wtype=wtype, in_dim=in_dim, layout="glu-tiles" if glu else "tiles",
                             wn=cfg.wn, wm=cfg.wm, tn=cfg.tn, stages=cfg.stages, glu=glu, out_f16=glu,
                             residual=not glu)
            (rep,) = assemble(k.ptx, tgt)
            assert not rep.spills, f"gemm_x8 {wtype} {in_dim} m={m} {cfg} spills on {tgt}: {rep.log}"


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="takes"):
        check_shape("F16", 4096, "tiles", 1, 1, 1, 2, False)
    with pytest.raises(ValueError, match="multiple of 256"):
        check_shape("Q4_K", 4096 + 32, "tiles", 1, 1, 1, 2, False)
    with pytest.raises(ValueError, match="glu"):
        check_shape("Q4_K", 4096, "tiles", 1, 1, 1, 2, True)
    with pytest.raises(ValueError, match="shared memory"):
        check_shape("Q8_0", 4096, "tiles", 8, 2, 8, 4, False)
    with pytest.raises(ValueError, match="bias"):
        catalog.emit("gemm_x8", layout="glu-tiles", glu=True, bias=True)
    assert smem_bytes("Q4_K", 4, 2, 4, 3) <= 227 * 1024


# ---------------------------------------------------------------------------------------------
# the host ops on the emulated device


@pytest.fixture(scope="module")
def emu():
    dev = cuda.EmulatedDevice(sm_count=4)
    return LayerOps(dev), cuda.Stream(dev)


@pytest.mark.parametrize("wtype,glu", [("Q4_K", False), ("Q8_0", True)])
def test_host_ops_quantize_then_multiply(emu, wtype, glu):
    ops, stream = emu
    rng = np.random.default_rng(11)
    n, k, m = 64, 512, 37
    raw = random_weight(rng, wtype, n, k)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(n, k), layout="glu-tiles" if glu else "tiles", device=ops.device)
    x = _x(rng, m, k).astype(np.float16)
    xb = ops.to_device(x)
    q, s = x8_buffers(ops, m, k)
    cols = n // 2 if glu else n
    y = ops.to_device(np.full(m * cols, np.nan, np.float32))
    ops.quantize_x8(xb, q, s, m, k, stream=stream)
    ops.gemm_x8(q, s, w, y, m, glu=glu, config=X8Config(2, 1, 2, 2), stream=stream)
    stream.synchronize()
    got = y.copy_to_host(np.empty(m * cols, np.float32)).reshape(m, cols).astype(np.float64)
    codes, d, _ = quantize_x8_ref(x)
    ref, scale = _oracle(raw, wtype, n, k, dequantize_x8(codes, d), glu, None, None)
    assert np.isfinite(got).all()
    assert (np.abs(got - ref) / scale).max() < 2.0 ** -18


def test_host_ops_refuse_bad_calls(emu):
    ops, stream = emu
    rng = np.random.default_rng(2)
    w_rows = GpuWeight(data=random_weight(rng, "Q4_K", 32, 256), ggml_type="Q4_K", shape=(32, 256), device=ops.device)
    w_f16 = GpuWeight(data=random_weight(rng, "F16", 32, 256), ggml_type="F16", shape=(32, 256), device=ops.device)
    w = GpuWeight(data=random_weight(rng, "Q4_K", 32, 256), ggml_type="Q4_K", shape=(32, 256), layout="tiles",
                  device=ops.device)
    q, s = x8_buffers(ops, 4, 256)
    y = ops.buffer(4 * 32)
    for bad, match in ((w_rows, "tile-major"), (w_f16, "tile-major")):
        with pytest.raises(ShapeError, match=match):
            ops.gemm_x8(q, s, bad, y, 4, stream=stream)
    with pytest.raises(ShapeError, match="glu"):
        ops.gemm_x8(q, s, w, y, 4, glu=True, stream=stream)
    with pytest.raises(ShapeError, match="ldy"):
        ops.gemm_x8(q, s, w, y, 4, ldy=16, stream=stream)
    with pytest.raises(ShapeError):
        ops.gemm_x8(q, s, w, y, 8, stream=stream)  # the codes hold 4 rows
    with pytest.raises(ShapeError, match="units of 256"):
        x8_buffers(ops, 2, 300)
    with pytest.raises(ShapeError, match="lda"):
        ops.quantize_x8(ops.buffer(4 * 256, np.float16), q, s, 4, 256, lda=100, stream=stream)
