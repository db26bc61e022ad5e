"""The prefill GEMM on tensor cores (:mod:`ptx_gen.kernels.gemm_mma`) and its launch policy.

    ops.dequantize_f16(weight, w16)                       # the weight's f16 rows (scratch, reused)
    ops.gemm_f16(x16, w16, y, m=S, n=weight.out_dim, k=weight.in_dim, residual=y)

X is f16 ``[m, lda]``, W f16 ``[n, k]`` row-major, Y ``[m, ldy]`` f32 (or f16 with ``out_f16``). With
``glu`` W's rows interleave gate and up and Y gets ``n / 2`` columns of ``silu(gate) * up``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ptx_gen.kernels.gemm_mma import check_tiling, smem_bytes
from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher

__all__ = ["GemmConfig", "GemmOps", "gemm_config"]


@dataclass(frozen=True)
class GemmConfig:
    """A CTA tile ``bm x bn`` (tokens x weight rows) on ``warps_m x warps_n`` warps, ``stages`` K tiles
    of 64 in flight."""

    bm: int = 128
    bn: int = 128
    warps_m: int = 2
    warps_n: int = 2
    stages: int = 3

    def __post_init__(self) -> None:
        try:
            check_tiling(self.bm, self.bn, self.warps_m, self.warps_n, self.stages)
        except ValueError as exc:
            raise ShapeError(f"GemmConfig: {exc}") from None

    @property
    def smem(self) -> int:
        return smem_bytes(self.bm, self.bn, self.stages)

    def ctas(self, m: int, n: int) -> int:
        return -(-m // self.bm) * -(-n // self.bn)


#: tiles the policy chooses from, largest first
_TILES = (GemmConfig(128, 128, 2, 2, 3), GemmConfig(64, 128, 1, 4, 4), GemmConfig(64, 64, 2, 2, 4))


def gemm_config(m: int, n: int, sm_count: int = 132, max_smem: int = 227 * 1024) -> GemmConfig:
    """The largest tile that still gives every SM a CTA (fewer, bigger tiles re-read less of X and W);
    where none does, the smallest. Tiles asking for more shared memory than a CTA may have are skipped."""
    fits = [c for c in _TILES if c.smem <= max_smem] or [GemmConfig(64, 64, 2, 2, 2)]
    for cfg in fits:
        if cfg.ctas(m, n) >= sm_count:
            return cfg
    return fits[-1]


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
        span = (m - 1) * ldy + cols
        values = {"x": self.addr(x, (m - 1) * lda + k, "x", np.float16),
                  "w": self.addr(w, n * k, "w", np.float16),
                  "y": self.addr(out, span, "out", np.float16 if out_f16 else np.float32, align=4)}
        if bias is not None:
            values["bias"] = self.addr(bias, n, "bias", align=4)
        if residual is not None:
            values["residual"] = self.addr(residual, span, "residual", align=4)
        values.update(m=m, n=n, k=k, lda=lda, ldy=ldy)
        self.launch(kern, (-(-m // cfg.bm), -(-n // cfg.bn)), values, stream)
