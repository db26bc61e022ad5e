"""GEMV, fused gate/up GEMV and GEMM on GGUF weights: their host calls and the dispatch code that picks
their launch shapes.

Two kernels compute a decode GEMV: the SIMT one (:mod:`ptx_gen.kernels.gemv`, shape
:class:`GemvConfig` from :func:`gemv_config`) and the tensor-core one (:mod:`ptx_gen.kernels.gemv_mma`,
shape :class:`MmaConfig` from :func:`mma_config`). :class:`GemvOps` picks one per weight on its device,
and the weight's layout to match (:meth:`GemvOps.upload`: tile-major where the tensor-core kernel reads
it). The tables and thresholds those picks read are data, in :mod:`realizar.gpu.policy.gemv` (tuned with
``tools/bench_gemv.py --sweep`` / ``--mma-sweep``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import numpy as np

from ptx_gen.kernels.gemv.gemv import MAX_STATIC_SMEM, shared_bytes, tiles_per_slice
from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES, SOLO_SMEM, q6k_glu_offsets_fit
from ptx_gen.kernels.gemv.gemv_mma_layout import MAX_COLS
from ptx_gen.kernels.gemv.gemv_mma import layout as mma_layout
from ptx_gen.kernels.gemv.quant_layout import type_info
from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.policy.gemv import (
    B32_BALANCE, B32_ONE_TILE, B32_ONE_TILE_UNITS, B32_UNBALANCED, BULK_ALWAYS, BULK_FEW_UNITS, BULK_MAX_UNITS,
    BULK_ROW_TILE, COLS_MAX_WARPS, COLS_PER_LAUNCH, COLS_WIDE_TILES, COLS_WIDE_TILES_CP_ASYNC,
    FAST_DRAM_AHEAD_UNBALANCED, FAST_DRAM_AHEAD_WIDE, FAST_DRAM_BULK, FAST_DRAM_BYTES_PER_SM_CLOCK,
    FAST_DRAM_UNBALANCED, FAST_DRAM_WIDE, MMA_CTA_SPLITS, MMA_EXTRA_CTA, MMA_SCORE_SLACK, MMA_SLOWER, MMA_STAGES,
    Q6K_MANY_ROWS_PER_SM, ROWS_WHEN_BULK, SIMT_LARGE, SIMT_LARGE_DEFAULT, SIMT_LARGE_MANY_ROWS,
    SIMT_LARGE_ROWS_PER_SM, SIMT_ROWS_PER_WARP, SIMT_WARPS, TARGET_WARPS_PER_SM, TILED_UNBALANCED, WIDE_BALANCED,
    WIDE_MIN_UNITS)
from realizar.gpu.policy.shapes import GemvConfig, MmaConfig
from realizar.gpu.weights import GpuWeight, weight_type_name

__all__ = ["GemvConfig", "GemvOps", "MmaConfig", "gemv_config", "mma_config"]


def cols_per_launch(wtype: str, glu: bool = False) -> int:
    """The most columns of x one launch of the columns kernel takes for ``wtype`` (``glu``: the fused
    gate/up GEMV, whose warps are 32-row ones)."""
    return COLS_WIDE_TILES.get(wtype, MAX_COLS) if glu else COLS_PER_LAUNCH.get(wtype, MAX_COLS)


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

    Without ``in_dim``/``wtype`` (or for rows too short to split) only rows per warp are chosen, by rows
    per SM (``SIMT_ROWS_PER_WARP``; 4 rows reuse each x load 4 times), in CTAs of ``SIMT_WARPS``. With
    them, K is split (``ksplit`` warps per row group, each one slice) while

    * the grid has fewer than ``TARGET_WARPS_PER_SM`` warps per SM (a warp walking a long row tile
      after tile is latency bound), or
    * a quantized row would still be walked in several tiles: a one-tile slice is copied at once with
      ``cp.async`` (every load in flight, no registers held) rather than tile after tile,

    keeping at least 2 rounds (512 values) per slice. Rows per warp: 4 where ``SIMT_ROWS_PER_WARP`` gives
    4 for a quantized type and 4-row slices are single tiles that fit the shared memory, else at most 2.
    The large quantized decode shapes (``SIMT_LARGE_ROWS_PER_SM``) take the fixed shapes of ``SIMT_LARGE``
    (``SIMT_LARGE_MANY_ROWS`` from ``Q6K_MANY_ROWS_PER_SM``; ``SIMT_LARGE_DEFAULT`` for the other types)."""
    per_sm = out_dim / sm_count
    by_rows = GemvConfig(next(rows for least, rows in SIMT_ROWS_PER_WARP if per_sm >= least), SIMT_WARPS)
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

    if quantized and per_sm >= SIMT_LARGE_ROWS_PER_SM:  # the large decode shapes
        table = (per_sm >= Q6K_MANY_ROWS_PER_SM and SIMT_LARGE_MANY_ROWS.get(wtype)) or SIMT_LARGE.get(
            wtype, SIMT_LARGE_DEFAULT)
        cfg = next((c for least, c in table if rounds >= least), None)
        if cfg is not None and shared_bytes(wtype, in_dim, cfg.rows, cfg.warps, cfg.ksplit) <= MAX_STATIC_SMEM \
                and (cfg.ksplit == 1 or rounds >= 2 * cfg.ksplit):
            return cfg
    if by_rows.rows == 4 and quantized:  # (dense rows decode cheaply: they keep 2 rows per warp)
        ks = ksplit_for(4)
        fits = shared_bytes(wtype, in_dim, 4, max(SIMT_WARPS, ks), ks) <= MAX_STATIC_SMEM
        if ks == 1 or (tiles_per_slice(wtype, in_dim, ks) == 1 and fits):
            return GemvConfig(4, max(SIMT_WARPS, ks), ks)
    rows = min(by_rows.rows, 2)
    ks = ksplit_for(rows)
    return GemvConfig(rows, max(SIMT_WARPS, ks), ks)


@functools.lru_cache(maxsize=None)  # pure, and asked at every eager GEMV launch
def mma_config(out_dim: int, in_dim: int, wtype: str, sm_count: int = 132,
               max_smem: int = 227 * 1024, bulk_ok: bool = False, glu: bool = False,
               balance_only: bool = False) -> MmaConfig | None:
    """The tensor-core GEMV's launch shape for ``out_dim`` rows of ``in_dim`` values, or None where it
    does not apply (types other than those of ``MMA_TYPES``, rows not a multiple of 256 values, or of
    2048 for Q6_K) or would keep fewer than half the SMs busy (small GEMVs: the SIMT kernel starts faster).

    CTAs of 8 warps (``MMA_CTA_SPLITS``) with ``MMA_STAGES``-deep rings; warps of 32 rows (each unit of x
    a warp converts serves twice the rows) split K in ``kparts`` so that the grid is balanced over the SMs
    (the busiest SM runs ``ceil(ctas / sm_count)`` CTAs), each CTA beyond the first on an SM costing
    ``MMA_EXTRA_CTA`` (one CTA streaming many units per warp beats several short ones). Among shapes
    scoring within ``MMA_SCORE_SLACK`` of the best: 32-row warps, then fewer CTAs per SM. The 32-value
    block types of ``B32_UNBALANCED`` take its shape where that pick balances the SMs worse than
    ``B32_BALANCE``. With ``bulk_ok`` (sm_90) warps that stream at most ``BULK_MAX_UNITS`` units use bulk
    copies. ``glu``: the fused gate/up GEMV of ``out_dim`` outputs (2 out_dim weight rows; a warp takes 16
    outputs' gate and up rows, so 32-row warps only).
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
    for tiles, (mtiles, kparts) in itertools.product(tile_opts, MMA_CTA_SPLITS):
        if units % kparts:
            continue
        try:
            if mma_layout(wtype, in_dim, mtiles, kparts, MMA_STAGES, tiles)["smem"] > max_smem:
                continue
        except ValueError:
            continue
        ctas = -(-out_dim // ((16 if glu else 16 * tiles) * mtiles))
        per_sm = -(-ctas // sm_count)
        score = ctas / sm_count / per_sm * max(0.1, 1 - MMA_EXTRA_CTA * (per_sm - 1))
        cands.append((score, tiles, -per_sm, ctas, MmaConfig(mtiles, kparts, MMA_STAGES, tiles)))
    if not cands:
        return None
    top = max(c[0] for c in cands)
    *_, ctas, best = max((c for c in cands if c[0] >= top - MMA_SCORE_SLACK), key=lambda c: c[1:3])
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
    if bulk_ok and wtype != "Q6_K" and units // best.kparts <= BULK_MAX_UNITS:  # (Q6_K blocks: 2-byte aligned)
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
        sm_90 a warp's stage is one bulk copy where that is the faster fill: ``BULK_ALWAYS`` always,
        ``BULK_ROW_TILE`` with one row tile per CTA, ``BULK_FEW_UNITS`` with at most ``BULK_MAX_UNITS``
        units per warp, and where the DRAM is fast for the SMs (``fast_dram``) ``FAST_DRAM_BULK`` in CTAs of
        one 32-row tile. There too, on sm_90, grids of one 32-row tile a CTA and an SM take
        ``FAST_DRAM_WIDE``'s wider CTAs (elsewhere ``WIDE_BALANCED``'s), and grids the balanced pick spreads
        unevenly ``FAST_DRAM_UNBALANCED``'s, which fit the SMs at once; the one-column kernel takes
        ``FAST_DRAM_AHEAD_*``'s where they have one (``cols``: the base of the columns kernel's pick,
        :meth:`mma_cols_config`, which does not). Elsewhere ``B32_ONE_TILE`` and ``TILED_UNBALANCED``
        apply."""
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
                    and units >= WIDE_MIN_UNITS * wide.kparts and fits(wide)  # (units a warp at least,
                    and (wide.stages == MMA_STAGES and not wide.ahead  # and, for a deeper ring or one stage
                         or units > wide.stages * wide.kparts)):  # ahead, past the ring: as measured)
                return wide
        if fast_dram and cc >= (9, 0) and not glu:  # (the first unbalanced pick that fits, if the grid is uneven)
            unbalanced = next((c for c in ((FAST_DRAM_AHEAD_UNBALANCED.get(wtype) if ahead else None),
                                           FAST_DRAM_UNBALANCED.get(wtype))
                               if c is not None and units >= WIDE_MIN_UNITS * c.kparts and fits(c)), None)
            if unbalanced is not None:
                spread = mma_config(out_dim, in_dim, wtype, self.sm_count, max_smem, balance_only=True)
                if grid_balance(grid_ctas(out_dim, spread), self.sm_count) < B32_BALANCE:
                    return unbalanced
        if (wtype in B32_ONE_TILE and one_tile_warps and in_dim // 256 // cfg.kparts >= B32_ONE_TILE_UNITS
                and not (fast_dram and cc >= (9, 0))):
            cfg = dataclasses.replace(cfg, tiles=1)
            ctas = grid_ctas(out_dim, cfg)
        other = TILED_UNBALANCED.get(wtype)
        if (other is not None and cc >= (9, 0) and not glu and in_dim // 256 % other.kparts == 0
                and grid_balance(ctas, self.sm_count) < B32_BALANCE and fits(other)):
            return other
        bulk = cc >= (9, 0) and (wtype in BULK_ALWAYS or (wtype in BULK_ROW_TILE and cfg.mtiles == 1)
                                 or (wtype in BULK_FEW_UNITS and in_dim // 256 // cfg.kparts <= BULK_MAX_UNITS)
                                 or (fast_dram and wtype in FAST_DRAM_BULK and one_tile_warps))
        # (solo only where a CTA may ask for that much: not on sm_86/sm_89, whose limit is 99 KiB)
        return dataclasses.replace(cfg, bulk=bulk, solo=ctas <= self.sm_count and SOLO_SMEM <= max_smem)

    def mma_cols_config(self, out_dim: int, in_dim: int, wtype: str, cols: int, glu: bool = False,
                        layout: str = "rows") -> MmaConfig | None:
        """The launch shape of the tensor-core GEMV over ``cols`` columns of x (1..``MAX_COLS``; None where
        the one-column kernel does not apply): the one-column pick (:meth:`mma_config`), with fewer K
        parts, then fewer warps along the rows, then (not glu) 16-row warps until every column's x slots
        and K-part sums fit the shared memory; CTAs of at most ``COLS_MAX_WARPS`` warps for several columns,
        and 16-row warps for more than ``COLS_WIDE_TILES`` columns (32-row warps keep 8 accumulators a
        column and lane: they spill; before sm_90 on tile-major weights ``COLS_WIDE_TILES_CP_ASYNC``). None
        beyond :func:`cols_per_launch` columns. Kept per argument (the device is this dispatcher's, fixed):
        the batched decode step asks at every launch."""
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
        if cols > 1:  # (a 16-warp CTA leaves 128 registers a thread)
            while cfg.mtiles * cfg.kparts > COLS_MAX_WARPS:
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
        Exception: ``ROWS_WHEN_BULK`` rows where their pick uses bulk copies (at most ``BULK_MAX_UNITS``
        units per warp), which the kernel streams faster with one bulk copy per row and unit."""
        cfg = self.mma_config(out_dim, in_dim, wtype, glu=glu)
        if cfg is None or (wtype in ROWS_WHEN_BULK and cfg.bulk):
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
