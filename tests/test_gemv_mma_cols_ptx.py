"""The tensor-core GEMV over several columns of x (gemv_mma with ``cols``, ``xh``, ``out_f16``; see
ptx_gen/kernels/gemv_mma_cols.py) on the emulator against the float64 oracle: every type, GGUF rows and
tile-major, bias / residual / fused gate-up epilogues, strided columns, f16 activations and outputs; the
padding between y's columns and past out_dim keeps its NaN poison (no stray stores)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES, layout, tile_major
from ptx_gen.ptxas import assemble
from tests.layer_kernels_ptx_cases import _pad16
from tests.layer_oracles import check_gemv_cols, dequant, random_weight
from tests.helpers import examples, tiered


def _run_cols(wtype: str, cols: int, out_dim: int, mtiles: int, kparts: int, units: int, tiles: int, target: str,
              tiled: bool, xh: bool, out_f16: bool, epi: str, pad_x: int, pad_y: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    glu = epi == "glu"
    if glu:
        tiles = 2
    bulk = target.endswith("bulk")
    if wtype == "Q6_K" and not tiled:
        bulk = False
    in_dim = 2048 * units if wtype == "Q6_K" and not tiled else 256 * kparts * units
    try:
        layout(wtype, in_dim, mtiles, kparts, 2, tiles, tiled, cols=cols)
    except ValueError:
        assume(False)
    rows = 2 * out_dim if glu else out_dim
    raw = random_weight(rng, wtype, rows, in_dim)
    ldx, ldy = in_dim + 8 * pad_x, out_dim + pad_y
    # (columns of different magnitudes; f16 outputs: small enough that silu(g) u stays within f16's range)
    mag = rng.uniform(0.1, 1.0, (cols, 1)) / 64 if out_f16 else rng.uniform(0.1, 10.0, (cols, 1))
    x = (rng.standard_normal((cols, ldx)) * mag).astype(np.float32)
    if xh:
        x = x.astype(np.float16)
    k = catalog.emit("gemv_mma", target=target.split()[0], wtype=wtype, in_dim=in_dim, mtiles=mtiles, kparts=kparts,
                     stages=2, tiles=tiles, bulk=bulk, tiled=tiled, glu=glu, bias=epi == "bias",
                     residual=epi == "residual", cols=cols, xh=xh, out_f16=out_f16)
    assert k.meta["cols"] == cols
    mem = Memory()
    wbytes = tile_major(raw, wtype, rows, in_dim, glu=glu) if tiled else raw if wtype == "Q6_K" else _pad16(raw)
    osize = 2 if out_f16 else 4
    params = dict(w=mem.alloc_array(wbytes), x=mem.alloc_array(x), y=mem.alloc(osize * cols * ldy))
    bias = res = None
    if epi == "bias":
        bias = rng.standard_normal(out_dim).astype(np.float32)
        params["bias"] = mem.alloc_array(bias)
    if epi == "residual":
        res = rng.standard_normal((cols, ldy)).astype(np.float32)
        params["residual"] = mem.alloc_array(res)
    params.update(out_dim=out_dim, ldx=ldx, ldy=ldy)
    simt_run(k.ptx, grid=(-(-out_dim // k.meta["rows_per_cta"]),), block=(k.meta["block"],), params=params,
             memory=mem, shared_bytes=k.meta["dyn_smem"])
    y = mem.read(params["y"], np.float16 if out_f16 else np.float32, cols * ldy).reshape(cols, ldy)
    check_gemv_cols(y, raw, wtype, out_dim, in_dim, x, glu=glu, bias=bias, residual=res, out_f16=out_f16)


@settings(max_examples=examples(60), deadline=None)
@given(wtype=st.sampled_from(MMA_TYPES), cols=st.integers(1, 8), out_dim=st.integers(1, 40),
       mtiles=st.integers(1, 2), kparts=st.integers(1, 3), units=st.integers(1, 2), tiles=st.integers(1, 2),
       target=st.sampled_from(["sm_80", "sm_90", "sm_90 bulk"]), tiled=st.booleans(), xh=st.booleans(),
       out_f16=st.booleans(), epi=st.sampled_from(["none", "bias", "residual", "glu"]),
       pad_x=st.integers(0, 2), pad_y=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_gemv_mma_cols_emulated_matches_oracle(wtype, cols, out_dim, mtiles, kparts, units, tiles, target, tiled, xh,
                                               out_f16, epi, pad_x, pad_y, seed):
    """Y[c] = W X[c] (+ bias) (+ residual[c]), or silu(G X[c]) * (U X[c]), for up to 8 strided columns
    of f32 or f16 x, every element against the float64 oracle (f16 outputs within their rounding)."""
    _run_cols(wtype, cols, out_dim, mtiles, kparts, units, tiles, target, tiled, xh, out_f16, epi, pad_x, pad_y, seed)


@pytest.mark.parametrize("wtype", tiered(MMA_TYPES, {MMA_TYPES.index("Q4_K")}))
def test_gemv_mma_cols_eight_columns_real_k(wtype):
    """Eight columns over a real row length (4096; Q6_K on GGUF rows too), 32-row warps in 8-warp CTAs with
    K parts, tile-major and GGUF rows: the shape the batched decode step launches."""
    for tiled in (True, False):
        _run_cols(wtype, 8, 48, 1, 4, 4, 2, "sm_90", tiled, True, False, "residual", 0, 1, 7)


def test_cols_kernel_parameters_and_one_column_kernel_unchanged():
    """The columns kernel adds ``ldx`` and ``ldy``; without cols / xh / out_f16 the kernel is the
    one-column GEMV (no such parameters)."""
    one = catalog.emit("gemv_mma", target="sm_90", wtype="Q4_K", in_dim=4096, mtiles=1, kparts=8, stages=2, tiles=2)
    many = catalog.emit("gemv_mma", target="sm_90", wtype="Q4_K", in_dim=4096, mtiles=1, kparts=8, stages=2, tiles=2,
                        cols=4)
    assert "ldx" not in one.ptx and "ldy" not in one.ptx
    assert "ldx" in many.ptx and "ldy" in many.ptx and "_c4" in many.ptx
    with pytest.raises(ValueError, match="cols must be 1..8"):
        catalog.emit("gemv_mma", target="sm_90", wtype="Q4_K", in_dim=4096, mtiles=1, kparts=8, stages=2, cols=9)


# the batched decode step's linear layers at the 8B / 1B / SmolLM2 shapes: (out_dim, in_dim, glu)
REAL_SHAPES = [(6144, 4096, False), (4096, 4096, False), (14336, 4096, True), (4096, 14336, False),
               (128256, 4096, False), (3072, 2048, False), (8192, 2048, True), (2048, 8192, False)]


def cols_kernel_shapes(wtype: str) -> list[dict]:
    """The columns kernels the dispatcher picks at REAL_SHAPES for 1, 2, 4 and 8 columns of f16 x on
    emulated sm_80 / H100 / H200 devices (the batched decode step's launches)."""
    from realizar import cuda
    from realizar.gpu.ops import LayerOps
    devices = [("sm_80", {}), ("sm_90", {}), ("sm_90", {"MEMORY_CLOCK_RATE": 3_125_000, "GLOBAL_MEMORY_BUS_WIDTH": 6144})]
    out = []
    for target, attrs in devices:
        ops = LayerOps(cuda.EmulatedDevice(sm_count=132, target=target, attributes=attrs))
        for o, i, glu in REAL_SHAPES:
            if wtype == "Q6_K" and glu:
                continue
            lay = ops.weight_layout(o, i, wtype, glu=glu)
            for cols in (1, 2, 4, 8):
                cfg = ops.mma_cols_config(o, i, wtype, cols, glu=glu, layout=lay)
                if cfg is None:
                    continue
                shape = dict(wtype=wtype, in_dim=i, mtiles=cfg.mtiles, kparts=cfg.kparts, stages=cfg.stages,
                             tiles=2 if glu else cfg.tiles, bulk=cfg.bulk, tiled=lay != "rows", solo=cfg.solo,
                             late=cfg.late, glu=glu, residual=not glu, cols=cols, xh=True, out_f16=glu)
                if (target, shape) not in out:
                    out.append((target, shape))
    return out


@pytest.mark.full
@pytest.mark.parametrize("wtype", MMA_TYPES)
def test_cols_kernels_assemble_without_spills(wtype):
    """ptxas without spills for every columns kernel the dispatcher picks at the real shapes."""
    shapes = cols_kernel_shapes(wtype)
    assert shapes
    for target, shape in shapes:
        src = catalog.emit("gemv_mma", target=target, **shape)
        for r in assemble(src.ptx, target):
            assert r.spill_stores == 0 and r.spill_loads == 0, (shape, target, r)


@pytest.mark.parametrize("wtype,glu", [("Q6_K", False), ("Q4_K", True), ("Q5_1", False), ("Q8_0", True)])
def test_layer_ops_gemv_cols_emulated(wtype, glu):
    """LayerOps.gemv_cols on an emulated device over an uploaded weight (the layout upload picks) and 8
    columns of f16 x at a padded stride: more columns than one launch takes run in several (Q6_K, the
    fused gate/up GEMV of Q4_K and Q8_0); every output against the float64 oracle, the padding keeps its
    poison; bad arguments get a ShapeError naming them."""
    from types import SimpleNamespace

    from ptx_gen.ggml import GGMLType
    from realizar import cuda
    from realizar.errors import ShapeError
    from realizar.gpu.gemv import cols_per_launch
    from realizar.gpu.ops import LayerOps
    ops = LayerOps(cuda.EmulatedDevice(sm_count=2))
    rng = np.random.default_rng(3)
    out_dim, in_dim, cols = 32, 2048 if wtype == "Q6_K" else 512, 8
    rows = 2 * out_dim if glu else out_dim
    raw = random_weight(rng, wtype, rows, in_dim)
    t = SimpleNamespace(data=raw, ggml_type=int(GGMLType[wtype]), shape=(rows, in_dim), name=wtype)
    w = ops.upload(t, glu=glu) if glu else ops.upload(t)
    assert cols_per_launch(wtype, glu) < cols or wtype == "Q5_1"
    ldx, ldy = in_dim + 8, out_dim + 3
    x = rng.standard_normal((cols, ldx)).astype(np.float16)
    out = ops.buffer(cols * ldy, np.float16 if glu else np.float32)
    out.poison()
    before = len(ops.device.launches)
    ops.gemv_cols(w, ops.to_device(x), out, cols, ldx=ldx, ldy=ldy, glu=glu, xh=True, out_f16=glu)
    launches = len(ops.device.launches) - before
    assert launches == -(-cols // cols_per_launch(wtype, glu))
    check_gemv_cols(out.to_numpy().reshape(cols, ldy), raw, wtype, out_dim, in_dim, x, glu=glu, out_f16=glu)
    with pytest.raises(ShapeError, match="ldx must be a multiple of 4"):
        ops.gemv_cols(w, ops.to_device(x), out, cols, ldx=in_dim + 2, ldy=ldy, glu=glu, xh=True, out_f16=glu)
    with pytest.raises(ShapeError, match="1..8 columns"):
        ops.mma_cols_config(out_dim, in_dim, wtype, 9)


def test_layer_ops_gemv_cols_one_f32_column_is_the_plain_gemv():
    """One f32 column, f32 out: gemv_cols launches the one-column GEMV (no strides) and gets W x."""
    from types import SimpleNamespace

    from ptx_gen.ggml import GGMLType
    from realizar import cuda
    from realizar.gpu.ops import LayerOps
    ops = LayerOps(cuda.EmulatedDevice(sm_count=2))
    rng = np.random.default_rng(4)
    raw = random_weight(rng, "Q4_K", 64, 512)
    w = ops.upload(SimpleNamespace(data=raw, ggml_type=int(GGMLType["Q4_K"]), shape=(64, 512), name="w"))
    x = rng.standard_normal(512).astype(np.float32)
    out = ops.buffer(64)
    out.poison()
    ops.gemv_cols(w, ops.to_device(x), out, 1)
    assert "ldx" not in ops.device.launches[-1][4]
    wd = dequant(raw, "Q4_K", 64, 512).astype(np.float64)
    assert (np.abs(out.to_numpy() - wd @ x) <= 1e-6 * (np.abs(wd) @ np.abs(x))).all()
