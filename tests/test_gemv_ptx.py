"""CPU tests of the GEMV/GEMM kernels (SIMT, split-K and tensor-core): every configuration assembles
with ptxas for sm_80 and sm_90 over hypothesis-drawn shapes and does not spill at real shapes, the
dispatcher's picks and the row plans/splits keep their invariants, bad weights are rejected before
touching a GPU, and (through the PTX emulator ``ptx_gen.emulator``) every kernel matches its float64
oracle on small shapes, with memcheck/racecheck-style checks on every access (cp.async misuse
included). The other layer kernels are in tests/test_layer_kernels_ptx.py."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.gemv import gemv as gv
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES, tile_major
from ptx_gen.kernels.gemv.gemv_mma_layout import BLOCK32
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_QUANTS, WEIGHT_TYPES, type_info
from ptx_gen.ptxas import assemble
from realizar.gpu.gemv import gemv_config
from tests.helpers import fit_mma_shape, fit_wide_mma_shape, random_array
from tests.layer_oracles import dequant, random_weight, silu
from ptx_gen.emulator import Memory, run as simt_run
from tests.layer_kernels_ptx_cases import _assemble_all, _in_dims, _pad16


# ---------------------------------------------------------------------------------------------
# ptxas over drawn shapes


@settings(max_examples=30, deadline=None)
@given(data=st.data(), wtype=st.sampled_from(WEIGHT_TYPES), rows=st.sampled_from([1, 2, 3, 4]),
       warps=st.sampled_from([1, 2, 4, 8]), bias=st.booleans(), residual=st.booleans())
def test_gemv_assembles(data, wtype, rows, warps, bias, residual):
    in_dim = data.draw(_in_dims(wtype))
    ksplit = data.draw(st.sampled_from([s for s in gv.KSPLITS if s <= warps]), label="ksplit")
    shape = dict(wtype=wtype, in_dim=in_dim, rows=rows, warps=warps, ksplit=ksplit)
    if gv.shared_bytes(wtype, in_dim, rows, warps, ksplit) > gv.MAX_STATIC_SMEM:
        with pytest.raises(ValueError, match="shared memory"):
            catalog.emit("gemv", **shape)
        return
    _assemble_all("gemv", bias=bias, residual=residual, **shape)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), wtype=st.sampled_from(WEIGHT_TYPES),
       rt=st.sampled_from([(1, t) for t in range(1, 9)] + [(2, t) for t in range(1, 5)] + [(4, 1), (4, 2)]),
       glu=st.booleans())
def test_gemm_assembles(data, wtype, rt, glu):
    rows, tokens = rt
    if glu and rows % 2:
        rows = 2
        tokens = min(tokens, 4)
    in_dim = data.draw(_in_dims(wtype))
    _assemble_all("gemm", wtype=wtype, in_dim=in_dim, rows=rows, warps=4, tokens=tokens, glu=glu)


# (out_dim, in_dim) of the decode shapes the dispatcher is tuned for (Llama-3-8B, Llama-3.2-1B, SmolLM2)
REAL_SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096), (28672, 4096), (2048, 8192), (8192, 2048), (2048, 2048),
               (128256, 2048), (576, 1536), (1536, 576), (576, 576), (49152, 576)]


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
@pytest.mark.parametrize("in_dim", [4096, 14336])
def test_gemv_family_no_spills_at_real_shapes(wtype, in_dim):
    """4096x4096 and 4096x14336 (both directions: in_dim 4096 and 14336): the unsplit configurations,
    the fused gate/up variant and the prefill GEMM; the split ones are in the next test."""
    for rows in (1, 2, 4):
        _assemble_all("gemv", wtype=wtype, in_dim=in_dim, rows=rows, warps=4)
    _assemble_all("gemv", wtype=wtype, in_dim=in_dim, rows=4, warps=4, residual=True, bias=True)
    _assemble_all("gemv", wtype=wtype, in_dim=in_dim, rows=2, warps=4, glu=True)
    _assemble_all("gemm", wtype=wtype, in_dim=in_dim, rows=2, warps=4, tokens=4)


@pytest.mark.parametrize("wtype", WEIGHT_TYPES)
def test_dispatcher_configs_assemble_without_spills(wtype):
    """Every configuration gemv_config picks at the real shapes (plain, with bias + residual, and the
    fused gate/up GEMV of the 2 * ffn rows), without spills and within the static shared memory."""
    seen = set()
    for out_dim, in_dim in REAL_SHAPES:
        if in_dim % type_info(wtype).block_values:
            continue
        cfg = gemv_config(out_dim, 132, in_dim, wtype)
        glu = gemv_config(2 * out_dim, 132, in_dim, wtype)
        for shape in (dict(rows=cfg.rows, warps=cfg.warps, ksplit=cfg.ksplit, bias=True, residual=True),
                      dict(rows=max(2, glu.rows - glu.rows % 2), warps=glu.warps, ksplit=glu.ksplit, glu=True)):
            key = (in_dim, *sorted(shape.items()))
            if key not in seen:
                seen.add(key)
                _assemble_all("gemv", wtype=wtype, in_dim=in_dim, **shape)


# ---------------------------------------------------------------------------------------------
# validation


def test_gpu_weight_rejects_bad_rows_before_touching_the_gpu():
    from realizar.errors import ShapeError, UnsupportedError
    from realizar.gpu.weights import GpuWeight

    with pytest.raises(ShapeError, match="not a multiple of the block size 256"):
        GpuWeight(data=np.zeros(144, np.uint8), ggml_type="Q4_K", shape=(1, 320))
    with pytest.raises(ShapeError, match="2-D"):
        GpuWeight(data=np.zeros(34, np.uint8), ggml_type="Q8_0", shape=(32,))
    with pytest.raises(UnsupportedError):
        GpuWeight(data=np.zeros(34, np.uint8), ggml_type=10, shape=(1, 256))  # Q2_K


def test_plan_invariants():
    for wt in WEIGHT_TYPES:
        for d in (256, 512, 576, 1536, 4096, 14336):
            if d % type_info(wt).block_values or (wt in DENSE and d % 8):
                continue
            p = gv.plan(wt, d)
            assert p["tile_bytes"] % 16 == 0  # per-row s0 is constant over tiles
            covered = p["n_full_tiles"] * p["rpt"] * 256 + sum(n for _, n in p["tail"])
            assert covered == d
            assert p["stage"] >= 16 * max(p["pieces_full"] if p["n_full_tiles"] else 0, p["pieces_tail"])
    assert gemv_config(4096).rows == 2 and gemv_config(576).rows == 1


@settings(max_examples=200, deadline=None)
@given(wtype=st.sampled_from(WEIGHT_TYPES), n=st.integers(1, 80), ksplit=st.sampled_from(gv.KSPLITS))
def test_split_invariants(wtype, n, ksplit):
    """The slices tile the row exactly, start where their phase says (a multiple of 4 bytes apart, or
    of 16 when every row is 16-byte aligned), and their tiles are whole 16-byte pieces."""
    in_dim = n * (256 if wtype in K_QUANTS else 32)
    info = type_info(wtype)
    sp = gv.split(wtype, in_dim, ksplit)
    assert sp["n_full"] * sp["slice_vals"] + sp["last_vals"] == in_dim
    assert 1 <= sp["used"] <= ksplit and sp["slice_vals"] % 256 == 0 or sp["used"] == 1
    assert sp["rpt"] * info.round_bytes % 16 == 0
    if sp["used"] > 1:
        assert sp["slice_bytes"] % sp["phase"] == 0 and info.row_bytes(in_dim) % sp["phase"] == 0
        assert sp["slice_vals"] * (sp["used"] - 1) < in_dim  # the last used slice is not empty
    if ksplit == 1:
        assert sp["slice_vals"] == in_dim and sp["rpt"] == gv.TILE_ROUNDS[wtype]


def test_dispatcher_splits_long_rows_and_small_grids():
    """The picks the report and the benchmark quote (H200: 132 SMs)."""
    pick = lambda o, i, t: tuple(vars(gemv_config(o, 132, i, t)).values())  # noqa: E731
    # the large shapes: the fastest configs of bench_gemv --sweep on an H200 (SIMT_LARGE; the figures are in
    # docs/performance.md, GEMV: "Why each pick")
    assert pick(4096, 14336, "Q4_K") == (4, 4, 2)
    assert pick(4096, 14336, "Q8_0") == (4, 4, 2)
    assert pick(4096, 14336, "Q6_K") == (2, 8, 8)
    assert pick(14336, 4096, "Q6_K") == (4, 4, 4)
    assert pick(14336, 4096, "Q4_K") == (4, 4, 1)
    assert pick(14336, 4096, "Q8_0") == (4, 4, 1)
    assert pick(128256, 2048, "Q8_0") == (4, 4, 1)
    assert pick(4096, 4096, "Q4_K") == (4, 4, 1)
    assert pick(576, 576, "Q8_0") == (1, 4, 1)  # too short to split
    assert pick(49152, 576, "Q8_0") == (4, 4, 1)  # as before split-K
    assert pick(14336, 4096, "F16") == (2, 4, 1)  # dense rows split only for a small grid
    for o, i, t in ((4096, 14336, "Q6_K"), (2048, 8192, "Q8_0"), (128256, 2048, "Q4_K"), (576, 1536, "Q4_1")):
        cfg = gemv_config(o, 132, i, t)
        assert cfg.warps % cfg.ksplit == 0 and cfg.warps in (4, 8)
        assert gv.shared_bytes(t, i, cfg.rows, cfg.warps, cfg.ksplit) <= gv.MAX_STATIC_SMEM


# ---------------------------------------------------------------------------------------------
# emulated runs vs float64 oracles


def _emulate_gemm(rng, wtype, in_dim, out_dim, n_tok, tokens, rows, warps, bias, residual, glu, ksplit=1):
    """Run the GEMV/GEMM on the emulator and compare with the float64 oracle; ``residual`` is False,
    True (a separate buffer) or "in_place" (the residual is y itself)."""
    wrows = 2 * out_dim if glu else out_dim
    raw = random_weight(rng, wtype, wrows, in_dim)
    nt = n_tok if tokens else 1
    x = rng.standard_normal((nt, in_dim)).astype(np.float32)
    b = rng.standard_normal(out_dim).astype(np.float32) if bias else None
    r = rng.standard_normal((nt, out_dim)).astype(np.float32) if residual else None
    shape = dict(wtype=wtype, in_dim=in_dim, rows=rows, warps=warps, bias=bias, residual=bool(residual), glu=glu)
    if tokens:
        shape["tokens"] = tokens
    if ksplit > 1:
        shape["ksplit"] = ksplit
    k = catalog.emit("gemm" if tokens else "gemv", **shape)
    mem = Memory()
    y_addr = mem.alloc_array(r) if residual == "in_place" else mem.alloc(4 * out_dim * nt)
    params = dict(w=mem.alloc_array(_pad16(raw)), x=mem.alloc_array(x), y=y_addr, out_dim=out_dim)
    if tokens:
        params["n_tokens"] = nt
    if bias:
        params["bias"] = mem.alloc_array(b)
    if residual:
        params["residual"] = y_addr if residual == "in_place" else mem.alloc_array(r)
    grid = (-(-out_dim // k.meta["rows_per_cta"]), -(-nt // tokens) if tokens else 1)
    simt_run(k.ptx, grid=grid, block=(k.meta["block"],), params=params, memory=mem)
    y = mem.read(params["y"], np.float32, out_dim * nt).reshape(nt, out_dim)
    w = dequant(raw, wtype, wrows, in_dim).astype(np.float64)
    full = x.astype(np.float64) @ w.T
    scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
    if glu:
        ref = silu(full[:, :out_dim]) * full[:, out_dim:]
        scale = (np.abs(full[:, :out_dim]) + scale[:, :out_dim]) * (np.abs(full[:, out_dim:]) + scale[:, out_dim:])
    else:
        ref = full + (b if bias else 0) + (r if residual else 0)
        scale = scale + (np.abs(b) if bias else 0) + (np.abs(r) if residual else 0)
    assert np.isfinite(y).all(), "unwritten (NaN-poisoned) outputs"
    err = np.abs(y - ref) / scale
    assert err.max() < 2e-6, f"{shape} n_tok={n_tok}: relative error {err.max():.2e}"


@settings(max_examples=40, deadline=None)
@given(data=st.data(), wtype=st.sampled_from(WEIGHT_TYPES), out_dim=st.integers(1, 9), rows=st.sampled_from([1, 2, 3, 4]),
       warps=st.sampled_from([1, 2]), bias=st.booleans(), residual=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemv_emulated_matches_oracle(data, wtype, out_dim, rows, warps, bias, residual, seed):
    bs = 256 if wtype in K_QUANTS else (8 if wtype in DENSE else 32)
    in_dim = data.draw(st.integers(1, 2560 // bs).map(lambda n: n * bs))
    _emulate_gemm(np.random.default_rng(seed), wtype, in_dim, out_dim, 1, 0, rows, warps, bias, residual, False)


@settings(max_examples=15, deadline=None)
@given(wtype=st.sampled_from(WEIGHT_TYPES), out_dim=st.integers(1, 6), n_tok=st.integers(1, 9), tokens=st.integers(1, 8),
       glu=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemm_and_glu_emulated_match_oracle(wtype, out_dim, n_tok, tokens, glu, seed):
    in_dim = 512 if wtype in K_QUANTS else 320
    rows = 2 if glu or tokens <= 4 else 1
    tokens = min(tokens, 4) if glu else tokens
    _emulate_gemm(np.random.default_rng(seed), wtype, in_dim, out_dim, n_tok, tokens, rows, 2, False, not glu, glu)


@pytest.mark.parametrize("wtype,in_dim", [("Q4_1", 576), ("Q8_0", 576), ("Q6_K", 1536), ("Q4_K", 4096), ("Q8_0", 4096)])
def test_gemv_emulated_misaligned_and_multi_tile_rows(wtype, in_dim):
    """Rows whose byte length is not a multiple of 16 (SmolLM2's 576 in Q4_1/Q8_0, Q6_K at 1536)
    and rows spanning several tiles of the runtime loop."""
    _emulate_gemm(np.random.default_rng(7), wtype, in_dim, 5, 1, 0, 2, 2, True, True, False)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), wtype=st.sampled_from(WEIGHT_TYPES), out_dim=st.integers(1, 11),
       ksplit=st.sampled_from([2, 4, 8]), mode=st.sampled_from(["plain", "bias", "residual", "in_place", "both", "glu"]),
       seed=st.integers(0, 2**32 - 1))
def test_gemv_split_k_emulated_matches_oracle(data, wtype, out_dim, ksplit, mode, seed):
    """Split-K variants against the float64 oracle: rows with partial rounds and 16-byte tails
    (any multiple of the block size up to ~4200 values, so slices that are one tile, several tiles,
    shorter than the others or empty), several row groups per CTA, rows past out_dim, bias,
    residual, in-place residual (y is the residual) and the gate/up GLU epilogue."""
    bs = 256 if wtype in K_QUANTS else (8 if wtype in DENSE else 32)
    in_dim = data.draw(st.integers(1, 4200 // bs).map(lambda n: n * bs), label="in_dim")
    warps = data.draw(st.sampled_from([w for w in (2, 4, 8) if w >= ksplit]), label="warps")
    glu = mode == "glu"
    rows = data.draw(st.sampled_from([2, 4] if glu else [1, 2, 3, 4]), label="rows")
    if gv.shared_bytes(wtype, in_dim, rows, warps, ksplit) > gv.MAX_STATIC_SMEM:
        rows, warps = (2 if glu else 1), ksplit
    # (the smallest CTA can still be too large: F32 GLU rows of 4104 with ksplit 8 need 49216 bytes)
    assume(gv.shared_bytes(wtype, in_dim, rows, warps, ksplit) <= gv.MAX_STATIC_SMEM)
    residual = {"residual": True, "in_place": "in_place", "both": "in_place"}.get(mode, False)
    _emulate_gemm(np.random.default_rng(seed), wtype, in_dim, out_dim, 1, 0, rows, warps, mode in ("bias", "both"),
                  residual, glu, ksplit=ksplit)


@pytest.mark.parametrize("wtype,in_dim,rows,warps,ksplit", [
    ("Q4_K", 14336, 2, 4, 4), ("Q6_K", 14336, 2, 8, 8), ("Q8_0", 14336, 2, 8, 8), ("Q6_K", 14336, 2, 4, 4),
    ("Q8_0", 4096, 2, 4, 2), ("Q6_K", 1536, 2, 4, 2), ("Q8_0", 576, 3, 4, 4), ("F16", 14336, 2, 8, 8)])
def test_gemv_split_k_emulated_at_real_row_lengths(wtype, in_dim, rows, warps, ksplit):
    """The dispatcher's kinds of split at real row lengths: one-tile slices copied with cp.async
    (Q4_K/Q6_K/Q8_0 at 14336), register-pipelined multi-tile slices (Q6_K s4, F16), Q6_K slices at a
    4-byte phase, a short last slice and an idle warp (Q8_0 576: 3 rounds in 4 slices)."""
    _emulate_gemm(np.random.default_rng(in_dim + ksplit), wtype, in_dim, 5, 1, 0, rows, warps, True, "in_place", False,
                  ksplit=ksplit)


def test_emulator_catches_cp_async_misuse():
    """The checks the split-K tests rely on: reading a cp.async destination before cp.async.wait_all
    (or another lane's copy before a barrier) is reported, as is a copy from outside an allocation."""
    from ptx_gen.builder import Module
    from ptx_gen.emulator import EmulatorError

    def kernel(wait: bool, sync: bool, other_lane: bool):
        m = Module("sm_90")
        k = m.kernel("t", [("src", "u64"), ("dst", "u64")])
        lane = k.and_(k.tid(), 31)
        buf = k.shared_array("t_buf", "u8", 512)
        k.cp_async(k.add(buf, k.shl(lane, 4)), k.add(k.global_ptr("src"), k.cvt(k.shl(lane, 4), "u64")))
        if wait:
            k.cp_async_wait_all()
        if sync:
            k.bar_warp_sync()
        src_lane = k.xor(lane, 1) if other_lane else lane
        v = k.load("shared", "u32", k.add(buf, k.shl(src_lane, 4)))
        k.store("global", "u32", k.add(k.global_ptr("dst"), k.cvt(k.shl(lane, 2), "u64")), v)
        k.ret()
        return m.emit()

    data = np.arange(128, dtype=np.uint32)
    for wait, sync, other, ok in ((True, True, True, True), (True, False, False, True), (False, True, True, False),
                                  (True, False, True, False)):
        mem = Memory()
        src, dst = mem.alloc_array(data), mem.alloc(128)
        if ok:
            simt_run(kernel(wait, sync, other), grid=(1,), block=(32,), params=dict(src=src, dst=dst), memory=mem)
            lanes = np.arange(32) ^ (1 if other else 0)
            np.testing.assert_array_equal(mem.read(dst, np.uint32, 32), data[4 * lanes])
        else:
            with pytest.raises(EmulatorError, match="cp.async|race"):
                simt_run(kernel(wait, sync, other), grid=(1,), block=(32,), params=dict(src=src, dst=dst), memory=mem)
    mem = Memory()
    small, dst = mem.alloc_array(data[:100]), mem.alloc(128)
    with pytest.raises(EmulatorError, match="out-of-bounds"):
        simt_run(kernel(True, True, False), grid=(1,), block=(32,), params=dict(src=small, dst=dst), memory=mem)


@settings(max_examples=80, deadline=None)
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


@settings(max_examples=40, deadline=None)
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


def test_q6k_glu_offset_guard():
    """The fused gate/up Q6_K kernel addresses up rows by 32-bit offsets from a warp's first gate row:
    shapes past that go to the SIMT kernel (and the bound counts the last warp's 16 rows)."""
    from ptx_gen.kernels.gemv.gemv_mma import q6k_glu_offsets_fit
    from realizar.gpu.gemv import mma_config
    in_dim = 77824  # 304 blocks of 210 bytes a row
    row = in_dim // 256 * 210
    ffn = (2**31 - 224) // row - 16  # the largest that fits
    assert q6k_glu_offsets_fit(ffn, in_dim) and not q6k_glu_offsets_fit(ffn + 1, in_dim)
    assert (ffn + 16) * row + 224 < 2**31 <= (ffn + 17) * row + 224
    assert mma_config(ffn, in_dim, "Q6_K", 1000, glu=True) is not None
    assert mma_config(ffn + 1, in_dim, "Q6_K", 1000, glu=True) is None


def test_mma_config_balances_the_grid():
    """The tensor-core dispatcher: None where the kernel does not apply; else a shape that fits, with
    the busiest SM at most 1.25x the mean at the real decode shapes, and the sweep's best picks at the
    two FFN shapes (bench_gemv --sweep, H200)."""
    from ptx_gen.kernels.gemv.gemv_mma import layout
    from realizar.gpu.gemv import mma_config
    assert mma_config(4096, 4096, "F16") is None and mma_config(576, 576, "Q8_0") is None
    assert mma_config(4096, 2080, "Q4_0") is None  # rows not whole units of 256 values
    assert mma_config(4096, 3072, "Q6_K") is None  # Q6_K rows of 3072: blocks at different phases per row
    assert mma_config(576, 1536, "Q8_0") is None  # 36 CTAs on 132 SMs: the SIMT kernel
    assert not mma_config(4096, 4096, "Q6_K", 132, bulk_ok=True).bulk  # 2-byte aligned blocks: cp.async
    for out_dim, in_dim in ((4096, 14336), (14336, 4096), (4096, 4096), (6144, 4096), (28672, 4096), (2048, 8192)):
        for wt in MMA_TYPES:
            cfg = mma_config(out_dim, in_dim, wt, 132)
            ctas = -(-out_dim // (16 * cfg.tiles * cfg.mtiles))
            assert ctas / 132 / -(-ctas // 132) > 0.8, (out_dim, in_dim, wt, cfg)
            assert layout(wt, in_dim, cfg.mtiles, cfg.kparts, cfg.stages, cfg.tiles)["smem"] <= 227 * 1024
    assert mma_config(4096, 14336, "Q4_K", 132) == type(cfg)(1, 8, 2, 2)
    assert mma_config(14336, 4096, "Q8_0", 132) == type(cfg)(4, 2, 2, 2)
    # Q6_K: as the others, but the SIMT kernel for a vocabulary's worth of rows (Llama-3-8B's output)
    assert mma_config(4096, 14336, "Q6_K", 132) == type(cfg)(1, 8, 2, 2)
    assert mma_config(14336, 4096, "Q6_K", 132) == type(cfg)(4, 2, 2, 2)
    assert mma_config(128256, 4096, "Q6_K", 132) is None
    assert gemv_config(128256, 132, 4096, "Q6_K") == gemv_config(128256, 132, 4096, "Q6_K").__class__(4, 4, 2)


@pytest.mark.parametrize("wtype", MMA_TYPES)
def test_gemv_mma_dispatcher_picks_assemble_without_spills(wtype):
    """Every tensor-core launch shape the dispatcher picks at real decode shapes (and its widest warps at
    their 8-warp maximum) assembles for sm_80 and sm_90 (and tile-major for sm_89) without local-memory
    spills."""
    from realizar.gpu.gemv import MmaConfig, mma_config
    picks = {mma_config(o, i, wtype, 132) for o, i in ((4096, 14336), (14336, 4096), (4096, 4096), (28672, 4096),
                                                       (6144, 4096), (2048, 8192), (2048, 2048))}
    picks |= {mma_config(o, i, wtype, 132, glu=True) for o, i in ((14336, 4096), (8192, 2048))}
    picks.discard(None)
    picks.add(MmaConfig(8, 1, 2, 2))
    picks.add(MmaConfig(1, 8, 2, 2))
    for cfg in picks:
        in_dim = 14336 if 14336 % (256 * cfg.kparts) == 0 else 4096
        # GGUF rows on both targets; tile-major as LayerOps runs it (bulk copies and solo on sm_90)
        for sm, tiled in (("sm_80", False), ("sm_90", False), ("sm_80", True), ("sm_89", True), ("sm_90", True)):
            src = catalog.emit("gemv_mma", target=sm, wtype=wtype, in_dim=in_dim, mtiles=cfg.mtiles,
                               kparts=cfg.kparts, stages=cfg.stages, tiles=cfg.tiles, residual=True, tiled=tiled,
                               bulk=tiled and sm == "sm_90", solo=tiled)
            if tiled and sm == "sm_90":
                assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint" in src.ptx
            for r in assemble(src.ptx, sm):
                assert r.spill_stores == 0 and r.spill_loads == 0, (cfg, sm, tiled, r)


@settings(max_examples=30, deadline=None)
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


def test_activations_are_read_with_coherent_loads():
    """Under programmatic dependent launch a GEMV starts while the kernel writing its x still runs, and
    requests its weights before ``griddepcontrol.wait``; an ``ld.global.nc`` of x (read-only for the
    kernel's lifetime, so ptxas may move it above the wait) decoded the real SmolLM2 wrongly on the GPU.
    Only weight bytes (the SIMT kernel's L1::no_allocate loads) may use the non-coherent path."""
    for shape in catalog.spec("gemv").grid:
        for line in catalog.emit("gemv", target="sm_90", **shape).ptx.splitlines():
            if "ld.global.nc" in line:
                assert "L1::no_allocate" in line, (shape, line)
    for shape in catalog.spec("gemv_mma").grid:
        assert "ld.global.nc" not in catalog.emit("gemv_mma", target="sm_90", **shape).ptx, shape


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


@pytest.mark.parametrize("wtype", MMA_TYPES)
@pytest.mark.parametrize("out_dim", [1, 31, 32, 45, 64])
def test_tile_major_places_every_unit_where_the_kernel_reads_it(wtype, out_dim):
    """tile_major: row r's unit u at ((r // 32) * units + u) * 32 T + (r % 32) T (T = TILE_UNIT), zeros
    past out_dim; Q6_K: within each 16-row half of the tile (3360 bytes), row r's first 208 bytes at
    208 (r % 16) and its d at 3328 + 2 (r % 16); with glu, tile T holds gate rows 16 T.. then up rows
    16 T.. (the rows of outputs 16 T..16 T + 15)."""
    from ptx_gen.kernels.gemv.gemv_mma import TILE_ROWS, TILE_UNIT, UNIT_BYTES

    ub, tu, units = UNIT_BYTES[wtype], TILE_UNIT[wtype], 3
    assert tu == ub  # (no padding)
    raw = np.random.default_rng(out_dim).integers(1, 256, out_dim * units * ub, dtype=np.uint8)
    rows = raw.reshape(out_dim, units, ub)
    zero = np.zeros(tu, np.uint8)

    def unit(r, u, tile_row):
        if wtype in BLOCK32:  # re-encoded: scales, fifth bits in lane order, codes (see _tiled_b32_unit)
            return _swizzled(_tiled_b32_unit(rows[r, u], wtype), wtype, tile_row)
        return rows[r, u]

    def placed(t, base, tile_row):  # row tile_row's unit in the tile's unit starting at t[base]
        if wtype != "Q6_K":
            at = base + tile_row * tu
            return t[at:at + tu]
        half, i = divmod(tile_row, 16)
        at = base + 3360 * half
        return np.r_[t[at + 208 * i:at + 208 * i + 208], t[at + 3328 + 2 * i:at + 3328 + 2 * i + 2]]
    t = tile_major(raw, wtype, out_dim, 256 * units)
    n_t = -(-out_dim // TILE_ROWS)
    assert t.size == n_t * TILE_ROWS * units * tu
    for r in range(n_t * TILE_ROWS):
        for u in range(units):
            base = ((r // TILE_ROWS) * units + u) * TILE_ROWS * tu
            got = placed(t, base, r % TILE_ROWS)
            assert (got == (unit(r, u, r % TILE_ROWS) if r < out_dim else zero)).all(), (r, u)
    if out_dim % 2 == 0:  # [gate; up] with ffn = out_dim / 2 outputs
        ffn, half = out_dim // 2, TILE_ROWS // 2
        g = tile_major(raw, wtype, out_dim, 256 * units, glu=True)
        assert g.size == -(-ffn // half) * TILE_ROWS * units * tu
        for o in range(-(-ffn // half) * half):
            for u in range(units):
                base = ((o // half) * units + u) * TILE_ROWS * tu
                for which in (0, 1):
                    want = unit(which * ffn + o, u, which * half + o % half) if o < ffn else zero
                    assert (placed(g, base, which * half + o % half) == want).all(), (o, u, which)


def test_q6k_tile_major_rows_are_read_without_bank_conflicts():
    """Tile-major Q6_K: a staged half-tile's rows lie Q6K_ROW bytes apart, so that lane (g, t)'s A word
    4 m' + t of row g (g < 8, t < 4, each of the 12 code words m') lands in its own bank, every row
    16-byte aligned, and a tile's unit is exactly 32 rows of 210 bytes (no padding)."""
    from ptx_gen.kernels.gemv.gemv_mma_layout import Q6K_D, Q6K_HALF, Q6K_ROW, TILE_ROWS, TILE_UNIT, layout
    lay = layout("Q6_K", 4096, 1, 2, 2, 2, tiled=True)
    assert lay["stride"] == Q6K_ROW and Q6K_ROW % 16 == 0 and Q6K_HALF % 16 == 0
    for mi in range(12):
        banks = {(g * Q6K_ROW // 4 + 4 * mi + t) % 32 for g in range(8) for t in range(4)}
        assert len(banks) == 32, mi
    assert Q6K_D == 16 * Q6K_ROW and 2 * Q6K_HALF == TILE_ROWS * TILE_UNIT["Q6_K"] == TILE_ROWS * 210
    # (the 212-byte rows before: 53 words apart, 2-3 lanes a bank)
    assert len({(g * 53 + t) % 32 for g in range(8) for t in range(4)}) < 32


def _swizzled(unit: np.ndarray, wtype: str, tile_row: int) -> np.ndarray:
    """A unit as row ``tile_row`` of a tile holds it: Q4_1 rows 4..7 (mod 8) swap their 16-byte chunks
    in pairs (chunk c at c ^ 1), Q5_1 rows 2 j, 2 j + 1 (mod 8) keep chunk c at c ^ j."""
    key = {"Q4_1": (tile_row >> 2) & 1, "Q5_1": (tile_row >> 1) & 3}.get(wtype, 0)
    chunks = unit.reshape(-1, 16)
    return chunks[np.arange(len(chunks)) ^ key].reshape(-1)


def _tiled_b32_unit(unit: np.ndarray, wtype: str) -> np.ndarray:
    """A 256-value unit of GGUF blocks of a 32-value block type as tile-major weights hold it, written
    out block by block from the GGUF layout: the 8 d (Q4_1, Q5_1: d, m) fields, the 8 qh words with
    bit v moved to bit 8 (v % 4) + 4 (v // 16) + (v // 4) % 4, the 8 x 16 qs bytes."""
    bs, qs, qh, sc = {"Q4_0": (18, 2, None, 2), "Q4_1": (20, 4, None, 4), "Q5_0": (22, 6, 2, 2),
                      "Q5_1": (24, 8, 4, 4)}[wtype]
    blocks = [unit[bs * b:bs * (b + 1)] for b in range(8)]
    out = [b[:sc] for b in blocks]
    if qh is not None:
        for b in blocks:
            word = int.from_bytes(b[qh:qh + 4].tobytes(), "little")
            moved = sum(1 << (8 * (v % 4) + 4 * (v // 16) + (v // 4) % 4) for v in range(32) if word >> v & 1)
            out.append(np.frombuffer(moved.to_bytes(4, "little"), np.uint8))
    out += [b[qs:qs + 16] for b in blocks]
    return np.concatenate(out)


def test_lane_order_puts_each_code_words_fifth_bits_in_one_bit_of_each_byte():
    """lane_order_qh: the fifth bits of values 16 h + 4 t + i (i = 0..3) are bit 4 h + t of bytes 0..3."""
    from ptx_gen.kernels.gemv.gemv_mma_layout import lane_order_qh
    rng = np.random.default_rng(7)
    qh = rng.integers(1, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    got = lane_order_qh(qh)
    for a, b in zip(qh.tolist(), got.tolist()):
        for h in range(2):
            for t in range(4):
                want = [(a >> (16 * h + 4 * t + i)) & 1 for i in range(4)]
                assert [(b >> (8 * i + 4 * h + t)) & 1 for i in range(4)] == want
        assert bin(a).count("1") == bin(b).count("1")


def test_tile_major_rejects_wrong_sizes():
    with pytest.raises(ValueError, match="multiple of 256"):
        tile_major(np.zeros(10 * 144, np.uint8), "Q4_K", 10, 300)
    with pytest.raises(ValueError, match="needs in_dim a multiple of 256 and 1440 bytes"):
        tile_major(np.zeros(100, np.uint8), "Q4_K", 10, 256)
    with pytest.raises(ValueError, match="2 ffn rows"):
        tile_major(np.zeros(3 * 144, np.uint8), "Q4_K", 3, 256, glu=True)


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


def test_new_mma_types_policy():
    """The tensor-core GEMV takes Q4_0, Q4_1, Q5_0, Q5_1 and Q5_K at the real decode shapes, 32-row warps
    and the fused gate/up GEMV included; where 8-warp CTAs of 32-row warps leave SMs idle (14336 rows:
    112 CTAs on 132 SMs) Q4_0, Q5_0 and Q5_1 take the smaller CTAs that streamed fastest there
    (bench_gemv --mma-sweep, H200; Q5_0 in 16-row warps since its re-encoding); on an
    sm_90 device LayerOps stores them tile-major (Q5_K rows where Q4_K's are), Q4_0 and Q5_0 there in
    16-row warps where each warp streams 4 units or more (B32_ONE_TILE), and the emulated GEMV of
    such an upload matches the oracle."""
    from realizar import cuda
    from realizar.gpu.gemv import MmaConfig, mma_config
    from realizar.gpu.ops import LayerOps
    for wt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K"):
        for o, i in ((4096, 14336), (14336, 4096), (4096, 4096), (28672, 4096)):
            assert isinstance(mma_config(o, i, wt, 132), MmaConfig), (wt, o, i)
        assert mma_config(4096, 14336, wt, 132) == MmaConfig(1, 8, 2, 2)
        assert mma_config(14336, 4096, wt, 132, glu=True) is not None
    for wt, cfg in (("Q4_0", MmaConfig(2, 4, 2, 2)), ("Q4_1", MmaConfig(4, 2, 2, 2)), ("Q5_0", MmaConfig(1, 4, 2, 1)),
                    ("Q5_1", MmaConfig(1, 4, 2, 1)), ("Q5_K", MmaConfig(4, 2, 2, 2))):
        assert mma_config(14336, 4096, wt, 132) == cfg, wt
    ops = LayerOps(cuda.EmulatedDevice(sm_count=132))
    for wt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K"):
        assert ops.weight_layout(4096, 14336, wt) == "tiles"
        cfg = ops.mma_config(4096, 14336, wt, layout="tiles")
        assert cfg == MmaConfig(1, 8, 2, 1) if wt in ("Q4_0", "Q5_0") else cfg.solo, (wt, cfg)
        assert ops.mma_config(4096, 4096, wt, layout="tiles").tiles == 2  # (2 units a warp)
    assert ops.weight_layout(14336, 4096, "Q4_1") == "tiles"
    assert ops.weight_layout(14336, 4096, "Q5_K") == ops.weight_layout(14336, 4096, "Q4_K")
    # where the DRAM is fast for the SMs (an H200's memory clock and bus width) Q4_0 and Q5_0 keep
    # 32-row warps there, with bulk copies; elsewhere the picks are the H100's
    from realizar.gpu.gemv import dram_bytes_per_sm_clock
    h200 = LayerOps(cuda.EmulatedDevice(sm_count=132, attributes={"MEMORY_CLOCK_RATE": 3_125_000,
                                                                  "GLOBAL_MEMORY_BUS_WIDTH": 6144}))
    assert 18 < dram_bytes_per_sm_clock(h200.device) < 19 and 12 < dram_bytes_per_sm_clock(ops.device) < 13
    assert h200.fast_dram and not ops.fast_dram
    # (and Q4_1 / Q5_1, whose swizzled tile-major rows have no padded stages, take bulk copies there too;
    # Q4_0 and Q4_1 in the 16-warp CTAs of FAST_DRAM_WIDE). The one-column GEMV takes FAST_DRAM_AHEAD_*'s
    # picks (one ring stage before the grid wait) where they have one, the columns kernel's base the others
    from realizar.gpu.gemv import FAST_DRAM_AHEAD_UNBALANCED, FAST_DRAM_AHEAD_WIDE, FAST_DRAM_UNBALANCED, FAST_DRAM_WIDE
    for wt in ("Q4_0", "Q5_0", "Q4_1", "Q5_1"):
        assert h200.mma_config(4096, 14336, wt, layout="tiles") == FAST_DRAM_AHEAD_WIDE[wt]
        assert h200.mma_config(4096, 14336, wt, layout="tiles", cols=True) == FAST_DRAM_WIDE.get(
            wt, MmaConfig(1, 8, 2, 2, bulk=True, solo=True))
        assert h200.mma_config(14336, 4096, wt, layout="tiles") == FAST_DRAM_AHEAD_UNBALANCED.get(
            wt, FAST_DRAM_UNBALANCED.get(wt, ops.mma_config(14336, 4096, wt, layout="tiles")))
        assert h200.mma_config(14336, 4096, wt, layout="tiles", cols=True) == FAST_DRAM_UNBALANCED.get(
            wt, ops.mma_config(14336, 4096, wt, layout="tiles"))
    assert ops.mma_config(4096, 14336, "Q4_1", layout="tiles") == MmaConfig(1, 8, 2, 2, solo=True)
    # there, 14336 x 4096 grids that all fit the SMs' shared memory at once (FAST_DRAM_UNBALANCED): Q5_K 448
    # CTAs of 4 warps, 4 an SM (one x slot a warp); Q5_0 224 of 2 x 2 warps with 3 stages, two an SM
    # (48-byte table rows); Q5_1 448 of 3 warps; Q6_K 224 of 4 x 2 warps of 16 rows
    from ptx_gen.kernels.gemv.gemv_mma import layout as mma_layout
    for wt, cfg in FAST_DRAM_UNBALANCED.items():
        smem = mma_layout(wt, 4096, cfg.mtiles, cfg.kparts, cfg.stages, cfg.tiles, True)["smem"] + 1024
        assert -(-14336 // (16 * cfg.tiles * cfg.mtiles)) <= 132 * (228 * 1024 // smem), (wt, cfg)
    assert h200.mma_config(14336, 4096, "Q5_K", layout="tiles") == MmaConfig(2, 4, 2, 2, bulk=True, ahead=1)
    assert h200.mma_cols_config(14336, 4096, "Q5_K", 1, layout="tiles") == MmaConfig(1, 4, 2, 2)
    assert h200.mma_config(14336, 4096, "Q5_K", glu=True, layout="glu-tiles") == ops.mma_config(
        14336, 4096, "Q5_K", glu=True, layout="glu-tiles")  # (the fused gate/up GEMV keeps its pick)
    # tile-major Q4_1 at 14336 rows: Q4_0's CTAs of 2 x 4 warps (TILED_UNBALANCED); on GGUF rows the 8-warp pick
    assert ops.mma_config(14336, 4096, "Q4_1", layout="tiles") == MmaConfig(2, 4, 2, 2)
    assert ops.mma_config(14336, 4096, "Q4_1") == MmaConfig(4, 2, 2, 2)
    for wt in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"):
        for o, i in ((4096, 14336), (14336, 4096), (4096, 4096)):
            tables = ((FAST_DRAM_AHEAD_WIDE, FAST_DRAM_WIDE) if o < i
                      else (FAST_DRAM_AHEAD_UNBALANCED, FAST_DRAM_UNBALANCED))
            want = (tables[0].get(wt) or tables[1].get(wt)) if o != i else None
            assert h200.mma_config(o, i, wt, layout="tiles") == (want or ops.mma_config(o, i, wt, layout="tiles")), \
                (wt, o, i)
            # (one stage ahead only where a warp has units past its ring: not, e.g., Q8_0 at 4096 x 4096)
            assert not h200.mma_config(o, i, wt, layout="tiles").ahead or -(-(i // 256) // want.kparts) > want.stages
    sm80 = LayerOps(cuda.EmulatedDevice(sm_count=108, target="sm_80", attributes={"MEMORY_CLOCK_RATE": 3_125_000,
                                                                                   "GLOBAL_MEMORY_BUS_WIDTH": 6144}))
    assert sm80.mma_config(4096, 14336, "Q5_0", layout="tiles").tiles == 1  # (no bulk copies before sm_90)
    from types import SimpleNamespace
    small = LayerOps(cuda.EmulatedDevice(sm_count=2))
    rng = np.random.default_rng(9)
    for wt in ("Q4_1", "Q5_0", "Q5_1"):
        out_dim, in_dim = 64, 512
        raw = random_weight(rng, wt, out_dim, in_dim)
        from ptx_gen.ggml import GGMLType
        t = SimpleNamespace(data=raw, ggml_type=int(GGMLType[wt]), shape=(out_dim, in_dim), name=wt)
        w = small.upload(t)
        assert w.layout == "tiles", w
        x = rng.standard_normal(in_dim).astype(np.float32)
        out = small.buffer(out_dim)
        out.poison()
        small.gemv(w, small.to_device(x), out)
        ref = dequant(raw, wt, out_dim, in_dim).astype(np.float64) @ x
        scl = np.abs(dequant(raw, wt, out_dim, in_dim).astype(np.float64)) @ np.abs(x)
        y = out.to_numpy()
        assert np.isfinite(y).all() and (np.abs(y - ref) / scl).max() < 1e-6


@settings(max_examples=40, deadline=None)
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


@pytest.mark.parametrize("wtype", MMA_TYPES)
def test_fast_dram_picks_assemble_without_spills(wtype):
    """The H200's picks at the 8B shapes (FAST_DRAM_UNBALANCED, FAST_DRAM_WIDE: bulk copies, 3-stage rings)
    and the same with L2 prefetches of one unit past the ring (l2pre, which no pick takes) assemble for
    sm_90 as LayerOps launches them, with and without a residual, without spills."""
    from realizar import cuda
    from realizar.gpu.ops import LayerOps
    h200 = LayerOps(cuda.EmulatedDevice(sm_count=132, attributes={"MEMORY_CLOCK_RATE": 3_125_000,
                                                                  "GLOBAL_MEMORY_BUS_WIDTH": 6144}))
    for o, i in ((4096, 14336), (14336, 4096), (4096, 4096)):
        layout = h200.weight_layout(o, i, wtype)
        pick = h200.mma_config(o, i, wtype, layout=layout)
        assert not pick.l2pre
        for cfg, res in itertools.product((pick, dataclasses.replace(pick, l2pre=1)), (False, True)):
            if cfg.l2pre and layout == "rows":
                continue
            k = h200._mma_kernel(GpuWeightStub(wtype, i, layout), cfg, residual=res)
            past_ring = -(-(i // 256) // cfg.kparts) > cfg.stages  # (a warp has units past its ring)
            assert ("cp.async.bulk.prefetch.L2" in k.source.ptx) == bool(cfg.l2pre and past_ring), (o, i, cfg)
            for r in assemble(k.source.ptx, "sm_90"):
                assert r.spill_stores == 0 and r.spill_loads == 0, (o, i, cfg, r)


class GpuWeightStub:
    """What ``GemvOps._mma_kernel`` reads of a weight."""

    def __init__(self, wtype: str, in_dim: int, layout: str):
        self.wtype, self.in_dim, self.layout = wtype, in_dim, layout


def test_wide_ctas_policy():
    """On sm_90, tile-major Q4_K rows that 8-warp CTAs spread unevenly over the SMs (14336 x 4096: 112 CTAs
    on 132 SMs) take the 4-warp CTA of ``TILED_UNBALANCED``; grids of one 32-row tile a CTA and an SM
    (4096 x 14336: 128 CTAs) the 16-warp CTA of ``WIDE_BALANCED`` (3 or 4 of the 56 units a warp) where each
    warp keeps two units at least; GGUF rows, the fused gate/up GEMV, other types and sm_80 keep their
    picks."""
    from realizar import cuda
    from realizar.gpu.gemv import TILED_UNBALANCED, WIDE_BALANCED, MmaConfig
    from realizar.gpu.ops import LayerOps
    ops = LayerOps(cuda.EmulatedDevice(sm_count=132))
    assert TILED_UNBALANCED["Q4_K"] == MmaConfig(1, 4, 2, 2)
    assert ops.weight_layout(14336, 4096, "Q4_K") == "tiles"
    assert ops.mma_config(14336, 4096, "Q4_K", layout="tiles") == TILED_UNBALANCED["Q4_K"]
    assert ops.mma_config(14336, 4096, "Q4_K") == MmaConfig(4, 2, 2, 2)  # (GGUF rows)
    assert ops.mma_config(4096, 14336, "Q4_K", layout="tiles") == WIDE_BALANCED["Q4_K"]
    assert WIDE_BALANCED["Q4_K"] == MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True)
    assert ops.mma_config(4096, 4096, "Q4_K", layout="tiles") == MmaConfig(1, 8, 2, 2, bulk=True, solo=True)
    assert not ops.mma_config(4096, 14336, "Q4_K").late  # (GGUF rows)
    assert not ops.mma_config(4096, 14336, "Q4_K", glu=True, layout="glu-tiles").late
    assert not ops.mma_config(4096, 14336, "Q4_1", layout="tiles").late
    assert not ops.mma_config(14336, 4096, "Q4_K", glu=True, layout="glu-tiles").late
    assert not ops.mma_config(14336, 4096, "Q4_0", layout="tiles").late
    old = LayerOps(cuda.EmulatedDevice(sm_count=132, target="sm_80"))
    cfg = old.mma_config(14336, 4096, "Q4_K", layout="tiles")
    assert (cfg.mtiles, cfg.kparts, cfg.bulk, cfg.late) == (4, 2, False, False)
    assert old.mma_config(4096, 14336, "Q4_K", layout="tiles") == MmaConfig(1, 8, 2, 2, solo=True)
