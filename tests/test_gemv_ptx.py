"""CPU tests of the SIMT GEMV/GEMM kernels (plain and split-K): every configuration assembles with
ptxas for sm_80 and sm_90 over hypothesis-drawn shapes and does not spill at real shapes, the
dispatcher's picks and the row plans/splits keep their invariants, bad weights are rejected before
touching a GPU, and (through the PTX emulator ``ptx_gen.emulator``) every kernel matches its float64
oracle on small shapes, with memcheck/racecheck-style checks on every access (cp.async misuse
included). The tensor-core GEMV is in tests/test_gemv_mma_ptx.py (emulated runs),
tests/test_gemv_mma_policy.py (its dispatcher) and tests/test_gemv_mma_layout.py (tile-major
weights); the other layer kernels are in tests/test_layer_kernels_ptx.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.gemv import gemv as gv
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_QUANTS, WEIGHT_TYPES, type_info
from realizar.gpu.gemv import gemv_config
from tests.layer_oracles import dequant, random_weight, silu
from ptx_gen.emulator import Memory, run as simt_run
from tests.layer_kernels_ptx_cases import _assemble_all, _in_dims, _pad16
from tests.helpers import examples, tiered


# ---------------------------------------------------------------------------------------------
# ptxas over drawn shapes


@settings(max_examples=examples(30), deadline=None)
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


@settings(max_examples=examples(15), deadline=None)
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


@pytest.mark.parametrize("wtype", tiered(WEIGHT_TYPES, {0}))
@pytest.mark.parametrize("in_dim", [4096, 14336])
def test_gemv_family_no_spills_at_real_shapes(wtype, in_dim):
    """4096x4096 and 4096x14336 (both directions: in_dim 4096 and 14336): the unsplit configurations,
    the fused gate/up variant and the prefill GEMM; the split ones are in the next test."""
    for rows in (1, 2, 4):
        _assemble_all("gemv", wtype=wtype, in_dim=in_dim, rows=rows, warps=4)
    _assemble_all("gemv", wtype=wtype, in_dim=in_dim, rows=4, warps=4, residual=True, bias=True)
    _assemble_all("gemv", wtype=wtype, in_dim=in_dim, rows=2, warps=4, glu=True)
    _assemble_all("gemm", wtype=wtype, in_dim=in_dim, rows=2, warps=4, tokens=4)


@pytest.mark.parametrize("wtype", tiered(WEIGHT_TYPES, {0}))
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


@settings(max_examples=examples(200), deadline=None)
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
    # docs/performance/gemv.md: "Why each pick")
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


@settings(max_examples=examples(40), deadline=None)
@given(data=st.data(), wtype=st.sampled_from(WEIGHT_TYPES), out_dim=st.integers(1, 9), rows=st.sampled_from([1, 2, 3, 4]),
       warps=st.sampled_from([1, 2]), bias=st.booleans(), residual=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_gemv_emulated_matches_oracle(data, wtype, out_dim, rows, warps, bias, residual, seed):
    bs = 256 if wtype in K_QUANTS else (8 if wtype in DENSE else 32)
    in_dim = data.draw(st.integers(1, 2560 // bs).map(lambda n: n * bs))
    _emulate_gemm(np.random.default_rng(seed), wtype, in_dim, out_dim, 1, 0, rows, warps, bias, residual, False)


@settings(max_examples=examples(15), deadline=None)
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


@settings(max_examples=examples(40), deadline=None)
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
