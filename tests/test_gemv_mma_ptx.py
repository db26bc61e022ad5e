"""CPU tests of the tensor-core GEMV (``gemv_mma``) on the PTX emulator (``ptx_gen.emulator``) against
its float64 oracle: every type over hypothesis-drawn shapes (rings filled by cp.async or bulk copies,
K parts, tile-major weights, the fused gate/up GEMV, uneven K parts and wide CTAs), exact offsets of
small Q6_K / Q4_0 / Q5_0 codes, and NaN rows for an Inf or NaN in x. Its dispatcher is in
tests/test_gemv_mma_policy.py, its weight layout in tests/test_gemv_mma_layout.py, the SIMT GEMV in
tests/test_gemv_ptx.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES, tile_major
from ptx_gen.kernels.gemv.gemv_mma_layout import BLOCK32
from tests.helpers import examples, fit_mma_shape, fit_wide_mma_shape, random_array
from tests.layer_oracles import dequant, random_weight, silu
from ptx_gen.emulator import Memory, run as simt_run
from tests.layer_kernels_ptx_cases import _pad16


@settings(max_examples=examples(80), deadline=None)
@given(wtype=st.sampled_from(MMA_TYPES), out_dim=st.integers(1, 40), mtiles=st.integers(1, 3),
       kparts=st.sampled_from([1, 2, 4, 8]), stages=st.sampled_from([2, 3, 4, 8]), tiles=st.sampled_from([1, 2]),
       units=st.integers(1, 5), target=st.sampled_from(["sm_80", "sm_90", "sm_90 bulk"]),
       bias=st.booleans(), residual=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 500.0]),
       tiled=st.booleans(), solo=st.booleans(), l2pre=st.sampled_from([0, 1, 3]), ahead=st.sampled_from([0, 1, 2]),
       seed=st.integers(0, 2**32 - 1))
def test_gemv_mma_emulated_matches_oracle(wtype, out_dim, mtiles, kparts, stages, tiles, units, target, bias, residual,
                                          scale, tiled, solo, l2pre, ahead, seed):
    """The tensor-core GEMV on the emulator (ldmatrix, int8 mma, a ring with wrap-around filled by
    cp.async, or on sm_90 by bulk copies + mbarriers, K parts combined in shared memory) vs the
    float64 oracle; x spans 1e-3..500 with one outlier. Q6_K: units at all 8 phases of a 16-byte chunk
    (in_dim up to 10240), its last chunk read only up to the block's end (the emulator checks bounds).
    ``tiled``: W tile-major (tile_major, zero-filled past out_dim; Q6_K rows at every 2-byte phase of
    a word, any in_dim multiple of 256, bulk copies too); ``solo``: the larger shared-memory request;
    ``l2pre`` (tile-major, sm_90): L2 prefetches of the warps' units past the ring (a hint: the emulator
    checks their addresses' bounds); ``ahead``: only that many ring stages requested before the grid wait,
    the others after x's first loads."""
    rng = np.random.default_rng(seed)
    if wtype == "Q6_K" and not tiled:
        target, units = target.replace(" bulk", ""), min(units, 3)
    in_dim, mtiles, kparts, stages = fit_mma_shape(wtype, units, mtiles, kparts, stages, tiles, tiled)
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = random_array(rng, in_dim, scale)
    x[rng.integers(0, in_dim)] *= 300
    b = rng.standard_normal(out_dim).astype(np.float32) if bias else None
    r = rng.standard_normal(out_dim).astype(np.float32) if residual else None
    k = catalog.emit("gemv_mma", target=target.split()[0], wtype=wtype, in_dim=in_dim, mtiles=mtiles, kparts=kparts,
                     stages=stages, bias=bias, residual=residual, tiles=tiles, bulk=target.endswith("bulk"),
                     tiled=tiled, solo=solo, l2pre=l2pre if tiled and target.startswith("sm_90") else 0,
                     ahead=min(ahead, stages - 1))
    mem = Memory()
    wbytes = tile_major(raw, wtype, out_dim, in_dim) if tiled else raw if wtype == "Q6_K" else _pad16(raw)
    params = dict(w=mem.alloc_array(wbytes), x=mem.alloc_array(x),
                  y=mem.alloc(4 * out_dim), out_dim=out_dim)
    if bias:
        params["bias"] = mem.alloc_array(b)
    if residual:
        params["residual"] = mem.alloc_array(r)
    simt_run(k.ptx, grid=(-(-out_dim // k.meta["rows_per_cta"]),), block=(k.meta["block"],), params=params,
             memory=mem, shared_bytes=k.meta["dyn_smem"])
    y = mem.read(params["y"], np.float32, out_dim)
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    ref = w @ x.astype(np.float64) + (b if bias else 0) + (r if residual else 0)
    scl = np.abs(w) @ np.abs(x.astype(np.float64)) + (np.abs(b) if bias else 0) + (np.abs(r) if residual else 0)
    assert np.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    err = np.abs(y - ref) / scl
    # x is rounded to 31 bits of its 256-value unit's max: float32-like, ~1e-8 here (1e-4 is what the
    # GEMV family must meet; a wrong index or digit gives errors of order 1)
    assert err.max() < 1e-6, f"{wtype} {out_dim}x{in_dim} m{mtiles} p{kparts} s{stages} t{tiles}: error {err.max():.2e}"


@settings(max_examples=examples(40), deadline=None)
@given(wtype=st.sampled_from(tuple(BLOCK32)), out_dim=st.integers(1, 70),
       shape=st.sampled_from([(1, 8, 2), (1, 4, 2), (2, 4, 2), (1, 4, 1), (2, 2, 1), (3, 1, 2)]),
       units=st.integers(1, 3), target=st.sampled_from(["sm_80", "sm_90", "sm_90 bulk"]),
       layout=st.sampled_from(["rows", "tiles", "glu-tiles"]), scale=st.sampled_from([1e-3, 1.0, 500.0]),
       solo=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemv_mma_block32_emulated_matches_oracle(wtype, out_dim, shape, units, target, layout, scale, solo, seed):
    """The 32-value block types on the emulator: two blocks per pair of MMAs, both rows of a lane's digit
    columns merged before one conversion, Q4_1 / Q5_1 rows padded in shared memory (tile-major stages by
    cp.async into padded rows, or one bulk copy a row; GGUF rows by a lane a row), at the dispatcher's
    shapes (8-warp CTAs, 4-warp ones for 14336 rows) and the fused gate/up GEMV; x from 1e-3 to 500 with
    one outlier, outputs NaN-poisoned."""
    mtiles, kparts, tiles = shape
    glu = layout == "glu-tiles"
    if glu:
        tiles = 2
    rng = np.random.default_rng(seed)
    in_dim, mtiles, kparts, stages = fit_mma_shape(wtype, units, mtiles, kparts, 2, tiles, layout != "rows")
    rows = 2 * out_dim if glu else out_dim
    raw = random_weight(rng, wtype, rows, in_dim)
    x = random_array(rng, in_dim, scale)
    x[rng.integers(0, in_dim)] *= 300
    k = catalog.emit("gemv_mma", target=target.split()[0], wtype=wtype, in_dim=in_dim, mtiles=mtiles, kparts=kparts,
                     stages=stages, tiles=tiles, bulk=target.endswith("bulk"), tiled=layout != "rows", solo=solo,
                     glu=glu)
    mem = Memory()
    wbytes = _pad16(raw) if layout == "rows" else tile_major(raw, wtype, rows, in_dim, glu=glu)
    y = mem.alloc_array(np.full(out_dim, np.nan, np.float32))
    params = dict(w=mem.alloc_array(wbytes), x=mem.alloc_array(x), y=y, out_dim=out_dim)
    simt_run(k.ptx, grid=(-(-out_dim // k.meta["rows_per_cta"]),), block=(k.meta["block"],), params=params,
             memory=mem, shared_bytes=k.meta["dyn_smem"])
    got = mem.read(y, np.float32, out_dim)
    w = dequant(raw, wtype, rows, in_dim).astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    if glu:
        g, u = w[:out_dim] @ x, w[out_dim:] @ x
        scl = (np.abs(g) + np.abs(w[:out_dim]) @ np.abs(x)) * (np.abs(u) + np.abs(w[out_dim:]) @ np.abs(x))
        err = np.abs(got - silu(g) * u) / scl
    else:
        err = np.abs(got - w @ x.astype(np.float64)) / (np.abs(w) @ np.abs(x.astype(np.float64)))
    assert err.max() < 1e-6, f"{wtype} {out_dim}x{in_dim} {shape} {target} {layout}: error {err.max():.2e}"


@pytest.mark.parametrize("target", ["sm_80", "sm_90"])
def test_gemv_mma_q6k_small_weights_are_exact(target):
    """Q6_K codes near 32 stand for small weights (the common case): the offset of 32 enters the
    integer MMA exactly, so all-zero rows give exactly 0 and rows of codes 32 / 33 at the largest scale
    keep float32-level error (a float offset term lost three orders of magnitude there)."""
    rng = np.random.default_rng(3)
    out_dim, in_dim = 32, 4096
    blk = random_weight(rng, "Q6_K", out_dim, in_dim).reshape(out_dim, in_dim // 256, 210).copy()
    blk[:, :, :128], blk[:, :, 128:192], blk[:, :, 192:208] = 0x00, 0xAA, 127  # codes 0 | 2 << 4 = 32
    blk[1:, :, :128] = rng.integers(0, 2, (out_dim - 1, in_dim // 256, 128), dtype=np.uint8) * 0x11  # 32 or 33
    raw = blk.reshape(-1)
    x = np.abs(random_array(rng, in_dim))  # one sign: no cancellation in x to hide the offset's
    k = catalog.emit("gemv_mma", target=target, wtype="Q6_K", in_dim=in_dim, mtiles=1, kparts=2, stages=2, tiles=2)
    mem = Memory()
    params = dict(w=mem.alloc_array(raw), x=mem.alloc_array(x), y=mem.alloc(4 * out_dim), out_dim=out_dim)
    simt_run(k.ptx, grid=(1,), block=(k.meta["block"],), params=params, memory=mem, shared_bytes=k.meta["dyn_smem"])
    y = mem.read(params["y"], np.float32, out_dim)
    w = dequant(raw, "Q6_K", out_dim, in_dim).astype(np.float64)
    assert y[0] == 0.0
    err = np.abs(y[1:] - w[1:] @ x) / (np.abs(w[1:]) @ x)
    assert err.max() < 1e-7, err.max()


@settings(max_examples=examples(30), deadline=None)
@given(wtype=st.sampled_from(MMA_TYPES), ffn=st.integers(1, 40), mtiles=st.integers(1, 3),
       kparts=st.sampled_from([1, 2]), units=st.integers(1, 3), target=st.sampled_from(["sm_80", "sm_90 bulk"]),
       tiled=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemv_glu_mma_emulated_matches_oracle(wtype, ffn, mtiles, kparts, units, target, tiled, seed):
    """The tensor-core fused gate/up GEMV on the emulator: y = silu(gate . x) * (up . x); ``tiled``: W
    tile-major with gate and up rows paired in each tile (tile_major(glu=True))."""
    rng = np.random.default_rng(seed)
    in_dim = 2048 * units if wtype == "Q6_K" and not tiled else 256 * kparts * units
    if wtype == "Q6_K" and not tiled:
        target = target.replace(" bulk", "")
    raw = random_weight(rng, wtype, 2 * ffn, in_dim)
    x = rng.standard_normal(in_dim).astype(np.float32)
    k = catalog.emit("gemv_mma", target=target.split()[0], wtype=wtype, in_dim=in_dim, mtiles=mtiles, kparts=kparts,
                     stages=2, tiles=2, glu=True, bulk=target.endswith("bulk"), tiled=tiled)
    mem = Memory()
    wbytes = tile_major(raw, wtype, 2 * ffn, in_dim, glu=True) if tiled else _pad16(raw)
    params = dict(w=mem.alloc_array(wbytes), x=mem.alloc_array(x), y=mem.alloc(4 * ffn), out_dim=ffn)
    simt_run(k.ptx, grid=(-(-ffn // k.meta["rows_per_cta"]),), block=(k.meta["block"],), params=params, memory=mem,
             shared_bytes=k.meta["dyn_smem"])
    y = mem.read(params["y"], np.float32, ffn)
    w = dequant(raw, wtype, 2 * ffn, in_dim).astype(np.float64)
    g, u = w[:ffn] @ x, w[ffn:] @ x
    scale = (np.abs(g) + np.abs(w[:ffn]) @ np.abs(x)) * (np.abs(u) + np.abs(w[ffn:]) @ np.abs(x))
    assert np.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    assert (np.abs(y - silu(g) * u) / scale).max() < 1e-6


@pytest.mark.parametrize("wtype", MMA_TYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_gemv_mma_poisons_rows_for_nan_or_inf_x(wtype, bad):
    """An Inf or NaN in x cannot be written as digits: every row comes out NaN (never finite garbage,
    which would hide an upstream bug; a float dot product gives NaN or +-Inf there)."""
    rng = np.random.default_rng(1)
    in_dim, out_dim = 4096 if wtype == "Q6_K" else 512, 16
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = rng.standard_normal(in_dim).astype(np.float32)
    x[300] = bad
    k = catalog.emit("gemv_mma", target="sm_80", wtype=wtype, in_dim=in_dim, mtiles=1, kparts=2, stages=2)
    mem = Memory()
    params = dict(w=mem.alloc_array(_pad16(raw)), x=mem.alloc_array(x), y=mem.alloc(4 * out_dim), out_dim=out_dim)
    simt_run(k.ptx, grid=(1,), block=(k.meta["block"],), params=params, memory=mem, shared_bytes=k.meta["dyn_smem"])
    assert np.isnan(mem.read(params["y"], np.float32, out_dim)).all()


@pytest.mark.parametrize("wtype,zero", [("Q4_0", 8), ("Q5_0", 16)])
def test_gemv_mma_offset_codes_are_exact(wtype, zero):
    """Q4_0 / Q5_0 codes stand for q - 8 / q - 16: the offset enters the integer MMA exactly (as its
    accumulator input), so rows of codes at the offset give exactly 0, and rows of codes offset + 1 at
    one block scale give float32-level error (no cancellation of a float offset term)."""
    from ptx_gen.ggml import LAYOUTS, GGMLType
    lay = LAYOUTS[GGMLType[wtype]]
    rng = np.random.default_rng(4)
    out_dim, in_dim = 16, 512
    blk = random_weight(rng, wtype, out_dim, in_dim).reshape(out_dim, in_dim // 32, lay.type_size).copy()
    qs, n = lay.offset("qs"), lay.type_size - lay.offset("qs")
    blk[:, :, qs:] = (zero & 15) * 0x11  # every low 4 bits at the offset's
    if wtype == "Q5_0":  # fifth bits: all 1 (16) in row 0; rows 1.. code 16 or 17 (bit 4 set, low bit random)
        blk[:, :, 2:6] = 0xFF
    blk[1:, :, qs:] = rng.integers(0, 2, (out_dim - 1, in_dim // 32, n), dtype=np.uint8) * 0x11 + (zero & 15) * 0x11
    raw = blk.reshape(-1)
    x = np.abs(random_array(rng, in_dim))
    k = catalog.emit("gemv_mma", target="sm_80", wtype=wtype, in_dim=in_dim, mtiles=1, kparts=2, stages=2)
    mem = Memory()
    params = dict(w=mem.alloc_array(_pad16(raw)), x=mem.alloc_array(x), y=mem.alloc(4 * out_dim), out_dim=out_dim)
    simt_run(k.ptx, grid=(1,), block=(k.meta["block"],), params=params, memory=mem, shared_bytes=k.meta["dyn_smem"])
    y = mem.read(params["y"], np.float32, out_dim)
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    assert (w[0] == 0).all() and y[0] == 0.0
    err = np.abs(y[1:] - w[1:] @ x) / (np.abs(w[1:]) @ x)
    assert err.max() < 1e-7, err.max()


@settings(max_examples=examples(40), deadline=None)
@given(wtype=st.sampled_from(MMA_TYPES), out_dim=st.integers(1, 40), kparts=st.integers(2, 16),
       mtiles=st.integers(1, 3), extra=st.integers(0, 5), target=st.sampled_from(["sm_80", "sm_90", "sm_90 bulk"]),
       late=st.booleans(), tiled=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemv_mma_uneven_k_parts_and_wide_ctas_emulated(wtype, out_dim, kparts, mtiles, extra, target, late, tiled,
                                                          seed):
    """K parts that do not divide the units (the first parts take one unit more; down to one unit a
    warp), CTAs of up to 16 warps, and the late launch trigger, on the emulator against the float64
    oracle; with ``late`` the sm_90 PTX triggers the next launch only inside the unit loop (predicated),
    never at the entry."""
    rng = np.random.default_rng(seed)
    if wtype == "Q6_K" and not tiled:
        target = target.replace(" bulk", "")
    shape = fit_wide_mma_shape(wtype, kparts, extra, mtiles, tiled)
    assume(shape is not None)
    in_dim, mtiles = shape
    raw = random_weight(rng, wtype, out_dim, in_dim)
    x = random_array(rng, in_dim, 1.0)
    k = catalog.emit("gemv_mma", target=target.split()[0], wtype=wtype, in_dim=in_dim, mtiles=mtiles, kparts=kparts,
                     stages=2, tiles=2, bulk=target.endswith("bulk"), tiled=tiled, late=late)
    triggers = [ln.strip() for ln in k.ptx.splitlines() if "griddepcontrol.launch_dependents" in ln]
    if target.startswith("sm_90"):
        assert triggers and all(ln.startswith("@") for ln in triggers) if late else triggers == [
            "griddepcontrol.launch_dependents;"]
    else:
        assert not triggers
    from ptx_gen.kernels.gemv.gemv_mma import layout
    units, lay = in_dim // 256, layout(wtype, in_dim, mtiles, kparts, 2, 2, tiled)
    assert (lay["per_warp"], lay["per_warp_min"]) == (-(-units // kparts), units // kparts)  # (the first parts: one more)
    mem = Memory()
    wbytes = tile_major(raw, wtype, out_dim, in_dim) if tiled else raw if wtype == "Q6_K" else _pad16(raw)
    params = dict(w=mem.alloc_array(wbytes), x=mem.alloc_array(x), y=mem.alloc(4 * out_dim), out_dim=out_dim)
    simt_run(k.ptx, grid=(-(-out_dim // k.meta["rows_per_cta"]),), block=(k.meta["block"],), params=params,
             memory=mem, shared_bytes=k.meta["dyn_smem"])
    y = mem.read(params["y"], np.float32, out_dim)
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    ref = w @ x.astype(np.float64)
    assert np.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    err = np.abs(y - ref) / (np.abs(w) @ np.abs(x.astype(np.float64)))
    assert err.max() < 1e-6, f"{wtype} {out_dim}x{in_dim} m{mtiles} p{kparts}: error {err.max():.2e}"
