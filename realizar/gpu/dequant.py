"""A GGUF weight expanded to f16: the operand the tensor-core GEMM of prefill reads, made from the one
weight copy the decode GEMV reads (:mod:`ptx_gen.kernels.dequant`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ptx_gen.kernels.dequant.dequant import total_rounds
from ptx_gen.kernels.gemv.quant_layout import DENSE
from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.policy.dequant import DEQUANT_WARPS_BLOCKS, DEQUANT_WARPS_DENSE
from realizar.gpu.weights import GpuWeight

__all__ = ["DequantOps", "dequant_warps"]

MAX_VALUES = 2**32  # the kernel indexes values with 32-bit integers


def dequant_warps(wtype: str) -> int:
    """Warps per CTA of the dequantization: ``DEQUANT_WARPS_DENSE`` for F32/F16/BF16, else
    ``DEQUANT_WARPS_BLOCKS`` (tuned with ``tools/bench_dequant.py --sweep``)."""
    return DEQUANT_WARPS_DENSE if wtype in DENSE else DEQUANT_WARPS_BLOCKS


class DequantOps(Dispatcher):
    """Dequantization of GPU weights into f16 matrices."""

    def dequantize_f16(self, weight: GpuWeight, out: Any, interleave: bool = False, stream: Any = None) -> None:
        """out[r, c] = W[r, c] as f16, row-major ``[out_dim, in_dim]`` (``out``: a float16 GpuBuffer or
        ``(buffer, element offset)``, 16-byte aligned, of at least ``out_dim * in_dim`` elements), for W in
        any layout (GGUF rows, "tiles" or "glu-tiles"). Values are GGUF's float32 dequantized values
        rounded to the nearest f16 (ties to even; 65520 and above in magnitude become infinities).
        With ``interleave`` W is [gate; up] (an even number of rows, 2 ffn) and output row 2j is gate
        row j, row 2j + 1 up row j (the operand of the GEMM's fused SwiGLU); a "glu-tiles" weight is
        always [gate; up] and without ``interleave`` comes out as [gate; up]."""
        if not isinstance(weight, GpuWeight):
            raise ShapeError(f"weight must be a GpuWeight, got {type(weight).__name__}")
        out_dim, in_dim = weight.out_dim, weight.in_dim
        if (interleave or weight.layout == "glu-tiles") and out_dim % 2:
            raise ShapeError(f"GpuWeight {weight.name!r}: a [gate; up] weight (interleave or glu-tiles) needs an even "
                             f"number of rows, got {out_dim}")
        count = out_dim * in_dim
        if count >= MAX_VALUES:
            raise ShapeError(f"GpuWeight {weight.name!r}: {out_dim} x {in_dim} = {count} values, the f16 "
                             f"dequantization takes fewer than {MAX_VALUES}")
        n_rounds = total_rounds(weight.wtype, in_dim, weight.layout, out_dim)
        kern = self.kernel("dequant_f16", wtype=weight.wtype, in_dim=in_dim, layout=weight.layout,
                           interleave=bool(interleave), warps=dequant_warps(weight.wtype))
        values = {"w": weight.ptr, "out": self.addr(out, count, "out", np.float16, align=16), "out_dim": out_dim}
        self.launch(kern, -(-n_rounds // kern.meta["rounds_per_cta"]), values, stream)
