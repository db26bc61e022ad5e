"""GPU tests of the transformer-layer kernels through :class:`realizar.gpu.ops.LayerOps`: each kernel
against its float64 oracle with fresh random weights/activations (hypothesis), outputs NaN-poisoned
before every launch so an unwritten element fails. Quantized GEMV: relative error <= 1e-4 against the
float64 dot product of the dequantized weights; argmax exact including ties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.gemv.gemv import MAX_STATIC_SMEM, shared_bytes
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES
from ptx_gen.kernels.gemv.gemv_mma_layout import BLOCK32
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_QUANTS, WEIGHT_TYPES
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.gemv import MMA_SLOWER
from realizar.gpu.ops import GemvConfig, GpuWeight, LayerOps, MmaConfig, inv_freq_table
from tests.helpers import examples, fit_mma_shape, fit_wide_mma_shape, random_array
from tests.layer_oracles import dequant, random_weight, rmsnorm_oracle, rope_oracle, silu

pytestmark = pytest.mark.gpu

REL = 1e-4  # quantized GEMV: |y - y64| <= REL * max|y64| (and per row vs sum |w x|)


@pytest.fixture(scope="module")
def ops(device):
    return LayerOps(device)


def _block(wtype: str) -> int:
    return 256 if wtype in K_QUANTS else (8 if wtype in DENSE else 32)


def _buf(a: np.ndarray) -> cuda.GpuBuffer:
    return cuda.GpuBuffer.from_numpy(np.ascontiguousarray(a))


def _poisoned(n: int, dtype=np.float32) -> cuda.GpuBuffer:
    b = cuda.GpuBuffer(n, dtype)
    b.poison()
    return b


def _check_gemv(y, ref, scale, what):
    assert np.isfinite(y).all(), f"{what}: non-finite (unwritten?) outputs at {np.argwhere(~np.isfinite(y))[:5].tolist()}"
    err = np.abs(y.astype(np.float64) - ref)
    assert err.max() <= REL * max(np.abs(ref).max(), 1e-30), f"{what}: max error {err.max():.3e} vs max|ref| {np.abs(ref).max():.3e}"
    assert (err / scale).max() <= REL, f"{what}: row-relative error {(err / scale).max():.3e}"


# unsplit and split-K launch shapes (rows per warp, warps per CTA, K slices)
CONFIGS = [None, GemvConfig(1, 4), GemvConfig(2, 2), GemvConfig(4, 4), GemvConfig(3, 8), GemvConfig(2, 4, 4),
           GemvConfig(1, 8, 8), GemvConfig(4, 4, 2), GemvConfig(3, 8, 4), GemvConfig(2, 8, 8)]


def _fitting(cfg, wtype: str, in_dim: int):
    """``cfg``, or with one row per warp where its shared memory would not fit this row length."""
    if cfg is not None and shared_bytes(wtype, in_dim, cfg.rows, cfg.warps, cfg.ksplit) > MAX_STATIC_SMEM:
        return GemvConfig(1, cfg.warps, cfg.ksplit)
    return cfg


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data(), wtype=st.sampled_from(WEIGHT_TYPES), out_dim=st.integers(1, 700),
       cfg=st.sampled_from(CONFIGS), bias=st.booleans(), residual=st.sampled_from([None, "separate", "in_place"]),
       seed=st.integers(0, 2**32 - 1))
def test_gemv_matches_float64_oracle(ops, data, wtype, out_dim, cfg, bias, residual, seed):
    bs = _block(wtype)
    in_dim = data.draw(st.integers(1, 6144 // bs).map(lambda n: n * bs), label="in_dim")
    cfg = _fitting(cfg, wtype, in_dim)
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = rng.standard_normal(in_dim).astype(np.float32)
    b = rng.standard_normal(out_dim).astype(np.float32) if bias else None
    r = rng.standard_normal(out_dim).astype(np.float32) if residual else None
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim))
    dx = _buf(x)
    dy = _poisoned(out_dim) if residual != "in_place" else _buf(r)
    db = _buf(b) if bias else None
    dr = dy if residual == "in_place" else (_buf(r) if residual else None)
    ops.gemv(w, dx, dy, bias=db, residual=dr, config=cfg)
    y = dy.to_numpy()
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    ref = wd @ x.astype(np.float64) + (b if bias else 0) + (r if residual else 0)
    scale = np.abs(wd) @ np.abs(x.astype(np.float64)) + (np.abs(b) if bias else 0) + (np.abs(r) if residual else 0)
    _check_gemv(y, ref, scale, f"{wtype} {out_dim}x{in_dim} {cfg}")


def _bulk(ops, drawn: bool, wtype: str, tiled: bool = False) -> bool:
    """Bulk copies where drawn and possible (sm_90; not Q6_K's 2-byte aligned GGUF rows)."""
    return drawn and ops.device.target.compute_capability >= (9, 0) and (wtype != "Q6_K" or tiled)


def _activation(rng, n: int, scale: float, spikes: int) -> np.ndarray:
    """Normal values times ``scale`` with a few outliers 50-1000x larger (as LLM activations have); no
    exact zeros."""
    x = random_array(rng, n, scale, np.float64)
    idx = rng.integers(0, n, spikes)
    x[idx] *= rng.uniform(50, 1000, spikes) * rng.choice([-1, 1], spikes)
    return x.astype(np.float32)


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data(), wtype=st.sampled_from(MMA_TYPES), out_dim=st.integers(1, 600),
       mtiles=st.integers(1, 8), kparts=st.sampled_from([1, 2, 4, 8]), stages=st.sampled_from([2, 3, 4, 8]),
       tiles=st.sampled_from([1, 2]), bulk=st.booleans(), bias=st.booleans(), residual=st.sampled_from([None, "separate", "in_place"]),
       scale=st.sampled_from([1e-4, 1.0, 30.0, 3e3]), spikes=st.integers(0, 4), tiled=st.booleans(), solo=st.booleans(),
       ahead=st.sampled_from([0, 1, 2]), seed=st.integers(0, 2**32 - 1))
def test_gemv_mma_matches_float64_oracle(ops, data, wtype, out_dim, mtiles, kparts, stages, tiles, bulk, bias,
                                         residual, scale, spikes, tiled, solo, ahead, seed):
    """The tensor-core GEMV (x as int8 digits, exact int8 MMAs) at every launch shape, x from 1e-4 to
    3e3 in size with outliers; rows 256 * kparts * (1..7) long (Q6_K on GGUF rows: 2048 * (1..7)), ring
    wrap-around included; W on GGUF rows or tile-major (``tiled``), one CTA an SM or not (``solo``), the
    whole ring or ``ahead`` of its stages requested before the grid wait."""
    units = data.draw(st.integers(1, 7), label="units per warp")
    in_dim, mtiles, kparts, stages = fit_mma_shape(wtype, units, mtiles, kparts, stages, tiles, tiled)
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = _activation(rng, in_dim, scale, spikes)
    b = rng.standard_normal(out_dim).astype(np.float32) if bias else None
    r = rng.standard_normal(out_dim).astype(np.float32) if residual else None
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout="tiles" if tiled else "rows")
    dy = _poisoned(out_dim) if residual != "in_place" else _buf(r)
    dr = dy if residual == "in_place" else (_buf(r) if residual else None)
    cfg = MmaConfig(mtiles, kparts, stages, tiles, _bulk(ops, bulk, wtype, tiled), solo, ahead=min(ahead, stages - 1))
    ops.gemv(w, _buf(x), dy, bias=_buf(b) if bias else None, residual=dr, config=cfg)
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    ref = wd @ x.astype(np.float64) + (b if bias else 0) + (r if residual else 0)
    scl = np.abs(wd) @ np.abs(x.astype(np.float64)) + (np.abs(b) if bias else 0) + (np.abs(r) if residual else 0)
    _check_gemv(dy.to_numpy(), ref, scl, f"{wtype} {out_dim}x{in_dim} {cfg} scale={scale} spikes={spikes}")


@settings(max_examples=examples(40), deadline=None)
@given(wtype=st.sampled_from(MMA_TYPES), out_dim=st.integers(1, 900), kparts=st.integers(2, 16),
       mtiles=st.integers(1, 4), extra=st.integers(0, 9), bulk=st.booleans(), late=st.booleans(), tiled=st.booleans(),
       ahead=st.sampled_from([0, 1]), scale=st.sampled_from([1e-4, 1.0, 3e3]), spikes=st.integers(0, 4),
       seed=st.integers(0, 2**32 - 1))
def test_gemv_mma_uneven_k_parts_wide_ctas_matches_float64_oracle(ops, wtype, out_dim, kparts, mtiles, extra, bulk,
                                                                  late, tiled, ahead, scale, spikes, seed):
    """K parts that do not divide the units, CTAs of up to 16 warps and the late launch trigger on the GPU,
    each launch run three times back to back under programmatic dependent launch (the late trigger lets the
    next launch start while this one ends: every result must still be the oracle's); the whole ring or one
    stage requested before the grid wait (``ahead``, the rest after x's first loads)."""
    shape = fit_wide_mma_shape(wtype, kparts, extra, mtiles, tiled)
    assume(shape is not None)
    in_dim, mtiles = shape
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = _activation(rng, in_dim, scale, spikes)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout="tiles" if tiled else "rows")
    cfg = MmaConfig(mtiles, kparts, 2, 2, _bulk(ops, bulk, wtype, tiled), late=late, ahead=ahead)
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    ref, scl = wd @ x.astype(np.float64), np.abs(wd) @ np.abs(x.astype(np.float64))
    outs = [_poisoned(out_dim) for _ in range(3)]
    dx = _buf(x)
    with cuda.programmatic_dependent_launch(True):
        for dy in outs:
            ops.gemv(w, dx, dy, config=cfg)
    for dy in outs:
        _check_gemv(dy.to_numpy(), ref, scl, f"{wtype} {out_dim}x{in_dim} {cfg} scale={scale} spikes={spikes}")


@settings(max_examples=examples(40), deadline=None)
@given(wtype=st.sampled_from(tuple(BLOCK32)), out_dim=st.integers(1, 700), mtiles=st.integers(1, 8),
       kparts=st.sampled_from([1, 2, 4, 8]), stages=st.sampled_from([2, 3, 4]), tiles=st.sampled_from([1, 2]),
       units=st.integers(1, 7), bulk=st.booleans(), tiled=st.booleans(), scale=st.sampled_from([1e-4, 1.0, 3e3]),
       spikes=st.integers(0, 4), seed=st.integers(0, 2**32 - 1))
def test_gemv_mma_block32_matches_float64_oracle(ops, wtype, out_dim, mtiles, kparts, stages, tiles, units, bulk,
                                                 tiled, scale, spikes, seed):
    """The 32-value block types on tensor cores (two blocks per pair of MMAs; Q4_1 / Q5_1 rows padded in
    shared memory, copied row by row with bulk copies) at every launch shape, W on GGUF rows or tile-major."""
    in_dim, mtiles, kparts, stages = fit_mma_shape(wtype, units, mtiles, kparts, stages, tiles, tiled)
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = _activation(rng, in_dim, scale, spikes)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout="tiles" if tiled else "rows")
    dy = _poisoned(out_dim)
    cfg = MmaConfig(mtiles, kparts, stages, tiles, _bulk(ops, bulk, wtype, tiled), tiled and out_dim <= 4096)
    ops.gemv(w, _buf(x), dy, config=cfg)
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    _check_gemv(dy.to_numpy(), wd @ x.astype(np.float64), np.abs(wd) @ np.abs(x.astype(np.float64)),
                f"{wtype} {out_dim}x{in_dim} {cfg} scale={scale} spikes={spikes}")


@pytest.mark.parametrize("wtype", MMA_TYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_gemv_mma_nan_or_inf_x_gives_nan_rows(ops, wtype, bad, bulk, layout):
    """An Inf or NaN in x makes every row NaN on the tensor-core kernel (never finite garbage)."""
    rng = np.random.default_rng(5)
    raw = random_weight(rng, wtype, 300, 2048)
    x = rng.standard_normal(2048).astype(np.float32)
    x[1234] = bad
    dy = _buf(np.zeros(300, np.float32))  # zeros, not NaN: a NaN read back was written by the kernel
    cfg = MmaConfig(1, 8, 2, 2, _bulk(ops, bulk, wtype, layout == "tiles"))
    ops.gemv(GpuWeight(data=raw, ggml_type=wtype, shape=(300, 2048), layout=layout), _buf(x), dy, config=cfg)
    assert np.isnan(dy.to_numpy()).all()


@pytest.mark.parametrize("wtype", MMA_TYPES)
@pytest.mark.parametrize("out_dim,in_dim", [(4096, 14336), (14336, 4096), (4096, 4096), (2000, 2048)])
def test_gemv_mma_dispatch_at_real_shapes(ops, wtype, out_dim, in_dim):
    """The dispatcher's tensor-core pick at the decode shapes, on the tile-major weight ``upload`` makes
    and on GGUF rows, vs the oracle and vs the SIMT kernel."""
    cfg = ops.mma_config(out_dim, in_dim, wtype)
    forced = None
    if wtype in MMA_SLOWER:  # the policy keeps the SIMT kernel; the tensor-core one still has to be right
        assert cfg is None
        cfg = forced = MmaConfig(1, 4, 2, 1)
    assert cfg is not None
    rng = np.random.default_rng(out_dim + in_dim)
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = _activation(rng, in_dim, 1.0, 8)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim))
    wt = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout="tiles")
    dy, dy_t, dy_simt = _poisoned(out_dim), _poisoned(out_dim), _poisoned(out_dim)
    ops.gemv(w, _buf(x), dy, config=forced)
    ops.gemv(wt, _buf(x), dy_t, config=forced)
    ops.gemv(w, _buf(x), dy_simt, config=GemvConfig(2, 4))
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    ref, scl = wd @ x, np.abs(wd) @ np.abs(x)
    _check_gemv(dy.to_numpy(), ref, scl, f"{wtype} {out_dim}x{in_dim} {cfg}")
    _check_gemv(dy_t.to_numpy(), ref, scl, f"{wtype} {out_dim}x{in_dim} tile-major "
                f"{ops.mma_config(out_dim, in_dim, wtype, layout='tiles')}")
    _check_gemv(dy_simt.to_numpy(), ref, scl, f"{wtype} {out_dim}x{in_dim} SIMT")


def test_tile_major_weights_are_refused_by_row_readers(ops):
    """A tile-major weight read as GGUF rows would give wrong numbers silently: the SIMT GEMV, the GEMM,
    the embedding and the wrong fused/plain GEMV refuse it with a ShapeError naming the layout."""
    rng = np.random.default_rng(3)
    raw = random_weight(rng, "Q4_K", 64, 512)
    wt = GpuWeight(data=raw, ggml_type="Q4_K", shape=(64, 512), layout="tiles")
    wg = GpuWeight(data=raw, ggml_type="Q4_K", shape=(64, 512), layout="glu-tiles")
    x, y = _buf(np.ones(512 * 4, np.float32)), _poisoned(64 * 4)
    with pytest.raises(ShapeError, match="stored tiles"):
        ops.gemv(wt, x, y, config=GemvConfig(2, 4))
    with pytest.raises(ShapeError, match="GEMM reads GGUF rows"):
        ops.gemm(wt, x, y, 2)
    with pytest.raises(ShapeError, match="embedding reads GGUF rows"):
        ops.embedding(wt, _buf(np.zeros(1, np.uint32)), y)
    with pytest.raises(ShapeError, match="use gemv_glu"):
        ops.gemv(wg, x, y)
    with pytest.raises(ShapeError, match="needs layout 'glu-tiles' or 'rows'"):
        ops.gemv_glu(wt, x, y)
    with pytest.raises(ShapeError, match="weights can be stored tile-major, not F16"):
        GpuWeight(data=random_weight(rng, "F16", 8, 64), ggml_type="F16", shape=(8, 64), layout="tiles")
    with pytest.raises(ShapeError, match="layout must be one of"):
        GpuWeight(data=raw, ggml_type="Q4_K", shape=(64, 512), layout="columns")


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
@pytest.mark.parametrize("out_dim,in_dim", [(576, 576), (1536, 576), (576, 1536), (4096, 4096), (1024, 14336)])
def test_gemv_real_shapes(ops, wtype, out_dim, in_dim):
    if in_dim % _block(wtype):
        pytest.skip(f"{wtype} cannot hold rows of {in_dim}")
    rng = np.random.default_rng(out_dim * 7 + in_dim)
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = rng.standard_normal(in_dim).astype(np.float32)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim))
    dy = _poisoned(out_dim)
    ops.gemv(w, _buf(x), dy)
    wd = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    _check_gemv(dy.to_numpy(), wd @ x, np.abs(wd) @ np.abs(x), f"{wtype} {out_dim}x{in_dim}")


@settings(max_examples=examples(30), deadline=None)
@given(wtype=st.sampled_from(MMA_TYPES), ffn=st.integers(1, 400), mtiles=st.sampled_from([1, 2, 4, 8]),
       kparts=st.sampled_from([1, 2, 4, 8]), stages=st.sampled_from([2, 3, 4]), units=st.integers(1, 4),
       bulk=st.booleans(), tiled=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemv_glu_mma_matches_oracle(ops, wtype, ffn, mtiles, kparts, stages, units, bulk, tiled, seed):
    """The tensor-core fused gate/up GEMV (a warp's 16 gate rows and their 16 up rows, silu(g) * u), on
    GGUF rows or tile-major (gate and up rows paired in each tile)."""
    in_dim, mtiles, kparts, stages = fit_mma_shape(wtype, units, mtiles, kparts, stages, 2, tiled)
    rng = np.random.default_rng(seed)
    raw = random_weight(rng, wtype, 2 * ffn, in_dim)
    x = _activation(rng, in_dim, 1.0, 2)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(2 * ffn, in_dim), layout="glu-tiles" if tiled else "rows")
    dy = _poisoned(ffn)
    cfg = MmaConfig(mtiles, kparts, stages, 2, _bulk(ops, bulk, wtype, tiled))
    ops.gemv_glu(w, _buf(x), dy, config=cfg)
    wd = dequant(raw, wtype, 2 * ffn, in_dim).astype(np.float64)
    g, u = wd[:ffn] @ x, wd[ffn:] @ x
    sg, su = np.abs(wd[:ffn]) @ np.abs(x), np.abs(wd[ffn:]) @ np.abs(x)
    y = dy.to_numpy()
    assert np.isfinite(y).all(), f"{cfg}: unwritten outputs"
    assert (np.abs(y - silu(g) * u) / ((np.abs(g) + sg) * (np.abs(u) + su))).max() <= REL, cfg


@settings(max_examples=examples(25), deadline=None)
@given(wtype=st.sampled_from(WEIGHT_TYPES), ffn=st.integers(1, 300), mult=st.integers(1, 6),
       cfg=st.sampled_from([None, GemvConfig(2, 4, 2), GemvConfig(4, 8, 8), GemvConfig(2, 8, 4)]),
       seed=st.integers(0, 2**32 - 1))
def test_gemv_glu_matches_oracle(ops, wtype, ffn, mult, cfg, seed):
    rng = np.random.default_rng(seed)
    in_dim = mult * (256 if wtype in K_QUANTS else 96)
    cfg = _fitting(cfg, wtype, in_dim)
    if cfg is not None and cfg.rows < 2:
        cfg = GemvConfig(2, cfg.warps, cfg.ksplit)
    raw = random_weight(rng, wtype, 2 * ffn, in_dim)
    x = rng.standard_normal(in_dim).astype(np.float32)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(2 * ffn, in_dim))
    dy = _poisoned(ffn)
    ops.gemv_glu(w, _buf(x), dy, config=cfg)
    wd = dequant(raw, wtype, 2 * ffn, in_dim).astype(np.float64)
    g, u = wd[:ffn] @ x, wd[ffn:] @ x
    sg, su = np.abs(wd[:ffn]) @ np.abs(x), np.abs(wd[ffn:]) @ np.abs(x)
    ref = silu(g) * u
    y = dy.to_numpy()
    assert np.isfinite(y).all()
    assert (np.abs(y - ref) / ((np.abs(g) + sg) * (np.abs(u) + su))).max() <= REL


@settings(max_examples=examples(25), deadline=None)
@given(wtype=st.sampled_from(WEIGHT_TYPES), out_dim=st.integers(1, 300), n_tok=st.integers(1, 40),
       tokens=st.sampled_from([1, 2, 3, 4, 8]), bias=st.booleans(), residual=st.booleans(), glu=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
@example(wtype="Q5_K", out_dim=1, n_tok=1, tokens=1, bias=False, residual=False, glu=True, seed=1)  # (silu ~ 6e-108)
def test_gemm_matches_oracle(ops, wtype, out_dim, n_tok, tokens, bias, residual, glu, seed):
    if glu:
        bias = residual = False
        tokens = min(tokens, 4)
    rng = np.random.default_rng(seed)
    in_dim = 512 if wtype in K_QUANTS else 544
    wrows = 2 * out_dim if glu else out_dim
    raw = random_weight(rng, wtype, wrows, in_dim)
    X = rng.standard_normal((n_tok, in_dim)).astype(np.float32)
    b = rng.standard_normal(out_dim).astype(np.float32) if bias else None
    R = rng.standard_normal((n_tok, out_dim)).astype(np.float32) if residual else None
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(wrows, in_dim))
    dy = _poisoned(n_tok * out_dim)
    ops.gemm(w, _buf(X), dy, n_tok, bias=_buf(b) if bias else None, residual=_buf(R) if residual else None,
             tokens_per_cta=tokens, glu=glu)
    Y = dy.to_numpy((n_tok, out_dim))
    wd = dequant(raw, wtype, wrows, in_dim).astype(np.float64)
    full = X.astype(np.float64) @ wd.T
    mag = np.abs(X.astype(np.float64)) @ np.abs(wd).T  # each dot product's sum of |terms|
    if glu:  # (a gate far below zero gives silu ~ 1e-100: float32 holds 0 there; scale by the factors' sizes)
        g, u = full[:, :out_dim], full[:, out_dim:]
        ref = silu(g) * u
        scale = (np.abs(g) + mag[:, :out_dim]) * (np.abs(u) + mag[:, out_dim:])
    else:
        ref = full + (b if bias else 0) + (R if residual else 0)
        scale = mag + (np.abs(b) if bias else 0) + (np.abs(R) if residual else 0)
    assert np.isfinite(Y).all()
    assert (np.abs(Y - ref) / scale).max() <= REL


@settings(max_examples=examples(25), deadline=None)
@given(hidden=st.sampled_from([64, 576, 896, 2048, 4096, 4100, 8192, 16384]), rows=st.integers(1, 5),
       residual=st.booleans(), eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 2**32 - 1))
def test_rmsnorm(ops, hidden, rows, residual, eps, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    r = rng.standard_normal((rows, hidden)).astype(np.float32)
    dy, dr = _poisoned(rows * hidden), _buf(r)
    ops.rmsnorm(_buf(x), _buf(w), dy, eps, hidden=hidden, rows=rows, residual=dr if residual else None)
    ref, h = rmsnorm_oracle(x, w, eps, r if residual else None)
    y = dy.to_numpy((rows, hidden))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    if residual:
        np.testing.assert_array_equal(dr.to_numpy((rows, hidden)), r + x)


@settings(max_examples=examples(30), deadline=None)
@given(head_dim=st.sampled_from([64, 80, 96, 128, 256]), partial=st.booleans(), neox=st.booleans(),
       from_buffer=st.booleans(), nq=st.integers(1, 40), nkv=st.integers(1, 8), n_tok=st.integers(1, 5),
       theta=st.sampled_from([10000.0, 500000.0, 1e6]), seed=st.integers(0, 2**32 - 1))
def test_rope(ops, head_dim, partial, neox, from_buffer, nq, nkv, n_tok, theta, seed):
    rng = np.random.default_rng(seed)
    rot = head_dim // 2 if partial else head_dim
    q = rng.standard_normal((n_tok, nq, head_dim)).astype(np.float32)
    k = rng.standard_normal((n_tok, nkv, head_dim)).astype(np.float32)
    inv = inv_freq_table(rot, theta)
    if from_buffer:
        positions = rng.integers(0, 131072, n_tok).astype(np.uint32)
        pos_arg = _buf(positions)
    else:
        start = int(rng.integers(0, 131072))
        positions = start + np.arange(n_tok)
        pos_arg = start
    dq, dk = _buf(q), _buf(k)
    ops.rope(dq, dk, _buf(inv), pos_arg, nq, nkv, head_dim, rot_dim=rot, neox=neox, n_tokens=n_tok)
    for name, src, got in (("q", q, dq.to_numpy(q.shape)), ("k", k, dk.to_numpy(k.shape))):
        for t in range(n_tok):
            ang = (np.float32(positions[t]) * inv).astype(np.float64)  # the f32 angle of a float32 reference
            v = src[t].astype(np.float64)
            ref = rope_oracle(v, ang, neox, rot)
            # sin/cos.approx after an exact-enough range reduction: ~5e-7 absolute
            np.testing.assert_allclose(got[t], ref, atol=4e-6 * np.abs(v).max(), err_msg=f"{name}[{t}]")


@settings(max_examples=examples(20), deadline=None)
@given(n=st.integers(1, 300_000), seed=st.integers(0, 2**32 - 1))
def test_swiglu_residual_bias(ops, n, seed):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 4).astype(np.float32)
    u = rng.standard_normal(n).astype(np.float32)
    dg, du, do = _buf(g), _buf(u), _poisoned(n)
    ops.swiglu(dg, du, do, n)
    np.testing.assert_allclose(do.to_numpy(), silu(g) * u, rtol=2e-6, atol=1e-6)
    ops.residual_add(dg, du, dg, n)
    np.testing.assert_array_equal(dg.to_numpy(), g + u)
    cols = max(1, n // 7)
    tok = n // cols
    y = rng.standard_normal((tok, cols)).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32)
    dy = _buf(y)
    ops.bias_add(dy, _buf(b), cols, tok)
    np.testing.assert_array_equal(dy.to_numpy((tok, cols)), y + b)


@settings(max_examples=examples(30), deadline=None)
@given(wtype=st.sampled_from(WEIGHT_TYPES), mult=st.integers(1, 24), vocab=st.integers(1, 50), n_tok=st.integers(1, 6),
       seed=st.integers(0, 2**32 - 1))
def test_embedding(ops, wtype, mult, vocab, n_tok, seed):
    rng = np.random.default_rng(seed)
    hidden = mult * (256 if wtype in K_QUANTS else 64)
    raw = random_weight(rng, wtype, vocab, hidden)
    toks = rng.integers(0, vocab, n_tok).astype(np.uint32)
    table = GpuWeight(data=raw, ggml_type=wtype, shape=(vocab, hidden))
    do = _poisoned(n_tok * hidden)
    ops.embedding(table, _buf(toks), do, n_tok)
    ref = dequant(raw, wtype, vocab, hidden)[toks]
    out = do.to_numpy((n_tok, hidden))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * max(np.abs(ref).max(), 1e-30))


@settings(max_examples=examples(40), deadline=None)
@given(n=st.integers(1, 262_144), mode=st.sampled_from(["plain", "ties", "nan", "zeros", "const", "inf"]),
       seed=st.integers(0, 2**32 - 1))
def test_argmax_exact(ops, n, mode, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    idx = rng.integers(0, n, 4)
    if mode == "ties":
        x[idx] = x.max() + 1
    elif mode == "nan":
        x[idx[:2]] = np.nan
    elif mode == "zeros":
        x[:] = -1.0
        x[idx[0]], x[idx[1]] = -0.0, 0.0
    elif mode == "const":
        x[:] = 3.0
    elif mode == "inf":
        x[idx] = -np.inf
        x[idx[0]] = np.inf
    out = cuda.GpuBuffer(1, np.uint32)
    out.fill_bytes(0xFF)
    ops.argmax(_buf(x), out, n)
    assert int(out.to_numpy()[0]) == int(np.argmax(x))


def test_decode_step_ops_capture_into_a_graph(ops, device):
    """The calls a decode step makes are graph-safe: capture once, replay with new device-side token
    and position, results match eager execution."""
    rng = np.random.default_rng(3)
    hidden, vocab, nq, nkv, hd = 256, 300, 4, 2, 64
    emb = GpuWeight(data=random_weight(rng, "Q8_0", vocab, hidden), ggml_type="Q8_0", shape=(vocab, hidden))
    wq = GpuWeight(data=random_weight(rng, "Q4_K", (nq + 2 * nkv) * hd, hidden), ggml_type="Q4_K",
                   shape=((nq + 2 * nkv) * hd, hidden))
    norm = _buf(rng.standard_normal(hidden).astype(np.float32))
    inv = _buf(inv_freq_table(hd, 10000.0))
    tok, pos = cuda.GpuBuffer(1, np.uint32), cuda.GpuBuffer(1, np.uint32)
    h, xn = cuda.GpuBuffer(hidden), cuda.GpuBuffer(hidden)
    qkv, best = cuda.GpuBuffer((nq + 2 * nkv) * hd), cuda.GpuBuffer(1, np.uint32)
    stream = cuda.Stream()

    def step():
        ops.embedding(emb, tok, h, stream=stream)
        ops.rmsnorm(h, norm, xn, 1e-5, stream=stream)
        ops.gemv(wq, xn, qkv, stream=stream)
        ops.rope((qkv, 0), (qkv, nq * hd), inv, pos, nq, nkv, hd, stream=stream)
        ops.argmax(qkv, best, stream=stream)

    def run_eager(t, p):
        tok.copy_from_host(np.array([t], np.uint32))
        pos.copy_from_host(np.array([p], np.uint32))
        step()
        stream.synchronize()
        return qkv.to_numpy().copy(), int(best.to_numpy()[0])

    eager = [run_eager(t, p) for t, p in ((5, 0), (77, 13))]
    tok.copy_from_host(np.array([5], np.uint32))
    pos.copy_from_host(np.array([0], np.uint32))
    stream.synchronize()
    with cuda.capture(stream) as cap:
        step()
    exe = cap.graph.instantiate()
    for (t, p), (ref_qkv, ref_best) in zip(((5, 0), (77, 13)), eager):
        tok.copy_from_host(np.array([t], np.uint32))
        pos.copy_from_host(np.array([p], np.uint32))
        exe.replay(stream)
        stream.synchronize()
        np.testing.assert_array_equal(qkv.to_numpy(), ref_qkv)
        assert int(best.to_numpy()[0]) == ref_best
