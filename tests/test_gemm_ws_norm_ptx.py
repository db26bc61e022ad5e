"""CPU tests of the RMSNorm fused into ``gemm_ws`` (sm_90a), in the PTX emulator against float64 oracles, outputs
NaN-poisoned:

* the output side (``norm_out``, a residual GEMM: the O and down projections): besides Y = X W^T + residual, the next
  norm's f16 input ``hout = Y gnorm``, each token's sum of squares over each output tile at ``ssq[t stride + tile]``
  (nothing past the tiles written) and, from the last tile's CTA, each token's factor ``rnorm = 1 / sqrt(mean(Y^2) +
  eps)``, the counters left at zero; whole tiles (the 16-byte path) and a ragged last tile (one output at a time),
  K split over two CTAs or not;
* the input side (``norm_in``, the next GEMM: QKV, gate/up): its products times ``rnorm[t]`` before the bias or the
  SwiGLU;
* the two chained as the decoder runs them: ``Y_next = rmsnorm(Y) W2^T`` within f16 roundings of the oracle.

The same kernels run on the GPU in tests/gpu/test_norm_fusion.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.emulator import tensormap
from ptx_gen.kernels.gemm import gemm_ws as ws
from ptx_gen.kernels.gemv.gemv_mma_layout import tile_major
from tests.helpers import examples
from tests.layer_oracles import dequant, random_weight
from tests.test_gemm_q_ptx import _silu

EPS = 1e-5


def _launch(mem, shape: dict, wtype: str, layout: str, out_dim: int, in_dim: int, m: int, x, rng, *, glu=False,
            bias=None, residual=None, out_f16=False, extra: dict | None = None):
    """Run gemm_ws over a random weight; returns (the dequantized weight f64, Y's address, the kernel)."""
    raw = random_weight(rng, wtype, out_dim, in_dim)
    data = raw if layout == "rows" else tile_major(raw, wtype, out_dim, in_dim, glu=layout == "glu-tiles")
    data = np.concatenate([data, np.zeros(-data.size % 16, np.uint8)])
    kern = catalog.emit("gemm_ws", target="sm_90", wtype=wtype, in_dim=in_dim, layout=layout, glu=glu,
                        bias=bias is not None, residual=residual is not None, out_f16=out_f16, **shape)
    cols = out_dim // 2 if glu else out_dim
    y = mem.alloc_array(np.full(m * cols, np.nan, np.float16 if out_f16 else np.float32))
    params = dict(w=mem.alloc_array(data), x=mem.alloc_array(x), y=y, m=m, n=out_dim, lda=in_dim, ldy=cols,
                  **(extra or {}))
    if shape.get("xtma"):
        params["xmap"] = tensormap.encode(tensormap.TensorMap2d(params["x"], in_dim, m, 2 * in_dim, 64, shape["mt"], 2,
                                                                128))
    if bias is not None:
        params["bias"] = mem.alloc_array(bias)
    if residual is not None:
        params["residual"] = mem.alloc_array(residual)
    grid = (-(-cols // kern.meta["rows_per_cta"]), -(-m // kern.meta["mt"]))
    if shape.get("kparts", 1) > 1:
        tiles = grid[0] * grid[1]
        params["part"] = mem.alloc_array(np.full(tiles * kern.meta["part_floats"], np.nan, np.float32))
        params["counters"] = mem.alloc_array(np.zeros(tiles, np.uint32))
        grid = (*grid, shape["kparts"])
    simt_run(kern.ptx, grid=grid, block=(kern.meta["block"],), params=params, memory=mem,
             shared_bytes=kern.launch.dyn_smem, max_steps=20_000_000)
    return dequant(raw, wtype, out_dim, in_dim).astype(np.float64), y, kern


def _x(rng, m: int, k: int) -> np.ndarray:
    return (rng.standard_normal((m, k)) + 0.1).astype(np.float16)


def run_norm_out(wtype, layout, out_dim, in_dim, m, rng, shape):
    """The producer: returns (Y f64, hout f64, ssq parts f64 [m, nparts], cols a tile) after checking each against the
    oracle and the unwritten parts untouched."""
    mem = Memory()
    x, res = _x(rng, m, in_dim), rng.standard_normal((m, out_dim)).astype(np.float32)
    g = (1 + 0.5 * rng.standard_normal(out_dim)).astype(np.float32)
    cols = 64 * shape.get("rgroups", 1)
    nparts = -(-out_dim // cols)
    ssld = 1 << max(2, (nparts - 1).bit_length())
    hout = mem.alloc_array(np.full(m * out_dim, np.nan, np.float16))
    ssq = mem.alloc_array(np.full(m * ssld, np.nan, np.float32))
    rnorm = mem.alloc_array(np.full(m, np.nan, np.float32))
    tiles = -(-m // shape["mt"])
    ncount = mem.alloc_array(np.zeros(tiles, np.uint32))
    w, y, _ = _launch(mem, dict(shape, norm_out=ssld), wtype, layout, out_dim, in_dim, m, x, rng, residual=res,
                      extra=dict(gnorm=mem.alloc_array(g), hout=hout, ssq=ssq, rnorm=rnorm, ncount=ncount, eps=EPS))
    full = x.astype(np.float64) @ w.T
    ref = full + res
    scale = np.abs(x.astype(np.float64)) @ np.abs(w).T + np.abs(res)
    got = mem.read(y, np.float32, m * out_dim).astype(np.float64).reshape(m, out_dim)
    assert np.isfinite(got).all(), "unwritten outputs"
    assert (np.abs(got - ref) / scale).max() < 2.0 ** -10
    h = mem.read(hout, np.float16, m * out_dim).astype(np.float64).reshape(m, out_dim)
    assert np.isfinite(h).all(), "unwritten norm inputs"
    # hout = f16(Y g) of the kernel's own Y: one f16 rounding (2**-11) and the f32 product
    assert np.allclose(h, got * g, rtol=2.0 ** -10, atol=2.0 ** -24), np.abs(h - got * g).max()
    parts = mem.read(ssq, np.float32, m * ssld).astype(np.float64).reshape(m, ssld)
    assert np.isnan(parts[:, nparts:]).all(), "wrote ssq parts past the tiles"
    want = np.stack([(got[:, p * cols:(p + 1) * cols] ** 2).sum(1) for p in range(nparts)], 1)
    assert np.allclose(parts[:, :nparts], want, rtol=1e-5, atol=0)
    r = mem.read(rnorm, np.float32, m).astype(np.float64)
    assert np.allclose(r, 1 / np.sqrt((got ** 2).mean(1) + EPS), rtol=1e-5), "the tokens' factors"
    assert not mem.read(ncount, np.uint32, tiles).any(), "counters not left at zero"
    return got, h, r, cols


def run_norm_in(wtype, layout, out_dim, in_dim, m, rng, shape, *, inv, x, glu=False, bias=False, out_f16=False):
    """The consumer over the tokens' factors ``inv`` [m] and f16 ``x``: checks every output against the oracle; returns
    the outputs (f64)."""
    mem = Memory()
    b = rng.standard_normal(out_dim).astype(np.float32) if bias else None
    w, y, _ = _launch(mem, shape, wtype, layout, out_dim, in_dim, m, x, rng, glu=glu, bias=b, out_f16=out_f16,
                      extra=dict(rnorm=mem.alloc_array(inv.astype(np.float32))))
    inv = inv.astype(np.float32).astype(np.float64)
    xs = x.astype(np.float64)
    full, scale = (xs @ w.T) * inv[:, None], (np.abs(xs) @ np.abs(w).T) * inv[:, None]
    cols = out_dim // 2 if glu else out_dim
    if glu:
        gt, up = full[:, :cols], full[:, cols:]
        ref = _silu(gt) * up
        scale = (np.abs(gt) + scale[:, :cols]) * (np.abs(up) + scale[:, cols:])
    else:
        ref = full + (b if bias else 0)
        scale = scale + (np.abs(b) if bias else 0)
    got = mem.read(y, np.float16 if out_f16 else np.float32, m * cols).astype(np.float64).reshape(m, cols)
    assert np.isfinite(got).all(), f"unwritten outputs at {np.argwhere(~np.isfinite(got))[:4].tolist()}"
    err = np.abs(got - ref) / (scale + 1e-30)
    assert err.max() < (2.0 ** -9 if out_f16 else 2.0 ** -10), err.max()
    return got


@settings(max_examples=examples(6), deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_norm_out_matches_oracle(data, seed):
    wtype, layout = data.draw(st.sampled_from([("Q4_K", "tiles"), ("Q6_K", "rows"), ("Q8_0", "tiles")]))
    rgroups = data.draw(st.sampled_from([1, 2]))
    mt = data.draw(st.sampled_from([64, 128]))
    tiles = data.draw(st.integers(1, 2))
    ragged = data.draw(st.sampled_from([0, 4, 20]))  # (a last tile of whole quads short of the tile, or none)
    out_dim = 64 * rgroups * tiles + ragged
    m = data.draw(st.integers(1, mt + 5))
    shape = dict(mt=mt, rgroups=rgroups, stages=data.draw(st.sampled_from([2, 3])), xtma=data.draw(st.booleans()),
                 kparts=data.draw(st.sampled_from([1, 2])))
    try:
        ws.check_shape(wtype, 512, layout, mt, rgroups, shape["stages"], 2, shape["kparts"], norm_out=8,
                       residual=True)
    except ValueError:
        assume(False)
    run_norm_out(wtype, layout, out_dim, 512, m, np.random.default_rng(seed), shape)


@settings(max_examples=examples(6), deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_norm_in_matches_oracle(data, seed):
    rng = np.random.default_rng(seed)
    glu = data.draw(st.booleans())
    wtype, layout = ("Q4_K", "glu-tiles") if glu else data.draw(st.sampled_from([("Q4_K", "rows"), ("Q5_K", "tiles")]))
    mt = data.draw(st.sampled_from([64, 128]))
    m = data.draw(st.integers(1, mt + 5))
    out_dim = (2 if glu else 1) * data.draw(st.integers(8, 72))
    inv = 10 ** rng.uniform(-0.6, 0.6, m)  # (factors from 0.25 to 4: one left out or applied twice is off by far more
    # than the tolerance)
    shape = dict(mt=mt, rgroups=data.draw(st.sampled_from([1, 2])), stages=3, xtma=True, norm_in=True,
                 psplit=data.draw(st.sampled_from([1, 2])))
    try:
        ws.check_shape(wtype, 256, layout, mt, shape["rgroups"], 3, 2, psplit=shape["psplit"], norm_in=True)
    except ValueError:
        assume(False)
    x = _x(rng, m, 256) / (64 if glu else 1)  # (the f16 outputs' range, as tests/test_gemm_q_ptx.py draws them)
    run_norm_in(wtype, layout, out_dim, 256, m, rng, shape, inv=inv, x=x, glu=glu,
                bias=not glu and data.draw(st.booleans()), out_f16=glu)


def test_norm_chain_is_the_rmsnorm_then_the_gemm():
    """A residual GEMM's norm_out feeding the next GEMM's norm_in, as the decoder chains the O projection and gate/up:
    the producer's factors (checked against its own Y) and f16 input scale the consumer's products (checked against
    rmsnorm's factor times the f64 product of that input)."""
    rng = np.random.default_rng(5)
    m, hidden = 70, 512
    y, h, r, cols = run_norm_out("Q4_K", "tiles", hidden, 256, m, rng, dict(mt=64, stages=3, xtma=True, kparts=1))
    out = run_norm_in("Q4_K", "rows", 48, hidden, m, rng, dict(mt=128, stages=3, xtma=True, norm_in=True), inv=r,
                      x=h.astype(np.float16))
    assert out.shape == (m, 48) and np.isfinite(out).all()


def test_norm_refusals():
    with pytest.raises(ValueError, match="norm_out"):
        ws.check_shape("Q4_K", 512, "tiles", 64, 1, 3, 2, norm_out=True, residual=False)
    with pytest.raises(ValueError, match="norm_out"):
        ws.check_shape("Q4_K", 512, "glu-tiles", 64, 1, 3, 2, norm_out=True, residual=True, glu=True)
    with pytest.raises(ValueError, match="norm_out"):
        ws.check_shape("Q4_K", 512, "tiles", 64, 1, 3, 2, norm_out=12, residual=True)
    with pytest.raises(ValueError, match="norm_out"):
        ws.check_shape("Q4_K", 512, "tiles", 64, 1, 3, 2, norm_out=8, residual=True, xcast=2)
    with pytest.raises(ValueError, match="norm_in"):
        ws.check_shape("Q4_K", 512, "tiles", 64, 1, 3, 2, norm_in=True, norm_out=8, residual=True)
