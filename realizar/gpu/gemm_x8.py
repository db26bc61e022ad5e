"""The int8 batch GEMM: X quantized to x8 (:mod:`ptx_gen.kernels.gemm.x8`) multiplied with the quantized weights
as the decode GEMV stores them (tile-major), on int8 tensor cores, no f16 copy of the weights.

    ops.quantize_x8(x16, q, s, m, k)                      # X (f16 or f32 rows) -> codes + records
    ops.gemm_x8(q, s, weight, out, m, residual=h)         # out[:m] = X W^T + h

:func:`x8_buffers` sizes the codes and records for ``m`` rows of ``k`` values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.policy.gemm import X8_STAGES, X8_TILES
from realizar.gpu.policy.shapes import X8Config

__all__ = ["GemmX8Ops", "X8Config", "x8_applies", "x8_buffers", "x8_config"]


def x8_applies(wtype: str, layout: str, in_dim: int) -> bool:
    """Whether the int8 GEMM reads a weight of ``wtype`` stored in ``layout`` with rows of ``in_dim``."""
    from ptx_gen.kernels.gemm.gemm_x8 import X8_TYPES

    return wtype in X8_TYPES and layout in ("tiles", "glu-tiles") and in_dim % 256 == 0


def x8_buffers(ops: Any, m: int, k: int) -> tuple[Any, Any]:
    """(codes, records) device buffers for ``m`` rows of ``k`` values (codes rows ``k`` bytes apart)."""
    from ptx_gen.kernels.gemm.x8 import RECORD, UNIT

    if k % UNIT:
        raise ShapeError(f"x8 rows hold whole units of {UNIT} values, got k={k}")
    return ops.buffer(m * k, np.int8), ops.buffer(m * (k // UNIT) * RECORD, np.uint8)


def x8_config(wtype: str, m: int, max_smem: int = 227 * 1024) -> X8Config:
    """The CTA shape for ``m`` tokens (``X8_TILES``), with the deepest ring of ``X8_STAGES`` that fits the
    device's shared memory, else with fewer weight tiles a CTA."""
    from ptx_gen.kernels.gemm.gemm_x8 import smem_bytes

    cfg = next(c for most, c in X8_TILES if most is None or m <= most)
    wn = cfg.wn
    while wn >= 1:
        for stages in (cfg.stages, *[s for s in X8_STAGES if s < cfg.stages]):
            if smem_bytes(wtype, wn, cfg.wm, cfg.tn, stages) <= max_smem:
                return X8Config(wn, cfg.wm, cfg.tn, stages)
        wn //= 2
    raise ShapeError(f"no int8 GEMM tile for {wtype} fits {max_smem} bytes of shared memory")


class GemmX8Ops(Dispatcher):
    """Launches of the activation quantizer and the int8 batch GEMM."""

    def quantize_x8(self, x: Any, q: Any, s: Any, m: int, k: int, *, lda: int | None = None, xh: bool = True,
                    stream: Any = None) -> None:
        """X (``m`` rows of ``k`` values, ``lda`` apart; f16 with ``xh``, else f32) to x8 codes (rows ``k``
        bytes apart) in ``q`` and records in ``s``."""
        from ptx_gen.kernels.gemm.x8 import RECORD, UNIT

        m, k = self.check_int("m", m), self.check_int("k", k)
        lda = k if lda is None else self.check_int("lda", lda)
        if k % UNIT or lda % 8 or lda < k:
            raise ShapeError(f"quantize_x8 needs k a multiple of {UNIT} and lda a multiple of 8 of at least k, "
                             f"got k={k}, lda={lda}")
        kern = self.kernel("quantize_x8", in_dim=k, xh=bool(xh))
        units = k // UNIT
        values = {"x": self.addr(x, (m - 1) * lda + k, "x", np.float16 if xh else np.float32),
                  "q": self.addr(q, m * k, "q", np.int8), "s": self.addr(s, m * units * RECORD, "s", np.uint8),
                  "lda": lda, "ldq": k}
        self.launch(kern, (-(-units // kern.meta["units_per_cta"]), m), values, stream)

    def gemm_x8(self, q: Any, s: Any, weight: Any, out: Any, m: int, *, ldy: int | None = None, bias: Any = None,
                residual: Any = None, out_f16: bool = False, glu: bool = False, config: X8Config | None = None,
                stream: Any = None) -> None:
        """``out[:m] = X W^T (+ bias) (+ residual)`` for X in x8 (``q``, ``s`` of :meth:`quantize_x8`, rows of
        ``weight.in_dim``) and the tile-major GpuWeight W; with ``glu`` W is [gate; up] ("glu-tiles") and
        ``out[:m, :ffn] = silu(x G^T) * (x U^T)``. ``residual`` may be ``out``. Capturable."""
        from ptx_gen.kernels.gemm.x8 import RECORD, UNIT
        from realizar.gpu.weights import GpuWeight

        if not isinstance(weight, GpuWeight):
            raise ShapeError(f"weight must be a GpuWeight, got {type(weight).__name__}")
        m = self.check_int("m", m)
        n, k = weight.out_dim, weight.in_dim
        if not x8_applies(weight.wtype, weight.layout, k):
            raise ShapeError(f"the int8 GEMM reads tile-major weights of its types with rows of whole units of 256; "
                             f"GpuWeight {weight.name!r} is {weight.wtype} {weight.layout} of {k}")
        if (weight.layout == "glu-tiles") != bool(glu):
            raise ShapeError(f"GpuWeight {weight.name!r} is {weight.layout}: glu={glu} does not match")
        if glu and (bias is not None or residual is not None):
            raise ShapeError("the SwiGLU GEMM takes no bias or residual")
        cols = n // 2 if glu else n
        ldy = cols if ldy is None else self.check_int("ldy", ldy)
        if ldy < cols:
            raise ShapeError(f"ldy={ldy} must be at least the {cols} output columns")
        cfg = config or x8_config(weight.wtype, m, self.device.max_shared_per_block_optin)
        kern = self.kernel("gemm_x8", wtype=weight.wtype, in_dim=k, layout=weight.layout, wn=cfg.wn, wm=cfg.wm,
                           tn=cfg.tn, stages=cfg.stages, bias=bias is not None, residual=residual is not None,
                           out_f16=bool(out_f16), glu=bool(glu))
        values = {"w": weight.ptr, "xq": self.addr(q, m * k, "q", np.int8),
                  "xs": self.addr(s, m * (k // UNIT) * RECORD, "s", np.uint8),
                  **self.epilogue(out, (m - 1) * ldy + cols, out_f16, bias, cols, residual)}
        values.update(m=m, n=n, ldq=k, ldy=ldy)
        self.launch(kern, (-(-m // kern.meta["tokens_per_cta"]), -(-cols // kern.meta["rows_per_cta"])), values,
                    stream)
