"""GEMV, fused gate/up GEMV and GEMM on GGUF weights: their launch policy beside their host calls.

Two kernels compute a decode GEMV: the SIMT one (:mod:`ptx_gen.kernels.gemv`, shape
:class:`GemvConfig` from :func:`gemv_config`) and the tensor-core one (:mod:`ptx_gen.kernels.gemv_mma`,
shape :class:`MmaConfig` from :func:`mma_config`). :class:`GemvOps` picks one per weight on its device,
and the weight's layout to match (:meth:`GemvOps.upload`: tile-major where the tensor-core kernel reads
it). The policies are tuned with ``tools/bench_gemv.py --sweep``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ptx_gen.kernels.gemv.gemv import MAX_STATIC_SMEM, shared_bytes, tiles_per_slice
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES, SOLO_SMEM, q6k_glu_offsets_fit
from ptx_gen.kernels.gemv.gemv_mma_layout import BLOCK32, MAX_COLS
from ptx_gen.kernels.gemv.gemv_mma import layout as mma_layout
from ptx_gen.kernels.gemv.quant_layout import type_info
from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.weights import GpuWeight, weight_type_name

__all__ = ["GemvConfig", "GemvOps", "MmaConfig", "gemv_config", "mma_config"]


@dataclass(frozen=True)
class GemvConfig:
    """Launch shape of the SIMT GEMV (:mod:`ptx_gen.kernels.gemv`)."""

    rows: int  # output rows per warp (weight rows per warp for the fused gate/up GEMV)
    warps: int  # warps per CTA
    ksplit: int = 1  # warps sharing a row group, each summing one K slice (divides warps)


# a grid of at least this many warps per SM: about one wave of the warps a split kernel keeps resident
# (registers, shared memory). More splitting than that only adds per-warp work (setup, the partial
# sums) to kernels whose decode already keeps the SMs' issue slots busy (Q4_K, Q6_K)
TARGET_WARPS_PER_SM = 24
# Q6_K GEMVs of at least this many rows per SM stay on the SIMT kernel: each warp of the tensor-core
# kernel converts every unit of x it uses, a cost that grows with the rows
Q6K_MANY_ROWS_PER_SM = 256
MMA_EXTRA_CTA = 0.1  # the tensor-core GEMV dispatcher's cost of each further CTA on an SM
# types the tensor-core kernel handles but streams slower than the SIMT one (bench_gemv, H200): the
# dispatcher leaves them on the SIMT kernel (a forced MmaConfig still runs it)
MMA_SLOWER: tuple[str, ...] = ()



@dataclass(frozen=True)
class MmaConfig:
    """Launch shape of the tensor-core GEMV (:mod:`ptx_gen.kernels.gemv_mma`)."""

    mtiles: int  # warps along the rows of a CTA
    kparts: int  # warps sharing those rows, each one part of K
    stages: int  # cp.async ring depth per warp (units of 256 values)
    tiles: int = 1  # 16-row MMA tiles per warp
    bulk: bool = False  # sm_90: fill the ring with bulk copies (cp.async.bulk + mbarrier)
    solo: bool = False  # shared memory raised so that one CTA holds an SM (see gemv_mma.SOLO_SMEM)
    late: bool = False  # the next kernel's launch triggered near the end (after the warps' last copies)
    l2pre: int = 0  # tile-major, sm_90: each warp's next units past its ring asked of the L2 before the grid wait
    ahead: int = 0  # ring stages requested before the grid wait (0: all), the others right after x's first loads


# where the 8-warp pick keeps less than B32_BALANCE of the SMs' time busy (busiest SM vs the mean), these
# 32-value block types take the shape that streamed fastest at 14336 x 4096 (bench_gemv --mma-sweep,
# H200; Q4_1 on GGUF rows keeps the 8-warp pick, on tile-major weights see TILED_UNBALANCED)
B32_BALANCE = 0.9
# (Q5_0 in 16-row warps since its tile-major units are re-encoded: 14.4 against 15.7 µs for 32-row warps,
# H100, 2026-11-28)
B32_UNBALANCED = {"Q4_0": MmaConfig(2, 4, 2, 2), "Q5_0": MmaConfig(1, 4, 2, 1), "Q5_1": MmaConfig(1, 4, 2, 1)}
# likewise on sm_90 over tile-major weights: Q4_K in CTAs of 4 warps of 32 rows, each warp a quarter of K
# (bench_gemv --mma-sweep, 14336 x 4096, against the 16-warp CTA with bulk copies and the late trigger
# picked before: H100 12.4 against 12.7 µs, H200 9.2-9.4 against 9.4-9.6 µs, 2026-11-28; the other types
# were as fast or slower in such CTAs); Q4_1 since its tile-major rows are swizzled (SWIZZLE, no padded
# stages) in CTAs of 2 x 4 warps of 32 rows as Q4_0 (H200 9.4 against 10.4 µs, 2026-11-28)
TILED_UNBALANCED = {"Q4_K": MmaConfig(1, 4, 2, 2), "Q4_1": MmaConfig(2, 4, 2, 2)}
# on sm_90 over tile-major weights, where the 8-warp pick gives each SM one CTA of one 32-row tile
# (4096 x 14336: 128 CTAs on 132 SMs), types that stream faster in 16-warp CTAs, each warp about half as
# many units (the parts need not divide them) with bulk copies and the late trigger (bench_gemv
# --mma-sweep, H100, 2026-11-28, 4096 x 14336: Q4_K 11.8 against 12.4 µs)
WIDE_BALANCED = {"Q4_K": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True)}
# on tile-major weights (re-encoded, see TILED_B32) types whose 8-warp CTAs of one row tile stream faster
# in 16-row warps where each warp streams at least 4 units (bench_gemv --mma-sweep, H100, 2026-11-28,
# 4096 x 14336: Q4_0 11.7 against 12.2 µs, Q5_0 14.3 against 15.2; at 4096 x 4096, 2 units a warp, the
# 32-row warps stay ahead)
B32_ONE_TILE = ("Q4_0", "Q5_0")
# where the DRAM is fast for the SMs (fast_dram), the 32-value block types whose CTAs of one 32-row tile
# fill their rings with bulk copies (bench_gemv --mma-sweep, H200, 2026-11-28, 4096 x 14336: Q4_1 10.1
# against 10.3 µs, Q5_1 12.1 against 12.4 since their tile-major rows are swizzled)
FAST_DRAM_BULK = ("Q4_0", "Q5_0", "Q4_1", "Q5_1")
# where the DRAM is fast for the SMs, over tile-major weights whose 8-warp pick spreads unevenly over the
# SMs (14336 x 4096: 112 CTAs on 132 SMs): shapes whose whole grid fits the SMs' shared memory at once (one x
# slot a warp, 48-byte table rows for Q5_0 / Q5_1), e.g. Q5_K 448 CTAs of 4 warps, 4 an SM (bench_gemv
# --mma-sweep, H200, 2026-11-28, docs/results/bench_gemv_sweep_h200.md, 14336 x 4096: Q5_K 11.1 against
# 12.1 µs, Q5_0 10.9 against 11.7, Q5_1 11.5 against 12.2; Q6_K, on its tile-major halves of 208-byte rows
# (Q6K_HALF), 8-warp CTAs of 16-row warps, 224 of them, 13.4-13.5 against 13.8 µs for 3 warps of 32 rows
# with bulk copies, docs/results/bench_gemv_q6k_ab_h200.md). The columns kernel's base; the one-column
# kernel takes FAST_DRAM_AHEAD_UNBALANCED's where it has one
FAST_DRAM_UNBALANCED = {"Q5_K": MmaConfig(1, 4, 2, 2), "Q5_0": MmaConfig(2, 2, 3, 2), "Q5_1": MmaConfig(1, 3, 2, 2),
                        "Q6_K": MmaConfig(4, 2, 2, 1)}
# and where the 8-warp pick gives each SM one CTA of one 32-row tile (4096 x 14336), the types that stream
# faster in wider CTAs, as WIDE_BALANCED (same sweep, 4096 x 14336: Q5_K 11.1 against 11.3-11.6 µs, Q4_0 9.2
# against 9.4-9.6, Q4_1 9.8 against 10.1), or (Q6_K, on its 208-byte rows) in a deeper ring: 12.9-13.0
# against 13.3 µs for 12 warps of 2 stages. Likewise the columns kernel's base (FAST_DRAM_AHEAD_WIDE)
FAST_DRAM_WIDE = {"Q5_K": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True),
                  "Q6_K": MmaConfig(1, 8, 3, 2, bulk=True, solo=True),
                  "Q4_0": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True),
                  "Q4_1": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True)}
# the one-column GEMV's picks there: most with bulk copies and one ring stage asked for before the grid wait,
# the other right after x's first loads (``ahead``: x's loads then queue behind one stage of weight bytes,
# not the whole ring; where the grid's CTAs hold one an SM, x came microseconds after the wait and no stage
# could be refilled before it). bench_gemv --mma-sweep, H200, 2026-11-28 (docs/results/bench_gemv_ahead_h200.md),
# 14336 x 4096: Q4_K 8.6 against 9.2 µs, Q4_0 8.5 against 8.9, Q5_K 10.7 against 11.1, Q5_0 10.2 against 10.8,
# Q8_0 14.8 against 16.1, and Q6_K in 896 CTAs of 4 16-row warps (not all resident at once) 12.7 against 13.5,
# 12.8 against 13.6 in a second sweep on another machine; Q5_1 keeps FAST_DRAM_UNBALANCED's (slower with one
# stage ahead)
FAST_DRAM_AHEAD_UNBALANCED = {"Q4_K": MmaConfig(1, 4, 2, 2, bulk=True, ahead=1),
                              "Q4_0": MmaConfig(2, 4, 2, 2, bulk=True, ahead=1),
                              "Q5_K": MmaConfig(2, 4, 2, 2, bulk=True, ahead=1),
                              "Q5_0": MmaConfig(1, 4, 2, 2, bulk=True, ahead=1),
                              "Q6_K": MmaConfig(1, 4, 2, 1, ahead=1),
                              "Q8_0": MmaConfig(1, 3, 2, 1, bulk=True, ahead=1)}
# and at 4096 x 14336, with the late trigger in CTAs that hold an SM each (same sweep: Q4_K 9.0 against 9.4 µs
# for the same CTAs with the whole ring ahead, Q4_0 8.9 against 9.0, Q4_1 9.6 against 9.8, Q5_K 11.0 against
# 11.2, Q5_0 10.9 against 11.3 for 8 warps, Q5_1 11.5 against 12.1, Q8_0 in 8 warps 14.9 against 15.6 with
# cp.async); Q6_K keeps its deeper ring, all of it ahead (12.8 µs; 12.7 for the best with one stage ahead)
FAST_DRAM_AHEAD_WIDE = {"Q4_K": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q4_0": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q4_1": MmaConfig(1, 16, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q5_K": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q5_0": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q5_1": MmaConfig(1, 12, 2, 2, bulk=True, solo=True, late=True, ahead=1),
                        "Q8_0": MmaConfig(1, 8, 2, 2, bulk=True, solo=True, ahead=1)}
# (no pick asks for L2 prefetches past the ring, MmaConfig.l2pre: one unit a warp made GEMV after GEMV of
# 4096 x 14336 2-4% faster for Q5_0, Q5_1, Q5_K, Q6_K and Q8_0, docs/results/bench_gemv_l2pre_h200.md, but the
# 8B Q5_K_M-like decode step 0.9% slower, 2075 against 2057 µs a token, docs/results/bench_decode_l2pre_ab_h200.md:
# there the down GEMV follows the fused gate/up GEMV, whose end its prefetches slow)
# the columns kernel (gemv_cols) keeps 32-row warps up to this many columns of x, per type (more would
# spill: each column holds the warp's accumulators); 16-row warps beyond
# (ptxas 13, sm_80 / sm_90, the dispatcher's CTAs of 32-row warps: Q4_K, Q5_K, Q4_0, Q4_1, Q5_0 and Q5_1 (its
# swizzled rows' addresses) spill at 8 columns, Q6_K heavily, Q8_0 at 4)
COLS_WIDE_TILES = {"Q4_K": 4, "Q5_K": 4, "Q6_K": 4, "Q4_0": 4, "Q4_1": 4, "Q5_0": 4, "Q5_1": 4, "Q8_0": 2}
# and before sm_90 (cp.async rings), on tile-major weights: Q6_K's 4-column kernel of 32-row warps spills 8
# bytes at 255 registers there (ptxas 13.5, sm_80)
COLS_WIDE_TILES_CP_ASYNC = {"Q6_K": 2}
# and the most columns one launch takes at all (Q6_K's 16-row warps spill at 8 too); gemv_cols runs more
# in several launches
COLS_PER_LAUNCH = {"Q6_K": 4}


def cols_per_launch(wtype: str, glu: bool = False) -> int:
    """The most columns of x one launch of the columns kernel takes for ``wtype`` (``glu``: the fused
    gate/up GEMV, whose warps are 32-row ones)."""
    return COLS_WIDE_TILES.get(wtype, MAX_COLS) if glu else COLS_PER_LAUNCH.get(wtype, MAX_COLS)
# Where the DRAM delivers at least this many bytes per SM clock (peak bandwidth over SMs x clock: H200
# 18.4, H100 SXM 12.8) an SM must turn each byte into products with fewer instructions to keep up, and the
# 32-row warps of those types, which convert each unit of x for twice the rows, stay ahead of the 16-row
# ones; they fill their rings with bulk copies (bench_gemv --mma-sweep, H200, 2026-11-28, 4096 x 14336,
# three machines: Q5_0 11.3-11.5 against 12.1-12.3 µs in 16-row warps, Q4_0 9.4-9.7 against 9.3-9.5)
FAST_DRAM_BYTES_PER_SM_CLOCK = 16.0


def dram_bytes_per_sm_clock(device) -> float:
    """The device's peak DRAM bandwidth (memory clock x bus width, double data rate) over its SMs' total
    clock, in bytes per SM cycle; 0 where the driver reports no clock."""
    try:
        mem_khz, bus_bits = device.attribute("MEMORY_CLOCK_RATE"), device.attribute("GLOBAL_MEMORY_BUS_WIDTH")
        sm_khz = device.attribute("CLOCK_RATE")
    except Exception:  # noqa: BLE001 - an attribute this driver does not know: no claim on the memory's speed
        return 0.0
    if sm_khz <= 0:
        return 0.0
    return 2 * mem_khz * bus_bits / 8 / (device.sm_count * sm_khz)


def grid_ctas(out_dim: int, cfg: MmaConfig, glu: bool = False) -> int:
    """CTAs of a tensor-core GEMV launch of ``out_dim`` outputs in ``cfg`` (``glu``: 16 outputs a warp)."""
    return -(-out_dim // ((16 if glu else 16 * cfg.tiles) * cfg.mtiles))


def grid_balance(ctas: int, sm_count: int) -> float:
    """The SMs' mean load over the busiest SM's, for ``ctas`` equal CTAs (1.0: every SM runs as many)."""
    return ctas / (sm_count * -(-ctas // sm_count))


def _offset(x: Any, n: int) -> tuple:
    """``x`` (a buffer or ``(buffer, element offset)``) ``n`` elements further on."""
    buf, off = x if isinstance(x, tuple) else (x, 0)
    return buf, off + n


@functools.lru_cache(maxsize=None)  # pure, and asked at every eager GEMV launch
def gemv_config(out_dim: int, sm_count: int = 132, in_dim: int | None = None, wtype: str | None = None) -> GemvConfig:
    """Launch shape of the SIMT GEMV of ``out_dim`` weight rows of ``in_dim`` values of ``wtype``.

    Without ``in_dim``/``wtype`` (or for rows too short to split) only rows per warp are chosen by
    ``out_dim``: 4 rows (x loads reused 4 times) for >= 48 rows per SM, 2 for >= 16, else 1. With
    them, K is split (``ksplit`` warps per row group, each one slice) while

    * the grid has fewer than ``TARGET_WARPS_PER_SM`` warps per SM (a warp walking a long row tile
      after tile is latency bound), or
    * a quantized row would still be walked in several tiles: a one-tile slice is copied at once with
      ``cp.async`` (every load in flight, no registers held) rather than tile after tile,

    keeping at least 2 rounds (512 values) per slice. Rows per warp: 4 for >= 48 rows per SM of a
    quantized type when 4-row slices are single tiles that fit the shared memory (x reused 4 times),
    else 2 (1 below 16 rows per SM). The large quantized decode shapes take fixed picks from the sweep."""
    per_sm = out_dim / sm_count
    by_rows = GemvConfig(4 if per_sm >= 48 else 2 if per_sm >= 16 else 1, 4)
    if in_dim is None or wtype is None:
        return by_rows
    rounds = -(-in_dim // 256)
    quantized = type_info(wtype).block_values > 1

    def ksplit_for(rows: int) -> int:
        ks = 1
        while ks < 8 and rounds >= 4 * ks and (
                -(-out_dim // rows) * ks < TARGET_WARPS_PER_SM * sm_count
                or (quantized and tiles_per_slice(wtype, in_dim, ks) > 1)):
            ks *= 2
        return ks

    if quantized and per_sm >= 16:  # the large decode shapes
        if wtype == "Q6_K":
            cfg = (GemvConfig(2, 8, 8) if rounds >= 32 else GemvConfig(4, 4, 2 if per_sm >= Q6K_MANY_ROWS_PER_SM else 4)
                   if rounds >= 16 else None)
        else:  # Q4_K / Q8_0
            cfg = GemvConfig(4, 4, 2 if rounds >= 32 else 1)
        if cfg is not None and shared_bytes(wtype, in_dim, cfg.rows, cfg.warps, cfg.ksplit) <= MAX_STATIC_SMEM \
                and (cfg.ksplit == 1 or rounds >= 2 * cfg.ksplit):
            return cfg
    if by_rows.rows == 4 and quantized:  # (dense rows decode cheaply: they keep 2 rows per warp)
        ks = ksplit_for(4)
        fits = shared_bytes(wtype, in_dim, 4, max(4, ks), ks) <= MAX_STATIC_SMEM
        if ks == 1 or (tiles_per_slice(wtype, in_dim, ks) == 1 and fits):
            return GemvConfig(4, max(4, ks), ks)
    rows = min(by_rows.rows, 2)
    ks = ksplit_for(rows)
    return GemvConfig(rows, max(4, ks), ks)


@functools.lru_cache(maxsize=None)  # pure, and asked at every eager GEMV launch
def mma_config(out_dim: int, in_dim: int, wtype: str, sm_count: int = 132,
               max_smem: int = 227 * 1024, bulk_ok: bool = False, glu: bool = False,
               balance_only: bool = False) -> MmaConfig | None:
    """The tensor-core GEMV's launch shape for ``out_dim`` rows of ``in_dim`` values, or None where it
    does not apply (types other than those of ``MMA_TYPES``, rows not a multiple of 256 values, or of
    2048 for Q6_K) or would keep fewer than half the SMs busy (small GEMVs: the SIMT kernel starts faster).

    CTAs of 8 warps with a 2-stage ring; warps of 32 rows (each unit of x a warp converts serves twice
    the rows) split K in ``kparts`` so that the grid is balanced over the SMs (the busiest SM runs
    ``ceil(ctas / sm_count)`` CTAs), each CTA beyond the first on an SM costing ``MMA_EXTRA_CTA`` (one
    CTA streaming many units per warp beats several short ones). Among shapes scoring within 2% of the
    best: 32-row warps, then fewer CTAs per SM. The 32-value block types of ``B32_UNBALANCED`` take its
    shape where that pick balances the SMs worse than ``B32_BALANCE``. With ``bulk_ok`` (sm_90)
    warps that stream at most two units use bulk copies. ``glu``: the fused gate/up GEMV of ``out_dim``
    outputs (2 out_dim weight rows; a warp takes 16 outputs' gate and up rows, so 32-row warps only).
    ``balance_only``: the balanced pick as it is, before the type's exceptions and bulk copies."""
    if wtype not in MMA_TYPES or wtype in MMA_SLOWER or in_dim % 256:
        return None
    units = in_dim // 256
    if wtype == "Q6_K" and out_dim >= Q6K_MANY_ROWS_PER_SM * sm_count:
        return None
    if wtype == "Q6_K" and glu and not q6k_glu_offsets_fit(out_dim, in_dim):
        return None
    cands = []
    tile_opts = (2,) if glu else (1, 2)
    for tiles, (mtiles, kparts) in itertools.product(tile_opts, ((1, 8), (2, 4), (4, 2), (8, 1))):
        if units % kparts:
            continue
        try:
            if mma_layout(wtype, in_dim, mtiles, kparts, 2, tiles)["smem"] > max_smem:
                continue
        except ValueError:
            continue
        ctas = -(-out_dim // ((16 if glu else 16 * tiles) * mtiles))
        per_sm = -(-ctas // sm_count)
        score = ctas / sm_count / per_sm * max(0.1, 1 - MMA_EXTRA_CTA * (per_sm - 1))
        cands.append((score, tiles, -per_sm, ctas, MmaConfig(mtiles, kparts, 2, tiles)))
    if not cands:
        return None
    top = max(c[0] for c in cands)
    *_, ctas, best = max((c for c in cands if c[0] >= top - 0.02), key=lambda c: c[1:3])
    if ctas < sm_count // 2:
        return None  # under half the SMs busy: the SIMT kernel is faster
    if balance_only:
        return best
    if (wtype in B32_UNBALANCED and not glu and units % 4 == 0
            and grid_balance(ctas, sm_count) < B32_BALANCE):
        # (e.g. 14336 rows: 112 CTAs of 128 rows on 132 SMs) the 32-value block types, whose unit
        # bodies keep an SM's issue slots busier than Q4_K's, lose the idle SMs' share: smaller CTAs,
        # several an SM, balance the grid
        best = B32_UNBALANCED[wtype]
    if bulk_ok and wtype != "Q6_K" and units // best.kparts <= 2:  # (Q6_K blocks are only 2-byte aligned)
        best = dataclasses.replace(best, bulk=True)
    return best


class GemvOps(Dispatcher):
    """GEMV, fused gate/up GEMV and GEMM launches, and the weight layout they read."""

    # ---- launch policy on this device ----------------------------------------------------------------
    @functools.cached_property
    def fast_dram(self) -> bool:
        """Whether this device's DRAM is fast for its SMs (``FAST_DRAM_BYTES_PER_SM_CLOCK``)."""
        return dram_bytes_per_sm_clock(self.device) >= FAST_DRAM_BYTES_PER_SM_CLOCK

    def mma_config(self, out_dim: int, in_dim: int, wtype: str, glu: bool = False,
                   layout: str = "rows", cols: bool = False) -> MmaConfig | None:
        """The tensor-core GEMV's launch shape on this device (None: not applicable, or before sm_80) for
        a weight stored in ``layout``. On tile-major weights a launch of at most one CTA per SM asks for
        ``solo`` shared memory (so that no SM runs a second CTA of the launch while others idle), and on
        sm_90 a warp's stage is one bulk copy where that is the faster fill: Q6_K always, Q4_K / Q5_K with
        one row tile per CTA, Q8_0 and the 32-value block types with at most two units per warp, and where
        the DRAM is fast for the SMs (``fast_dram``) the 32-value block types in CTAs of one 32-row tile.
        There too, on sm_90, grids of one 32-row tile a CTA and an SM take ``FAST_DRAM_WIDE``'s wider CTAs,
        and grids the balanced pick spreads unevenly ``FAST_DRAM_UNBALANCED``'s, which fit the SMs at once;
        the one-column kernel takes ``FAST_DRAM_AHEAD_*``'s where they have one (``cols``: the base of the
        columns kernel's pick, :meth:`mma_cols_config`, which does not)."""
        cc = self.device.target.compute_capability
        if cc < (8, 0):
            return None
        max_smem = self.device.max_shared_per_block_optin
        cfg = mma_config(out_dim, in_dim, wtype, self.sm_count, max_smem, bulk_ok=cc >= (9, 0), glu=glu)
        if cfg is None or layout == "rows":
            return cfg
        ctas = grid_ctas(out_dim, cfg, glu)
        def fits(c: MmaConfig) -> bool:  # (tile-major, in this device's shared memory)
            return mma_layout(wtype, in_dim, c.mtiles, c.kparts, c.stages, c.tiles, True)["smem"] <= max_smem

        one_tile_warps = not glu and (cfg.mtiles, cfg.kparts, cfg.tiles) == (1, 8, 2)
        fast_dram = self.fast_dram
        ahead = fast_dram and not cols
        units = in_dim // 256
        for wide in ((FAST_DRAM_AHEAD_WIDE.get(wtype) if ahead else None),
                     (FAST_DRAM_WIDE.get(wtype) if fast_dram else None) or WIDE_BALANCED.get(wtype)):
            if (wide is not None and cc >= (9, 0) and one_tile_warps and ctas <= self.sm_count
                    and units >= 2 * wide.kparts and fits(wide)  # (two units a warp at least,
                    and (wide.stages == 2 and not wide.ahead  # and, for a deeper ring or one stage ahead,
                         or units > wide.stages * wide.kparts)):  # past the ring: as measured)
                return wide
        if fast_dram and cc >= (9, 0) and not glu:  # (the first unbalanced pick that fits, if the grid is uneven)
            unbalanced = next((c for c in ((FAST_DRAM_AHEAD_UNBALANCED.get(wtype) if ahead else None),
                                           FAST_DRAM_UNBALANCED.get(wtype))
                               if c is not None and units >= 2 * c.kparts and fits(c)), None)
            if unbalanced is not None:
                spread = mma_config(out_dim, in_dim, wtype, self.sm_count, max_smem, balance_only=True)
                if grid_balance(grid_ctas(out_dim, spread), self.sm_count) < B32_BALANCE:
                    return unbalanced
        if (wtype in B32_ONE_TILE and one_tile_warps and in_dim // 256 // cfg.kparts >= 4
                and not (fast_dram and cc >= (9, 0))):
            cfg = dataclasses.replace(cfg, tiles=1)
            ctas = grid_ctas(out_dim, cfg)
        other = TILED_UNBALANCED.get(wtype)
        if (other is not None and cc >= (9, 0) and not glu and in_dim // 256 % other.kparts == 0
                and grid_balance(ctas, self.sm_count) < B32_BALANCE and fits(other)):
            return other
        bulk = cc >= (9, 0) and (wtype == "Q6_K" or (wtype in ("Q4_K", "Q5_K") and cfg.mtiles == 1)
                                 or ((wtype == "Q8_0" or wtype in BLOCK32) and in_dim // 256 // cfg.kparts <= 2)
                                 or (fast_dram and wtype in FAST_DRAM_BULK and one_tile_warps))
        # (solo only where a CTA may ask for that much: not on sm_86/sm_89, whose limit is 99 KiB)
        return dataclasses.replace(cfg, bulk=bulk, solo=ctas <= self.sm_count and SOLO_SMEM <= max_smem)

    def mma_cols_config(self, out_dim: int, in_dim: int, wtype: str, cols: int, glu: bool = False,
                        layout: str = "rows") -> MmaConfig | None:
        """The launch shape of the tensor-core GEMV over ``cols`` columns of x (1..``MAX_COLS``; None where
        the one-column kernel does not apply): the one-column pick (:meth:`mma_config`), with fewer K
        parts, then fewer warps along the rows, then (not glu) 16-row warps until every column's x slots
        and K-part sums fit the shared memory; CTAs of at most 8 warps for several columns, and 16-row warps
        for more than ``COLS_WIDE_TILES`` columns (32-row warps keep 8 accumulators a column and lane: they
        spill; before sm_90 on tile-major weights ``COLS_WIDE_TILES_CP_ASYNC``). None beyond :func:`cols_per_launch` columns. Kept per argument (the device is this
        dispatcher's, fixed): the batched decode step asks at every launch."""
        if cols not in range(1, MAX_COLS + 1):
            raise ShapeError(f"the tensor-core GEMV takes 1..{MAX_COLS} columns, got {cols}")
        key = (out_dim, in_dim, wtype, cols, glu, layout)
        try:
            return self._mma_cols_configs[key]
        except KeyError:
            cfg = self._mma_cols_configs[key] = self._pick_mma_cols_config(out_dim, in_dim, wtype, cols, glu, layout)
            return cfg

    @functools.cached_property
    def _mma_cols_configs(self) -> dict[tuple, MmaConfig | None]:
        return {}

    def _pick_mma_cols_config(self, out_dim: int, in_dim: int, wtype: str, cols: int, glu: bool,
                              layout: str) -> MmaConfig | None:
        """:meth:`mma_cols_config`, uncached."""
        cfg = self.mma_config(out_dim, in_dim, wtype, glu=glu, layout=layout, cols=True)
        if cfg is None or cols > cols_per_launch(wtype, glu):
            return None
        if cols > 1:  # (at most 8 warps: a 16-warp CTA leaves 128 registers a thread)
            while cfg.mtiles * cfg.kparts > 8:
                cfg = dataclasses.replace(cfg, kparts=cfg.kparts // 2) if cfg.kparts > 1 else \
                    dataclasses.replace(cfg, mtiles=cfg.mtiles // 2)
        wide_cols = COLS_WIDE_TILES.get(wtype, MAX_COLS)
        if layout != "rows" and not glu and self.device.target.compute_capability < (9, 0):
            wide_cols = min(wide_cols, COLS_WIDE_TILES_CP_ASYNC.get(wtype, wide_cols))
        if cols > wide_cols:
            cfg = dataclasses.replace(cfg, tiles=1)
        max_smem = self.device.max_shared_per_block_optin
        while True:
            try:
                if mma_layout(wtype, in_dim, cfg.mtiles, cfg.kparts, cfg.stages, cfg.tiles, layout != "rows",
                              cfg.solo, cols)["launch_smem"] <= max_smem:
                    return cfg
            except ValueError:
                pass
            if cfg.kparts > 1:
                cfg = dataclasses.replace(cfg, kparts=cfg.kparts // 2)
            elif cfg.mtiles > 1:
                cfg = dataclasses.replace(cfg, mtiles=cfg.mtiles // 2)
            elif cfg.tiles == 2 and not glu:
                cfg = dataclasses.replace(cfg, tiles=1)
            else:
                return None

    def weight_layout(self, out_dim: int, in_dim: int, wtype: str, glu: bool = False) -> str:
        """How a weight should be stored for its decode GEMV on this device: tile-major where the
        tensor-core kernel reads it (``glu``: a [gate; up] weight of 2 ``out_dim`` rows), else GGUF rows.
        Exception: Q4_K / Q5_K rows of at most two units per warp, which the kernel streams faster with
        one bulk copy per row and unit."""
        cfg = self.mma_config(out_dim, in_dim, wtype, glu=glu)
        if cfg is None or (wtype in ("Q4_K", "Q5_K") and cfg.bulk):
            return "rows"
        return "glu-tiles" if glu else "tiles"

    def upload(self, tensors: Any, glu: bool = False, name: str = "") -> GpuWeight:
        """A weight for :meth:`gemv` (or, with ``glu``, [gate; up] for :meth:`gemv_glu`) from one tensor or
        a list to stack (:meth:`GpuWeight.concat`), in the layout its GEMV reads fastest
        (:meth:`weight_layout`). Weights the embedding or the GEMM also read must stay in GGUF rows:
        use ``GpuWeight`` directly."""
        many = isinstance(tensors, (list, tuple))
        first = tensors[0] if many else tensors
        out_dim = sum(int(t.shape[0]) for t in tensors) if many else int(first.shape[0])
        wtype, in_dim = weight_type_name(first.ggml_type), int(first.shape[-1])
        if glu and out_dim % 2:
            raise ShapeError(f"a gate/up weight holds 2 * ffn rows, got {out_dim}")
        layout = "rows"
        if wtype in MMA_TYPES and in_dim % 256 == 0:
            layout = self.weight_layout(out_dim // 2 if glu else out_dim, in_dim, wtype, glu=glu)
        if many:
            return GpuWeight.concat(tensors, name=name, layout=layout, device=self.device)
        return GpuWeight(first, layout=layout, device=self.device) if not name else GpuWeight(
            data=first.data, ggml_type=first.ggml_type, shape=first.shape, name=name, layout=layout,
            device=self.device)

    def _mma_kernel(self, weight: GpuWeight, cfg: MmaConfig, **flags):
        return self.kernel("gemv_mma", wtype=weight.wtype, in_dim=weight.in_dim, mtiles=cfg.mtiles, kparts=cfg.kparts,
                           stages=cfg.stages, tiles=cfg.tiles, bulk=cfg.bulk, tiled=weight.layout != "rows",
                           solo=cfg.solo, late=cfg.late, l2pre=cfg.l2pre, ahead=cfg.ahead, **flags)

    # ---- launches ------------------------------------------------------------------------------------
    def gemv(self, weight: GpuWeight, x: Any, out: Any, bias: Any = None, residual: Any = None,
             stream: Any = None, config: GemvConfig | MmaConfig | None = None) -> None:
        """out = W x (+ bias) (+ residual); ``residual`` may be ``out`` itself (in-place add).

        Rows of a multiple of 256 values of the ``MMA_TYPES`` (Q6_K: of 2048 unless tile-major) go to the
        tensor-core kernel (on sm_80+, where it keeps at least half the SMs busy), the rest to the SIMT
        one; ``config`` forces either (a :class:`MmaConfig` or a :class:`GemvConfig`)."""
        cfg = config
        if weight.layout == "glu-tiles":
            raise ShapeError(f"GpuWeight {weight.name!r} is stored for the fused gate/up GEMV: use gemv_glu")
        if cfg is None:
            cfg = self.mma_config(weight.out_dim, weight.in_dim, weight.wtype, layout=weight.layout)
        if cfg is None:
            cfg = gemv_config(weight.out_dim, self.sm_count, weight.in_dim, weight.wtype)
        if not isinstance(cfg, MmaConfig):  # (upload picks tiles only where the tensor-core GEMV runs)
            weight.require_rows("the SIMT GEMV")
        if isinstance(cfg, MmaConfig):
            kern = self._mma_kernel(weight, cfg, bias=bias is not None, residual=residual is not None)
        else:
            kern = self.kernel("gemv", wtype=weight.wtype, in_dim=weight.in_dim, rows=cfg.rows, warps=cfg.warps,
                               bias=bias is not None, residual=residual is not None, ksplit=cfg.ksplit)
        values = {"w": weight.ptr, "x": self.addr(x, weight.in_dim, "x"),
                  "y": self.addr(out, weight.out_dim, "out", align=4)}
        if bias is not None:
            values["bias"] = self.addr(bias, weight.out_dim, "bias", align=4)
        if residual is not None:
            values["residual"] = self.addr(residual, weight.out_dim, "residual", align=4)
        values["out_dim"] = weight.out_dim
        self.launch(kern, -(-weight.out_dim // kern.meta["rows_per_cta"]), values, stream)

    def gemv_cols(self, weight: GpuWeight, x: Any, out: Any, cols: int, *, ldx: int | None = None,
                  ldy: int | None = None, bias: Any = None, residual: Any = None, glu: bool = False,
                  xh: bool = False, out_f16: bool = False, stream: Any = None, config: MmaConfig | None = None) -> None:
        """``out[c] = W x[c] (+ bias) (+ residual[c])`` for the ``cols`` columns c of x (1..8), on tensor
        cores, each weight byte read once for all of them; with ``glu`` W is [gate; up] (layout "rows" or
        "glu-tiles") and ``out[c] = silu(G x[c]) * (U x[c])``; more columns than one launch takes
        (:func:`cols_per_launch`) run in several. x: f32 (f16 with ``xh``), columns ``ldx``
        values apart (default in_dim; a multiple of 4); out (f16 with ``out_f16``) and residual (f32, may be
        ``out`` itself when f32): columns ``ldy`` apart (default the output count). Only the types and row
        lengths of the tensor-core GEMV (:meth:`mma_cols_config` not None). No allocation or
        synchronisation: capturable in a graph."""
        if not isinstance(weight, GpuWeight):
            raise ShapeError(f"weight must be a GpuWeight, got {type(weight).__name__}")
        cols = self.check_int("cols", cols)
        n_in = weight.in_dim
        if glu:
            if weight.out_dim % 2 or weight.layout == "tiles" or bias is not None or residual is not None:
                raise ShapeError(f"the fused gate/up GEMV needs a [gate; up] weight of an even number of rows, stored "
                                 f"'rows' or 'glu-tiles', and no bias or residual; got {weight.out_dim} rows, layout "
                                 f"{weight.layout!r}")
        elif weight.layout == "glu-tiles":
            raise ShapeError(f"GpuWeight {weight.name!r} is stored for the fused gate/up GEMV: pass glu=True")
        n_out = weight.out_dim // 2 if glu else weight.out_dim
        cfg = config or self.mma_cols_config(n_out, n_in, weight.wtype, cols, glu=glu, layout=weight.layout)
        per = cols_per_launch(weight.wtype, glu)
        if config is None and cols > per:  # launches of ``per`` columns
            ldx = n_in if ldx is None else self.check_int("ldx", ldx)
            ldy = n_out if ldy is None else self.check_int("ldy", ldy)
            for c0 in range(0, cols, per):
                self.gemv_cols(weight, _offset(x, c0 * ldx), _offset(out, c0 * ldy), min(per, cols - c0), ldx=ldx,
                               ldy=ldy, bias=bias, residual=None if residual is None else _offset(residual, c0 * ldy),
                               glu=glu, xh=xh, out_f16=out_f16, stream=stream)
            return
        if cfg is None:
            raise ShapeError(f"no tensor-core GEMV for {weight.wtype} rows of {n_in} values ({n_out} outputs) on "
                             f"{self.device.target}: use gemm_q")
        ldx = n_in if ldx is None else self.check_int("ldx", ldx)
        ldy = n_out if ldy is None else self.check_int("ldy", ldy)
        if ldx < n_in or ldx % 4:
            raise ShapeError(f"ldx must be a multiple of 4 and at least in_dim={n_in}, got {ldx}")
        if ldy < n_out:
            raise ShapeError(f"ldy={ldy} must be at least the {n_out} outputs")
        kern = self._mma_kernel(weight, dataclasses.replace(cfg, tiles=2) if glu else cfg, bias=bias is not None,
                                residual=residual is not None, glu=glu, cols=cols, xh=bool(xh), out_f16=bool(out_f16))
        span = (cols - 1) * ldy + n_out
        values = {"w": weight.ptr, "x": self.addr(x, (cols - 1) * ldx + n_in, "x", np.float16 if xh else np.float32),
                  "y": self.addr(out, span, "out", np.float16 if out_f16 else np.float32, align=2 if out_f16 else 4)}
        if bias is not None:
            values["bias"] = self.addr(bias, n_out, "bias", align=4)
        if residual is not None:
            values["residual"] = self.addr(residual, span, "residual", align=4)
        values["out_dim"] = n_out
        if cols > 1 or xh or out_f16:  # (else the one-column kernel, which has no strides)
            values.update(ldx=ldx, ldy=ldy)
        self.launch(kern, -(-n_out // kern.meta["rows_per_cta"]), values, stream)

    def gemv_glu(self, gate_up: GpuWeight, x: Any, out: Any, stream: Any = None,
                 config: GemvConfig | MmaConfig | None = None) -> None:
        """out[i] = silu(gate_i . x) * (up_i . x) with ``gate_up`` = [gate; up] (``GpuWeight.concat``).
        Rows the tensor-core kernel takes (see :meth:`gemv`) run on it."""
        if gate_up.out_dim % 2:
            raise ShapeError(f"gate_up must hold 2 * ffn rows, got {gate_up.out_dim}")
        ffn = gate_up.out_dim // 2
        if gate_up.layout == "tiles":
            raise ShapeError(f"GpuWeight {gate_up.name!r} is stored for a plain GEMV; the fused gate/up GEMV needs "
                             f"layout 'glu-tiles' or 'rows'")
        cfg = config if config is not None else self.mma_config(ffn, gate_up.in_dim, gate_up.wtype, glu=True,
                                                                layout=gate_up.layout)
        if cfg is None:
            cfg = gemv_config(gate_up.out_dim, self.sm_count, gate_up.in_dim, gate_up.wtype)
        if not isinstance(cfg, MmaConfig):
            gate_up.require_rows("the SIMT gate/up GEMV")
        if isinstance(cfg, MmaConfig):
            if gate_up.wtype == "Q6_K" and gate_up.layout == "rows" and not q6k_glu_offsets_fit(ffn, gate_up.in_dim):
                raise ShapeError(f"the tensor-core Q6_K gate/up GEMV cannot address {ffn} x {gate_up.in_dim} "
                                 f"rows (32-bit offsets); leave config unset or use a GemvConfig")
            kern = self._mma_kernel(gate_up, dataclasses.replace(cfg, tiles=2), glu=True)
        else:
            rows = max(2, cfg.rows - cfg.rows % 2)  # weight rows per warp: a gate row and its up row per output
            kern = self.kernel("gemv", wtype=gate_up.wtype, in_dim=gate_up.in_dim, rows=rows, warps=cfg.warps,
                               glu=True, ksplit=cfg.ksplit)
        values = {"w": gate_up.ptr, "x": self.addr(x, gate_up.in_dim, "x"),
                  "y": self.addr(out, ffn, "out", align=4), "out_dim": ffn}
        self.launch(kern, -(-ffn // kern.meta["rows_per_cta"]), values, stream)

    def gemm(self, weight: GpuWeight, x: Any, out: Any, n_tokens: int, bias: Any = None, residual: Any = None,
             stream: Any = None, tokens_per_cta: int = 4, glu: bool = False, config: GemvConfig | None = None) -> None:
        """Prefill: out[t] = W x[t] (+ bias) (+ residual[t]) for t < n_tokens (x: [n_tokens, in_dim],
        out: [n_tokens, out_dim] row-major). With ``glu`` the weight is [gate; up]."""
        weight.require_rows("the GEMM")
        n_tokens = self.check_int("n_tokens", n_tokens)
        tokens_per_cta = self.check_int("tokens_per_cta", tokens_per_cta)
        if tokens_per_cta > 8 or (glu and tokens_per_cta > 4):
            raise ShapeError(f"tokens_per_cta must be 1..8 (1..4 with glu), got {tokens_per_cta}")
        out_dim = weight.out_dim // 2 if glu else weight.out_dim
        cfg = config or GemvConfig(2 if glu or tokens_per_cta <= 4 else 1, 4)
        kern = self.kernel("gemm", wtype=weight.wtype, in_dim=weight.in_dim, rows=cfg.rows, warps=cfg.warps,
                           tokens=tokens_per_cta, bias=bias is not None, residual=residual is not None, glu=glu)
        values = {"w": weight.ptr, "x": self.addr(x, n_tokens * weight.in_dim, "x"),
                  "y": self.addr(out, n_tokens * out_dim, "out", align=4)}
        if bias is not None:
            values["bias"] = self.addr(bias, out_dim, "bias", align=4)
        if residual is not None:
            values["residual"] = self.addr(residual, n_tokens * out_dim, "residual", align=4)
        values["out_dim"] = out_dim
        values["n_tokens"] = n_tokens
        grid = (-(-out_dim // kern.meta["rows_per_cta"]), -(-n_tokens // tokens_per_cta))
        self.launch(kern, grid, values, stream)
