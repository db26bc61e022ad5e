"""CPU tests of the tensor-core GEMV's dispatcher: where it applies, grids balanced over the SMs,
every launch shape it picks (and the fast-DRAM picks of an H200-like device) assembled without
spills, the picks of the newer weight types and of wide CTAs, and the guard of the fused Q6_K
gate/up GEMV's 32-bit offsets. The kernel's emulated runs are in tests/test_gemv_mma_ptx.py."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from ptx_gen import catalog
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES
from ptx_gen.ptxas import assemble
from realizar.gpu.gemv import gemv_config
from tests.layer_oracles import dequant, random_weight
from tests.helpers import tiered


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


@pytest.mark.parametrize("wtype", tiered(MMA_TYPES, {0}))
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


@pytest.mark.parametrize("wtype", tiered(MMA_TYPES, {0}))
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
