"""The prefill GEMM on tensor cores (:mod:`ptx_gen.kernels.gemm_mma`) and the code that picks its launch shape
from the tables of :mod:`realizar.gpu.policy.gemm`.

    ops.dequantize_f16(weight, w16)                       # the weight's f16 rows (scratch, reused)
    ops.gemm_f16(x16, w16, y, m=S, n=weight.out_dim, k=weight.in_dim, residual=y)

X is f16 ``[m, lda]``, W f16 ``[n, k]`` row-major, Y ``[m, ldy]`` f32 (or f16 with ``out_f16``). With
``glu`` W's rows interleave gate and up and Y gets ``n / 2`` columns of ``silu(gate) * up``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher, check_int
from realizar.gpu.policy.gemm import (GEMM_FALLBACK_TILE, GEMM_Q_CTA_WARPS, GEMM_Q_MAX_KPARTS, GEMM_Q_STAGES,
                                     GEMM_Q_WARPS_PER_SM, GEMM_SMALL_M, GEMM_SMALL_M_TILES, GEMM_TILES)
from realizar.gpu.policy.shapes import GemmConfig, GemmQConfig

__all__ = ["GemmConfig", "GemmOps", "GemmQConfig", "gemm_config", "gemm_q_config", "quantized_operands"]


#: the tables' old names (tools/bench_gemm.py sweeps them)
_TILES, _SMALL_M_TILES = GEMM_TILES, GEMM_SMALL_M_TILES


def gemm_config(m: int, n: int, sm_count: int = 132, max_smem: int = 227 * 1024) -> GemmConfig:
    """The largest tile that still gives every SM a CTA (fewer, bigger tiles re-read less of X and W);
    where none does, the smallest; up to ``GEMM_SMALL_M`` tokens from the small-M tiles. Tiles asking for
    more shared memory than a CTA may have are skipped (none left: ``GEMM_FALLBACK_TILE``)."""
    fits = [c for c in (GEMM_SMALL_M_TILES if m <= GEMM_SMALL_M else GEMM_TILES) if c.smem <= max_smem] or [
        GEMM_FALLBACK_TILE]
    for cfg in fits:
        if cfg.ctas(m, n) >= sm_count:
            return cfg
    return fits[-1]


def quantized_operands(weight: Any, lda: int | None, ldy: int | None, glu: bool, bias: Any, residual: Any,
                       kernel: str) -> tuple[int, int, int, int, int]:
    """(n, k, output columns, lda, ldy) of a GEMM of f16 X over the quantized GpuWeight ``weight`` (``gemm_q``,
    ``gemm_wg``), its layout, SwiGLU epilogue, size and strides checked (``kernel`` names it in errors)."""
    n, k = weight.out_dim, weight.in_dim
    if weight.layout == "glu-tiles" and not glu:
        raise ShapeError(f"GpuWeight {weight.name!r} is stored glu-tiles ([gate; up] for the fused GEMV): "
                         f"only the glu GEMM reads it")
    if glu and (n % 2 or bias is not None or residual is not None):
        raise ShapeError(f"the SwiGLU GEMM needs a [gate; up] weight of an even number of rows and no bias or "
                         f"residual, got {n} rows")
    if glu and weight.layout == "tiles":
        raise ShapeError(f"GpuWeight {weight.name!r} is stored tiles (a plain GEMV's layout): the glu GEMM reads "
                         f"[gate; up] as GGUF rows or glu-tiles")
    if weight.nbytes + 16 >= 2**32:
        raise ShapeError(f"GpuWeight {weight.name!r}: {weight.nbytes} bytes, {kernel} addresses fewer than 2**32")
    lda = k if lda is None else check_int("lda", lda)
    cols = n // 2 if glu else n
    ldy = cols if ldy is None else check_int("ldy", ldy)
    if lda % 8 or lda < k:
        raise ShapeError(f"x16 rows are read in 16-byte pieces: lda must be a multiple of 8 and at least k={k}, "
                         f"got {lda}")
    if ldy < cols:
        raise ShapeError(f"ldy={ldy} must be at least the {cols} output columns")
    return n, k, cols, lda, ldy


class GemmOps(Dispatcher):
    """Tensor-core f16 GEMM launches."""

    def gemm_f16(self, x: Any, w: Any, out: Any, m: int, n: int, k: int, *, lda: int | None = None,
                 ldy: int | None = None, bias: Any = None, residual: Any = None, out_f16: bool = False,
                 glu: bool = False, config: GemmConfig | None = None, stream: Any = None) -> None:
        """``out[:m, :n] = x[:m, :k] w[:n, :k]^T (+ bias) (+ residual)`` (f16 x and w, f32 accumulation);
        with ``glu`` (w rows gate0, up0, gate1, up1, ...) ``out[:m, :n/2] = silu(gate) * up``.
        ``residual`` may be ``out`` (in place). Needs sm_80 or newer."""
        if self.device.target.compute_capability < (8, 0):
            raise ShapeError(f"the tensor-core GEMM needs sm_80 or newer, this device is {self.device.target}")
        m, n, k = self.check_int("m", m), self.check_int("n", n), self.check_int("k", k)
        lda = k if lda is None else self.check_int("lda", lda)
        cols = n // 2 if glu else n
        ldy = cols if ldy is None else self.check_int("ldy", ldy)
        if k % 8 or lda % 8:
            raise ShapeError(f"the f16 GEMM reads 16-byte chunks: k and lda must be multiples of 8, got {k}, {lda}")
        if lda < k or ldy < cols:
            raise ShapeError(f"row strides lda={lda} and ldy={ldy} must be at least k={k} and {cols} output columns")
        if glu and (n % 2 or bias is not None or residual is not None):
            raise ShapeError(f"the SwiGLU GEMM needs an even n (interleaved gate/up rows) and no bias or residual, "
                             f"got n={n}")
        cfg = config or gemm_config(m, n, self.sm_count, self.device.max_shared_per_block_optin)
        kern = self.kernel("gemm_f16", bm=cfg.bm, bn=cfg.bn, warps_m=cfg.warps_m, warps_n=cfg.warps_n,
                           stages=cfg.stages, bias=bias is not None, residual=residual is not None,
                           out_f16=bool(out_f16), glu=bool(glu))
        values = {"x": self.addr(x, (m - 1) * lda + k, "x", np.float16), "w": self.addr(w, n * k, "w", np.float16),
                  **self.epilogue(out, (m - 1) * ldy + cols, out_f16, bias, n, residual)}
        values.update(m=m, n=n, k=k, lda=lda, ldy=ldy)
        self.launch(kern, (-(-m // cfg.bm), -(-n // cfg.bn)), values, stream)

    def gemm_q(self, x16: Any, weight: Any, out: Any, m: int, *, lda: int | None = None, ldy: int | None = None,
               bias: Any = None, residual: Any = None, out_f16: bool = False, glu: bool = False,
               config: GemmQConfig | None = None, stream: Any = None) -> None:
        """``out[:m] = x16[:m] W^T (+ bias) (+ residual)`` for the GpuWeight W (any layout its GEMV reads;
        f16 X ``[m, lda]``, f32 accumulation on tensor cores, each weight byte read once whatever m);
        with ``glu`` W is [gate; up] (2 ffn rows; GGUF rows or "glu-tiles") and ``out[:m, :ffn] =
        silu(x G^T) * (x U^T)``. ``residual`` may be ``out`` (in place). ``m``: 1..128 tokens. No
        allocation or synchronisation: capturable in a graph. Needs sm_80 or newer."""
        from realizar.gpu.weights import GpuWeight

        if self.device.target.compute_capability < (8, 0):
            raise ShapeError(f"gemm_q needs sm_80 or newer (tensor cores), this device is {self.device.target}")
        if not isinstance(weight, GpuWeight):
            raise ShapeError(f"weight must be a GpuWeight, got {type(weight).__name__}")
        m = self.check_int("m", m)
        if m > GEMM_Q_MAX_M:
            raise ShapeError(f"gemm_q takes 1..{GEMM_Q_MAX_M} tokens, got m={m}")
        n, k, cols, lda, ldy = quantized_operands(weight, lda, ldy, glu, bias, residual, "gemm_q")
        if (m - 1) * lda * 2 >= 2**32:
            raise ShapeError(f"x16 spans {(m - 1) * lda * 2} bytes, gemm_q addresses fewer than 2**32")
        cfg = config or gemm_q_config(weight.wtype, k, cols, m, self.sm_count, self.device.max_shared_per_block_optin,
                                      glu=glu)
        if cfg.mt < m:
            raise ShapeError(f"config.mt={cfg.mt} is smaller than m={m}")
        kern = self.kernel("gemm_q", wtype=weight.wtype, in_dim=k, layout=weight.layout, mt=cfg.mt, warps=cfg.warps,
                           kparts=cfg.kparts, stages=cfg.stages, bias=bias is not None, residual=residual is not None,
                           out_f16=bool(out_f16), glu=bool(glu))
        values = {"w": weight.ptr, "x": self.addr(x16, (m - 1) * lda + k, "x16", np.float16),
                  **self.epilogue(out, (m - 1) * ldy + cols, out_f16, bias, cols, residual)}
        values.update(m=m, n=n, lda=lda, ldy=ldy)
        self.launch(kern, -(-cols // kern.meta["rows_per_cta"]), values, stream)


# ---- small-M GEMM straight from quantized weights (the batched decode step) ----------------------------


GEMM_Q_MAX_M = 128  # the most tokens the kernel's token tiles hold


def gemm_q_config(wtype: str, in_dim: int, rows_out: int, m: int, sm_count: int = 132,
                  max_smem: int = 227 * 1024, glu: bool = False) -> GemmQConfig:
    """The token tile (``m`` rounded up to 8, 16, 32, 64 or 128) and CTA shape for ``rows_out`` outputs of
    ``in_dim`` values: K is split (``kparts``) until the grid has ``GEMM_Q_WARPS_PER_SM`` warps per SM
    (at most ``GEMM_Q_MAX_KPARTS`` parts by token tile: their accumulators leave no registers for more),
    keeping at least 2 chunks of 256 per part, in CTAs of ``GEMM_Q_CTA_WARPS`` warps; then the deepest
    ring of ``GEMM_Q_STAGES`` whose CTA fits twice in ``max_smem`` (once where none does)."""
    from ptx_gen.kernels.gemm.gemm_q import MTS, smem_bytes

    if not 1 <= m <= GEMM_Q_MAX_M:
        raise ShapeError(f"gemm_q takes 1..{GEMM_Q_MAX_M} tokens, got m={m}")
    mt = next(t for t in MTS if t >= m)
    strips = -(-rows_out // (8 if glu else 16))
    nc = -(-in_dim // 256)
    max_parts = next(parts for least, parts in GEMM_Q_MAX_KPARTS if mt >= least)
    kparts = 1
    while kparts < max_parts and strips * kparts < GEMM_Q_WARPS_PER_SM * sm_count and nc >= 4 * kparts:
        kparts *= 2
    warps = max(1, GEMM_Q_CTA_WARPS // kparts)
    layout = "rows"
    for limit in (max_smem // 2, max_smem):
        for stages in GEMM_Q_STAGES:
            if smem_bytes(wtype, in_dim, layout, mt, warps, kparts, stages) <= limit:
                return GemmQConfig(mt, warps, kparts, stages)
    return GemmQConfig(mt, 1, kparts, 2)
