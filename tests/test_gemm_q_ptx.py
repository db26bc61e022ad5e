"""CPU tests of ``gemm_q`` (Y = X W^T straight from GGUF weights, tensor cores, M = 1..128) and its host op
``GemmOps.gemm_q``: ptxas on sm_80/89/90 without spills at the real shapes; in the PTX emulator, over
hypothesis-drawn types, layouts, token counts, shapes, CTA shapes and epilogues, every element of the
NaN-poisoned output against a float64 oracle over the exactly dequantized weights (GGUF's reference
dequantization) and the f16 X, nothing outside the output written; bad calls raise clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.kernels.gemm.gemm_q import MTS, check_shape
from ptx_gen.kernels.gemv.gemv_mma_layout import MMA_TYPES, tile_major
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_QUANTS, WEIGHT_TYPES
from ptx_gen.ptxas import assemble
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.gemm import gemm_q_config
from realizar.gpu.ops import GpuWeight, LayerOps
from tests.layer_oracles import dequant, random_weight
from tests.helpers import examples, tiered

TARGETS = ("sm_80", "sm_89", "sm_90")
MS = (1, 2, 3, 7, 8, 9, 16, 33, 64, 100, 128)
CASES = [(wt, lay) for wt in WEIGHT_TYPES for lay in ("rows", "tiles", "glu-tiles") if lay == "rows" or wt in MMA_TYPES]


def _silu(g):
    return g / (1 + np.exp(-g))


def _mt(m: int) -> int:
    return next(t for t in MTS if t >= m)


def _block(wtype: str, layout: str) -> int:
    return 256 if wtype in K_QUANTS or layout != "rows" else (8 if wtype in DENSE else 32)


def _oracle(raw, wtype, out_dim, in_dim, x, glu, bias, res, out_f16):
    """(reference, scale of what was summed, tolerance relative to it)."""
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    xs = x.astype(np.float64)
    full, scale = xs @ w.T, np.abs(xs) @ np.abs(w).T
    if glu:
        ffn = out_dim // 2
        g, u = full[:, :ffn], full[:, ffn:]
        ref = _silu(g) * u
        scale = (np.abs(g) + scale[:, :ffn]) * (np.abs(u) + scale[:, ffn:])
    else:
        ref = full + (bias if bias is not None else 0) + (res if res is not None else 0)
        scale = scale + (np.abs(bias) if bias is not None else 0) + (np.abs(res) if res is not None else 0)
    # weights rounded to f16 (2**-11 relative each), f32 products and sums; f16 output: one more rounding
    return ref, scale, 2.0 ** -9 if out_f16 else 2.0 ** -10


def _run(wtype, layout, out_dim, in_dim, m, rng, *, mt=None, warps=1, kparts=1, stages=2, **kw):
    run_emulated("gemm_q", dict(mt=mt or _mt(m), warps=warps, kparts=kparts, stages=stages), wtype, layout, out_dim,
                 in_dim, m, rng, **kw)


def run_emulated(kernel: str, shape: dict, wtype, layout, out_dim, in_dim, m, rng, *, bias=False, residual=None,
                 out_f16=False, glu=False, lda=None, ldy=None, x=None, max_steps: int | None = None,
                 ctas: int | None = None):
    """Run the quantized GEMM ``kernel`` (gemm_q, gemm_wg, gemm_ws; its launch ``shape``) in the emulator over a
    random ``wtype`` weight in ``layout`` and ``m`` tokens, and check every element against :func:`_oracle`,
    nothing written past the output (``ldy`` > the columns: nor between rows). ``max_steps``: the emulator's
    bound on steps (its default where None). ``ctas``: gemm_ws with ``streamk``, the CTAs sharing out the tiles'
    chunks of K."""
    raw = random_weight(rng, wtype, out_dim, in_dim)
    data = raw if layout == "rows" else tile_major(raw, wtype, out_dim, in_dim, glu=layout == "glu-tiles")
    data = np.concatenate([data, np.zeros(-data.size % 16, np.uint8)])
    kern = catalog.emit(kernel, target="sm_90", wtype=wtype, in_dim=in_dim, layout=layout, bias=bias,
                        residual=residual is not None, out_f16=out_f16, glu=glu, **shape)
    lda = lda or in_dim
    cols = out_dim // 2 if glu else out_dim
    ldy = ldy or cols
    if x is None:
        x = ((rng.standard_normal((m, lda)) + 0.1) / (64 if out_f16 else 1)).astype(np.float16)  # (f16 range)
    b = rng.standard_normal(cols).astype(np.float32)
    r = rng.standard_normal((m, ldy)).astype(np.float32)
    ytype = np.float16 if out_f16 else np.float32
    mem = Memory()
    pad = 64  # poisoned elements past the output, checked untouched
    y0 = np.full(m * ldy + pad, np.nan, ytype)
    if residual == "in_place":
        y0[: m * ldy] = r.reshape(-1)
    y = mem.alloc_array(y0)
    params = dict(w=mem.alloc_array(data), x=mem.alloc_array(x), y=y, m=m, n=out_dim, lda=lda, ldy=ldy)
    if shape.get("xtma"):  # (gemm_ws: X by a tensor map, the emulator's encoding)
        from ptx_gen.emulator import tensormap

        box = shape["mt"] // shape.get("xcast", 1)  # (X multicast: each CTA of a pair copies half of a box)
        params["xmap"] = tensormap.encode(tensormap.TensorMap2d(params["x"], in_dim, m, 2 * lda, 64, box, 2, 128))
    if bias:
        params["bias"] = mem.alloc_array(b)
    if residual is not None:
        params["residual"] = y if residual == "in_place" else mem.alloc_array(r)
    grid = (-(-cols // kern.meta["rows_per_cta"]), -(-m // kern.meta["mt"]))
    xcast = shape.get("xcast", 1) if kernel == "gemm_ws" else 1
    grid = (-(-grid[0] // xcast) * xcast, grid[1])  # (whole clusters along the rows)
    kparts = shape.get("kparts", 1) if kernel == "gemm_ws" else 1  # (gemm_wg's kparts split K inside a CTA)
    streamk = shape.get("streamk", False) and kernel == "gemm_ws"
    if kparts > 1 or streamk:  # (gemm_ws with K split over grid z or Stream-K: the partial sums' room, counters at zero
        # and left at zero)
        tiles = grid[0] * grid[1]
        params["part"] = mem.alloc_array(np.full(tiles * kern.meta["part_floats"], np.nan, np.float32))
        params["counters"] = counters = mem.alloc_array(np.zeros(tiles, np.uint32))
        if streamk:
            params["ntiles"] = grid[0]
        grid = (ctas, 1, 1) if streamk else (*grid, kparts)
    simt_run(kern.ptx, grid=grid, block=(kern.meta["block"],), params=params, memory=mem,
             shared_bytes=kern.launch.dyn_smem, **({} if max_steps is None else {"max_steps": max_steps}))
    if kparts > 1 or streamk:
        assert not mem.read(counters, np.uint32, tiles).any(), "counters not left at zero"
    flat = mem.read(y, ytype, m * ldy + pad).astype(np.float64)
    assert np.isnan(flat[m * ldy:]).all(), "wrote past the output"
    out = flat[: m * ldy].reshape(m, ldy)
    ref, scale, tol = _oracle(raw, wtype, out_dim, in_dim, x[:, :in_dim], glu, b if bias else None,
                              r[:, :cols] if residual is not None else None, out_f16)
    body = out[:, :cols]
    assert np.isfinite(body).all(), f"unwritten (NaN-poisoned) outputs at {np.argwhere(~np.isfinite(body))[:4].tolist()}"
    if ldy > cols and residual != "in_place":
        assert np.isnan(out[:, cols:]).all(), "wrote past the output columns"
    err = np.abs(body - ref) / (scale + 1e-30)
    assert err.max() < tol, (f"{kernel} {shape} {wtype} {layout} {out_dim}x{in_dim} m={m}: max relative error "
                             f"{err.max():.2e} at {np.unravel_index(err.argmax(), err.shape)}")


# ---------------------------------------------------------------------------------------------
# emulated runs against the oracle


@settings(max_examples=examples(40), deadline=None)
@given(data=st.data(), case=st.sampled_from(CASES), m=st.sampled_from(MS), seed=st.integers(0, 2**32 - 1))
def test_gemm_q_matches_oracle(data, case, m, seed):
    wtype, layout = case
    blk = _block(wtype, layout)
    in_dim = blk * data.draw(st.integers(1, max(1, 768 // blk)))
    glu = layout == "glu-tiles" or data.draw(st.booleans())
    out_dim = (2 if glu else 1) * data.draw(st.integers(1, 40))
    nc = -(-in_dim // 256)
    kparts = data.draw(st.sampled_from([k for k in (1, 2, 4) if k <= nc]))
    warps = data.draw(st.sampled_from([1, 2]))
    stages = data.draw(st.sampled_from([2, 3]))
    epi = "plain" if glu else data.draw(st.sampled_from(["plain", "bias", "residual", "in_place", "f16", "bias_res"]))
    _run(wtype, layout, out_dim, in_dim, m, np.random.default_rng(seed), warps=warps, kparts=kparts, stages=stages,
         bias="bias" in epi, residual={"residual": "buffer", "in_place": "in_place", "bias_res": "buffer"}.get(epi),
         out_f16="f16" in epi or (glu and data.draw(st.booleans())), glu=glu)


@pytest.mark.parametrize("wtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q4_0", "Q5_K"])
def test_gemm_q_main_types(wtype):
    """The benchmark models' types, both layouts, a ragged M in a larger token tile, strided X and Y."""
    rng = np.random.default_rng(7)
    _run(wtype, "rows", 37, 512, 9, rng, warps=2, kparts=2, lda=520, ldy=40, bias=True)
    _run(wtype, "tiles", 48, 768, 33, rng, mt=64, stages=3, residual="in_place")
    _run(wtype, "glu-tiles", 34, 256, 3, rng, glu=True)


def test_gemm_q_big_token_tile():
    _run("Q4_K", "tiles", 20, 512, 128, np.random.default_rng(1), mt=128, kparts=2)
    _run("Q8_0", "rows", 16, 288, 100, np.random.default_rng(2), mt=128, warps=2)


def test_gemm_q_rows_of_partial_chunks():
    """32-value block rows of a length that is no multiple of 256 (SmolLM2's 576): chunks straddle rows in
    memory, the last chunk is partial; and dense rows of 8-value tails."""
    rng = np.random.default_rng(3)
    for wtype in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"):
        _run(wtype, "rows", 19, 576, 5, rng, kparts=2)
    for wtype in DENSE:
        _run(wtype, "rows", 9, 264, 2, rng)


def test_nan_in_unused_x_rows_and_columns_is_ignored():
    """X past K (lda > K) and tokens past M are never mixed into written outputs."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((3, 320)) + 0.1).astype(np.float16)
    x[:, 288:] = np.nan
    _run("Q8_0", "rows", 24, 288, 3, rng, lda=320, x=x)
    _run("Q4_0", "rows", 24, 288, 3, rng, lda=320, x=x, mt=16)


# ---------------------------------------------------------------------------------------------
# ptxas


REAL = [("Q4_K", 4096, "tiles"), ("Q4_K", 14336, "tiles"), ("Q6_K", 4096, "tiles"), ("Q6_K", 14336, "rows"),
        ("Q8_0", 4096, "tiles"), ("Q8_0", 2048, "rows"), ("Q4_1", 576, "rows"), ("Q4_1", 4096, "tiles"),
        ("Q4_0", 4096, "rows"), ("Q5_K", 4096, "glu-tiles"), ("Q5_K", 14336, "rows"), ("F16", 2048, "rows"),
        ("Q5_0", 1536, "rows"), ("Q5_1", 4096, "rows"), ("BF16", 576, "rows"), ("F32", 2048, "rows")]


@pytest.mark.parametrize("wtype,in_dim,layout", tiered([
    pytest.param(*c, marks=pytest.mark.xfail(strict=True, reason="known: Q5_0 at mt=128 needs 255+ registers "
                                                                 "(32 bytes spill on sm_90)"))
    if c[0] == "Q5_0" else c for c in REAL], {0}, unpack=True))
def test_no_spills_at_real_shapes(wtype, in_dim, layout):
    """Every token tile and the policy's CTA shapes at the 8B / 1B shapes assemble without spills."""
    glu = layout == "glu-tiles"
    for i, mt in enumerate(MTS):
        cfg = gemm_q_config(wtype, in_dim, 4096, mt)
        flags = {"glu": True} if glu else ({"residual": True} if i % 2 else {"bias": True, "out_f16": True})
        for tgt in TARGETS:
            k = catalog.emit("gemm_q", target=tgt, wtype=wtype, in_dim=in_dim, layout=layout, mt=mt, warps=cfg.warps,
                             kparts=cfg.kparts, stages=cfg.stages, **flags)
            (rep,) = assemble(k.ptx, tgt)
            assert not rep.spills, f"gemm_q {wtype} {in_dim} {layout} mt={mt} {cfg} spills on {tgt}: {rep.log}"


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="mt"):
        check_shape("Q4_K", 4096, "rows", 12, 4, 1, 4)
    with pytest.raises(ValueError, match="tile-major"):
        check_shape("Q8_0", 4096 + 32, "tiles", 8, 4, 1, 4)
    with pytest.raises(ValueError, match="K parts"):
        check_shape("Q4_K", 256, "rows", 8, 1, 2, 4)
    with pytest.raises(ValueError, match="bias"):
        catalog.emit("gemm_q", glu=True, bias=True)
    with pytest.raises(ValueError, match="glu-tiles"):
        catalog.emit("gemm_q", layout="glu-tiles")


# ---------------------------------------------------------------------------------------------
# host op on the emulated device


def _host_case(ops, rng, wtype, out_dim, in_dim, m, layout="rows", glu=False):
    raw = random_weight(rng, wtype, out_dim, in_dim)
    w = GpuWeight(data=raw, ggml_type=wtype, shape=(out_dim, in_dim), layout=layout, device=ops.device)
    x = (rng.standard_normal((m, in_dim)) + 0.1).astype(np.float16)
    return raw, w, x


def test_host_gemm_q_on_the_emulated_device():
    ops = LayerOps(cuda.EmulatedDevice())
    rng = np.random.default_rng(5)  # (residual in place, then [gate; up] rows through the SwiGLU epilogue)
    m, n, kdim = 5, 40, 512
    raw, w, x = _host_case(ops, rng, "Q4_K", n, kdim, m)
    xb = ops.to_device(x)
    y = ops.to_device(np.full(m * n, np.nan, np.float32))
    ops.gemm_q(xb, w, y, m)
    got = y.copy_to_host(np.empty(m * n, np.float32)).reshape(m, n)
    ref, scale, tol = _oracle(raw, "Q4_K", n, kdim, x, False, None, None, False)
    assert (np.abs(got - ref) / scale).max() < tol
    ops.gemm_q(xb, w, y, m, residual=y)
    got2 = y.copy_to_host(np.empty(m * n, np.float32)).reshape(m, n)
    assert (np.abs(got2 - 2 * ref) / (2 * scale)).max() < tol
    yg = ops.to_device(np.full(m * n // 2, np.nan, np.float32))
    ops.gemm_q(xb, w, yg, m, glu=True)
    got3 = yg.copy_to_host(np.empty(m * n // 2, np.float32)).reshape(m, n // 2).astype(np.float64)
    ref3, scale3, tol3 = _oracle(raw, "Q4_K", n, kdim, x, True, None, None, False)
    assert (np.abs(got3 - ref3) / scale3).max() < tol3


def test_host_gemm_q_checks_its_arguments():
    ops = LayerOps(cuda.EmulatedDevice())
    rng = np.random.default_rng(6)
    _, w, x = _host_case(ops, rng, "Q8_0", 16, 256, 4)
    xb = ops.to_device(x)
    y = ops.to_device(np.zeros(4 * 16, np.float32))
    with pytest.raises(ShapeError, match="m"):
        ops.gemm_q(xb, w, y, 0)
    with pytest.raises(ShapeError, match="128"):
        ops.gemm_q(xb, w, y, 129)
    with pytest.raises(ShapeError, match="GpuWeight"):
        ops.gemm_q(xb, "w", y, 4)
    with pytest.raises(ShapeError, match="bias"):
        ops.gemm_q(xb, w, y, 4, glu=True, bias=y)
    with pytest.raises(ShapeError, match="ldy"):
        ops.gemm_q(xb, w, y, 4, ldy=8)
    with pytest.raises(ShapeError):  # too small an output buffer
        ops.gemm_q(xb, w, ops.to_device(np.zeros(10, np.float32)), 4)
    wt = GpuWeight(data=random_weight(rng, "Q8_0", 32, 256), ggml_type="Q8_0", shape=(32, 256), layout="glu-tiles",
                   device=ops.device)
    with pytest.raises(ShapeError, match="glu"):
        ops.gemm_q(xb, wt, y, 4)


@pytest.mark.full
def test_sanitizer_cases_run_on_the_emulator(monkeypatch):
    """tools/sanitize_layers.py's gemm_q, sample_rows and gemv_cols cases (what compute-sanitizer runs on
    the GPU) pass their own oracle checks on the emulated device, with its memcheck and racecheck on."""
    import tools.sanitize_layers as sanitize

    import realizar.cuda.emulated as emulated
    from realizar import cuda

    monkeypatch.setattr(emulated, "_default", cuda.EmulatedDevice(sm_count=4))
    monkeypatch.setenv("REALIZAR_DEVICE", "emulate")
    sanitize.gemm_q_cases(np.random.default_rng(2), sanitize.GEMM_Q_CASES_SMALL)
    sanitize.sample_cases(np.random.default_rng(3), sanitize.SAMPLE_SHAPES_SMALL)
    sanitize.gemv_cols_cases(np.random.default_rng(4), sanitize.GEMV_COLS_CASES_SMALL)


@pytest.mark.parametrize("wtype", ["Q4_1", "Q5_1"])
def test_gemm_q_swizzled_rows_of_any_tile_row(wtype):
    """Tile-major Q4_1/Q5_1 rows keep their chunks permuted by their row in the tile (SWIZZLE): gate/up rows
    of a [gate; up] weight stored as plain tiles sit at rows ffn + j, not at the lane's row mod 8 (ffn 3 and
    11 here), and each of a lane's two rows takes its own key."""
    for layout, glu, out_dim in (("tiles", True, 6), ("tiles", True, 22), ("tiles", False, 4), ("glu-tiles", True, 34)):
        _run(wtype, layout, out_dim, 256, 1, np.random.default_rng(0), glu=glu)


@pytest.mark.parametrize("out_dim", [4, 6, 22, 34])
def test_gemm_q_q6k_glu_on_plain_tiles(out_dim):
    """Tile-major Q6_K keeps each 8-row group's d together (16 bytes a group of a half): the up row ffn + j
    of a [gate; up] weight stored as plain tiles reads its own d, at (ffn + j) % 8 of its group, whatever
    ffn is (2, 3, 11, 17 here; hypothesis found ffn = 2 reading the gate row's entry)."""
    for m in (1, 9):
        _run("Q6_K", "tiles", out_dim, 256, m, np.random.default_rng(out_dim), glu=True)
