"""The warpgroup-MMA batch GEMM over quantized weights (sm_90a): ``out[:m] = x16[:m] W^T`` with W the GpuWeight
as the decode GEMV stores it, decoded into registers by each warp (no f16 copy of W), f16 X, f32 accumulation
on ``wgmma`` (:mod:`ptx_gen.kernels.gemm.gemm_wg`).

    ops.gemm_wg(x16, weight, out, m, residual=h)          # out[:m] = x16 W^T + h

:func:`wg_applies` says which weights and devices it takes; :func:`wg_config` picks the launch shape from
the tables of :mod:`realizar.gpu.policy.gemm`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.policy.gemm import (WG_MIN_WAVE, WG_MTS, WG_STAGES, WG_UNROLL, WG_WIDE, WS_F16DEC, WS_MIN_WAVE,
                                      WS_MTS, WS_PFENCE, WS_PSPLIT, WS_XCAST, WS_SPLIT_FIRST, WS_SPLIT_FIRST_MIN_CHUNKS,
                                      WS_SPLIT_SMALL, WS_SPLIT_K, WS_SPLIT_K_PARTS, WS_SPLIT_K_TILES,
                                      WS_SPLIT_MIN_CHUNKS, WS_STAGES, WS_STAGES_BY_TILE, WS_STREAMK,
                                      WS_STREAMK_MIN_ROWS, WS_TILE_FILL,
                                      WS_WIDE, WS_WIDE_256, WS_XTMA, XTMA_WHOLE_TILES, ws_shared_bytes)
from realizar.gpu.policy.shapes import WgConfig, WsConfig

__all__ = ["GemmWgOps", "SplitSpace", "WgConfig", "WsConfig", "split_room", "wg_applies", "wg_config", "ws_config"]


def wg_applies(device: Any, wtype: str, layout: str, in_dim: int) -> bool:
    """Whether the warpgroup GEMM runs on ``device`` for a weight of ``wtype`` in ``layout`` with rows of
    ``in_dim`` values: a real sm_90 GPU (the emulator runs these kernels in their own oracle tests; the emulated
    device's models keep the f16 GEMM, whose small tiles it runs faster), whole chunks of 256, the types and
    layouts ``gemm_q`` decodes but F32 (whose ring leaves no room for the X buffers)."""
    from ptx_gen.kernels.gemm.qstream import CHUNK

    return (not getattr(device, "emulated", False) and device.target.compute_capability == (9, 0)
            and in_dim % CHUNK == 0 and wtype != "F32" and layout in ("rows", "tiles", "glu-tiles"))


def wg_config(wtype: str, in_dim: int, layout: str, rows_out: int, m: int, sm_count: int = 132,
              max_smem: int = 227 * 1024, glu: bool = False) -> WgConfig:
    """The launch shape for ``rows_out`` outputs of ``in_dim`` values at ``m`` tokens: two row groups a CTA for
    wide launches (``WG_WIDE`` warpgroups of 128-token tiles per SM or more), else K split in two (where there are
    4 chunks or more);
    the largest token tile of ``WG_MTS`` below ``2 m`` whose launch has ``WG_MIN_WAVE`` x ``sm_count`` CTAs (else
    the smallest); the first ring depth of ``WG_STAGES`` that fits ``max_smem`` (else fewer parts)."""
    from ptx_gen.kernels.gemm.gemm_wg import smem_bytes

    groups = -(-rows_out // (32 if glu else 64))  # 64-row warpgroups (glu: 32 outputs)
    wide = groups * -(-m // 128) >= WG_WIDE * sm_count
    rgroups, kparts = (2, 1) if wide else (1, 2 if in_dim // 256 >= 4 else 1)
    tiles = [t for t in WG_MTS if t < 2 * m and (t >= 64 or m <= 32)] or [WG_MTS[-1]]
    mt = next((t for t in tiles if -(-groups // rgroups) * -(-m // t) >= WG_MIN_WAVE * sm_count), tiles[-1])
    for rg, kp in ((rgroups, kparts), (1, kparts), (1, 1)):
        for t in [mt] + [t for t in tiles if t < mt]:
            for stages in WG_STAGES:
                if (t < 256 or rg * kp <= 2) and smem_bytes(wtype, in_dim, layout, t, rg, kp, stages) <= max_smem:
                    return WgConfig(t, rg, kp, stages, WG_UNROLL)
    raise ShapeError(f"no warpgroup GEMM tile for {wtype} {layout} fits {max_smem} bytes of shared memory")


def ws_config(wtype: str, in_dim: int, layout: str, rows_out: int, m: int, sm_count: int = 132,
              max_smem: int = 227 * 1024, glu: bool = False) -> WsConfig:
    """The launch shape of the warp-specialized GEMM for ``rows_out`` outputs of ``in_dim`` values at ``m`` tokens: the
    largest token tile of ``WS_MTS`` that ``m`` fills more than ``WS_TILE_FILL`` of whose launch has ``WS_MIN_WAVE``
    x ``sm_count`` CTAs (else the smallest); two consumer warpgroups on a 128-token tile where the launch keeps
    ``WS_WIDE`` CTAs an SM, on a 256-token tile where it keeps ``WS_WIDE_256``; the deepest ring of ``WS_STAGES``
    (``WS_STAGES_BY_TILE``'s on its launch shapes) that fits ``max_smem``; X by a tensor map where ``WS_XTMA``; the
    weights decoded in f16x2 arithmetic where ``WS_F16DEC`` and the type has that decoder; K split over two CTAs of
    the largest tile where a smaller tile would be taken, that tile is one of ``WS_SPLIT_FIRST`` and each part keeps
    ``WS_SPLIT_FIRST_MIN_CHUNKS`` chunks, else K split in two on the smallest tile where its launch has fewer than
    ``WS_SPLIT_SMALL`` CTAs an SM; then, for a launch of one consumer warpgroup a CTA (not split already on a tile
    outside ``WS_SPLIT_K_TILES``), the largest tile of ``WS_SPLIT_K_TILES`` (that m fills as above) with two
    warpgroups a CTA and K split over the first part count of ``WS_SPLIT_K_PARTS`` (above the launch's own on its
    tile) whose launch has ``WS_SPLIT_K`` CTAs an SM and whose parts keep ``WS_SPLIT_MIN_CHUNKS`` chunks each; the
    first producer split of ``WS_PSPLIT`` whose CTA has the registers; ``WS_PFENCE`` stages fenced at once where it
    allows; X shared by ``WS_XCAST`` CTAs of a cluster with X by a tensor map; Stream-K where ``WS_STREAMK`` and
    ``WS_STREAMK_MIN_ROWS`` take the launch."""
    from ptx_gen.kernels.gemm.gemm_ws import consumers_fit, smem_bytes
    from ptx_gen.kernels.gemm.qstream import F16DEC_TYPES

    groups = -(-rows_out // (32 if glu else 64))  # 64-row warpgroups (glu: 32 outputs)
    tiles = [t for t in WS_MTS if m > WS_TILE_FILL * t] or [WS_MTS[-1]]
    mt = next((t for t in tiles if groups * -(-m // t) >= WS_MIN_WAVE * sm_count), tiles[-1])
    kp, chunks = 1, in_dim // 256
    if (tiles[0] in WS_SPLIT_FIRST and mt < tiles[0] and chunks % 2 == 0 and chunks // 2 >= WS_SPLIT_FIRST_MIN_CHUNKS
            and 2 * groups * -(-m // tiles[0]) >= WS_MIN_WAVE * sm_count):
        mt, kp = tiles[0], 2  # (the largest tile, K split over two CTAs)
    elif mt == WS_MTS[-1] and chunks % 2 == 0 and groups * -(-m // mt) < WS_SPLIT_SMALL * sm_count:
        kp = 2  # (the smallest tile, K split over two CTAs)
    wide = {128: WS_WIDE, 256: WS_WIDE_256}.get(mt)
    rg = 2 if kp == 1 and wide is not None and -(-groups // 2) * -(-m // mt) >= wide * sm_count else 1
    if rg == 1 and WS_SPLIT_K and (kp == 1 or mt in WS_SPLIT_K_TILES):  # (the largest tile of WS_SPLIT_K_TILES with
        # two warpgroups and enough parts; a K split on another tile stays)
        mt, rg, kp = next(((t, 2, p) for t in tiles if t in WS_SPLIT_K_TILES for p in WS_SPLIT_K_PARTS
                           if p > (kp if t == mt else 1) and chunks % p == 0 and chunks // p >= WS_SPLIT_MIN_CHUNKS
                           and p * -(-groups // 2) * -(-m // t) >= WS_SPLIT_K * sm_count), (mt, rg, kp))
    cast = WS_XCAST if WS_XTMA else 1
    for r, kparts in dict.fromkeys([(rg, kp), (1, 1)]):
        for ps in dict.fromkeys(WS_PSPLIT + (1,)):
            if not consumers_fit(mt, r, ps):
                continue
            for stages in dict(WS_STAGES_BY_TILE).get((mt, r, kparts), WS_STAGES):
                smem = smem_bytes(wtype, in_dim, layout, mt, r, stages, 2, ps, cast)
                if ps <= stages and smem <= max_smem:
                    fence = WS_PFENCE if ps == 1 and WS_PFENCE < stages else 1
                    tiles = -(-groups // r) * -(-m // mt)
                    waves = -(-tiles // sm_count)
                    sk = bool(WS_STREAMK and m >= WS_STREAMK_MIN_ROWS and kparts == ps == cast == 1 and WS_XTMA
                              and 2 * smem > max_smem
                              and tiles > sm_count and waves * sm_count - tiles > WS_STREAMK * waves * sm_count)
                    return WsConfig(mt, r, stages, 2, WS_XTMA, WS_F16DEC and wtype in F16DEC_TYPES, kparts, ps, fence,
                                    cast, streamk=sk)
    raise ShapeError(f"no warp-specialized GEMM tile for {wtype} {layout} fits {max_smem} bytes of shared memory")


# the policy names ws_config reads (a tool may change them between steps: the rooms sized from a launch shape key on
# them)
WS_POLICY = ("WS_MTS", "WS_TILE_FILL", "WS_MIN_WAVE", "WS_WIDE", "WS_WIDE_256", "WS_STAGES", "WS_XTMA", "WS_F16DEC",
             "WS_SPLIT_K", "WS_SPLIT_K_TILES", "WS_SPLIT_K_PARTS", "WS_SPLIT_MIN_CHUNKS", "WS_SPLIT_FIRST",
             "WS_PSPLIT", "WS_PFENCE", "WS_SPLIT_FIRST_MIN_CHUNKS", "WS_SPLIT_SMALL", "WS_XCAST",
             "WS_STAGES_BY_TILE", "WS_STREAMK", "WS_STREAMK_MIN_ROWS")


def ws_policy() -> tuple:
    """The values of :data:`WS_POLICY` that ws_config reads now."""
    return tuple(globals()[name] for name in WS_POLICY)


def _row_tiles(cfg: WsConfig, cols: int, glu: bool) -> int:
    """The launch's CTAs along the weight rows: whole clusters of ``cfg.xcast`` (the last one's rows past the weight's
    compute nothing that is written)."""
    tiles = -(-cols // ((8 if glu else 16) * 4 * cfg.rgroups))
    return -(-tiles // cfg.xcast) * cfg.xcast


def split_room(cfg: WsConfig, cols: int, m: int, glu: bool = False) -> tuple[int, int]:
    """(f32 partial sums, u32 counters) a gemm_ws launch of ``cfg`` over ``cols`` outputs and ``m`` tokens needs in its
    :class:`SplitSpace` ((0, 0) without a K split)."""
    from ptx_gen.kernels.gemm.gemm_ws import part_floats

    if cfg.kparts == 1 and not cfg.streamk:
        return 0, 0
    tiles = _row_tiles(cfg, cols, glu) * -(-m // cfg.mt)
    return tiles * part_floats(cfg.mt, cfg.rgroups, 2 if cfg.streamk else cfg.kparts), tiles


@dataclasses.dataclass
class SplitSpace:
    """The room of gemm_ws launches that split K over two CTAs: their partial sums and a counter per output tile (zero,
    and left at zero by every launch). One launch at a time uses it (a stream's launches run in turn)."""

    part: Any
    counters: Any

    def fits(self, floats: int, tiles: int) -> bool:
        return self.part.count >= floats and self.counters.count >= tiles

    def free(self) -> None:
        self.part.free()
        self.counters.free()


class GemmWgOps(Dispatcher):
    """Launches of the warpgroup-MMA GEMM."""

    def split_space(self, floats: int, tiles: int) -> SplitSpace:
        """A :class:`SplitSpace` of ``floats`` partial sums and ``tiles`` counters (synchronous: outside a capture)."""
        return SplitSpace(self.buffer(max(1, floats)), self.buffer(max(1, tiles), np.uint32, zero=True))

    def gemm_wg(self, x16: Any, weight: Any, out: Any, m: int, *, lda: int | None = None, ldy: int | None = None,
                bias: Any = None, residual: Any = None, out_f16: bool = False, glu: bool = False,
                config: WgConfig | None = None, stream: Any = None) -> None:
        """``out[:m] = x16[:m] W^T (+ bias) (+ residual)`` for the GpuWeight W; with ``glu`` W is [gate; up]
        (GGUF rows or "glu-tiles") and ``out[:m, :ffn] = silu(x G^T) * (x U^T)``. ``residual`` may be ``out``.
        Any m; no allocation or synchronisation (capturable). Needs sm_90 (the kernel is sm_90a)."""
        self._launch_wgmma("gemm_wg", x16, weight, out, m, lda, ldy, bias, residual, out_f16, glu, config, stream)

    def gemm_ws(self, x16: Any, weight: Any, out: Any, m: int, *, lda: int | None = None, ldy: int | None = None,
                bias: Any = None, residual: Any = None, out_f16: bool = False, glu: bool = False,
                config: WsConfig | None = None, split: SplitSpace | None = None, stream: Any = None) -> None:
        """:meth:`gemm_wg`'s product on the warp-specialized kernel (producer warps decode into shared memory,
        consumer warpgroups issue the MMAs). A launch shape that splits K over two CTAs needs ``split`` with the
        room :func:`split_room` names (:meth:`split_space`)."""
        self._launch_wgmma("gemm_ws", x16, weight, out, m, lda, ldy, bias, residual, out_f16, glu, config, stream,
                           split)

    @staticmethod
    def _x_rows(x16: Any, m: int, k: int, lda: int, mt: int) -> int:
        """The rows of X's tensor map: ``m``, or with :data:`XTMA_WHOLE_TILES` up to whole ``mt``-token tiles as far
        as the buffer holds rows."""
        if not XTMA_WHOLE_TILES:
            return m
        buf, off = x16 if isinstance(x16, tuple) else (x16, 0)
        return max(m, min(-(-m // mt) * mt, (buf.count - off - k) // lda + 1))

    def _launch_wgmma(self, name: str, x16: Any, weight: Any, out: Any, m: int, lda: int | None, ldy: int | None,
                      bias: Any, residual: Any, out_f16: bool, glu: bool, config: Any, stream: Any,
                      split: SplitSpace | None = None) -> None:
        """Check the operands, pick the launch shape (``config`` or the kernel's policy) and launch ``name``."""
        from realizar.cuda.tensormap import f16_tiles_2d
        from realizar.gpu.gemm import quantized_operands
        from realizar.gpu.weights import GpuWeight

        if not isinstance(weight, GpuWeight):
            raise ShapeError(f"weight must be a GpuWeight, got {type(weight).__name__}")
        if not wg_applies(self.device, weight.wtype, weight.layout, weight.in_dim):
            raise ShapeError(f"the warpgroup GEMM runs on sm_90 over weights with rows of whole chunks of 256; "
                             f"GpuWeight {weight.name!r} is {weight.wtype} {weight.layout} of {weight.in_dim} on "
                             f"{self.device.target}")
        m = self.check_int("m", m)
        n, k, cols, lda, ldy = quantized_operands(weight, lda, ldy, glu, bias, residual, name)
        pick = ws_config if name == "gemm_ws" else wg_config
        cfg = config or pick(weight.wtype, k, weight.layout, cols, m, self.sm_count,
                             self.device.max_shared_per_block_optin, glu=glu)
        kern = self.kernel(name, wtype=weight.wtype, in_dim=k, layout=weight.layout, **dataclasses.asdict(cfg),
                           bias=bias is not None, residual=residual is not None, out_f16=bool(out_f16), glu=bool(glu))
        values = {"w": weight.ptr, "x": self.addr(x16, (m - 1) * lda + k, "x16", np.float16),
                  **self.epilogue(out, (m - 1) * ldy + cols, out_f16, bias, cols, residual)}
        values.update(m=m, n=n, lda=lda, ldy=ldy)
        xcast = getattr(cfg, "xcast", 1)
        if getattr(cfg, "xtma", False):  # (the map is encoded on the host: nothing allocated, capturable)
            values["xmap"] = f16_tiles_2d(self.device, values["x"], k, self._x_rows(x16, m, k, lda, cfg.mt), 2 * lda,
                                          64, cfg.mt // xcast)
        grid, buffers = (-(-cols // kern.meta["rows_per_cta"]), -(-m // cfg.mt)), None
        if name == "gemm_ws":  # (whole clusters along the rows)
            grid = (_row_tiles(cfg, cols, glu), grid[1])
        kparts = getattr(cfg, "kparts", 1) if name == "gemm_ws" else 1
        streamk = getattr(cfg, "streamk", False) and name == "gemm_ws"
        if kparts > 1 or streamk:  # (grid z: the CTAs splitting K, or Stream-K's; summed through split's room)
            floats, tiles = split_room(cfg, cols, m, glu)
            if split is None or not split.fits(floats, tiles):
                have = "none" if split is None else f"{split.part.count} floats and {split.counters.count} counters"
                raise ShapeError(f"{cfg} over {cols} outputs and {m} tokens needs a SplitSpace of {floats} floats and "
                                 f"{tiles} counters (GemmWgOps.split_space); got {have}")
            values.update(part=split.part.ptr, counters=split.counters.ptr)
            buffers = {"part": split.part, "counters": split.counters}
            if streamk:  # (at most an SM's worth of CTAs, each a share of every tile's chunks of K)
                values["ntiles"] = grid[0]
                grid = (min(self.sm_count, tiles), 1, 1)
            else:
                grid = (*grid, kparts)
        shared = None
        if name == "gemm_ws":  # (one CTA an SM where the launch has no more CTAs than SMs)
            shared = ws_shared_bytes(kern.launch.dyn_smem, grid[0] * grid[1] * kparts, self.sm_count,
                                     self.device.max_shared_per_sm)
        self.launch(kern, grid, values, stream, buffers=buffers, shared_bytes=shared)
