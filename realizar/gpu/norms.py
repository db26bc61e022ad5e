"""RMSNorm: ``out = rmsnorm(h) * weight`` per row, optionally fused with the residual add."""

from __future__ import annotations

from typing import Any

import numpy as np

from ptx_gen.kernels.elementwise.rmsnorm import MAX_HIDDEN, default_block
from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher

__all__ = ["NormOps"]


class NormOps(Dispatcher):
    def rmsnorm(self, x: Any, weight: Any, out: Any, eps: float, hidden: int | None = None, rows: int = 1,
                residual: Any = None, stream: Any = None, out_f16: bool = False) -> None:
        """out = rmsnorm(h) * weight per row (``rows`` rows of ``hidden`` values), h = x, or h = residual
        + x stored back to ``residual``. ``hidden`` defaults to the length of ``weight``. ``out_f16``:
        ``out`` is a float16 buffer (values rounded to nearest even), else float32."""
        rows = self.check_int("rows", rows)
        if hidden is None:
            buf = weight[0] if isinstance(weight, tuple) else weight
            hidden = buf.count - (weight[1] if isinstance(weight, tuple) else 0)
        hidden = self.check_int("hidden", hidden)
        if hidden % 4 or hidden > MAX_HIDDEN:
            raise ShapeError(f"hidden must be a multiple of 4 up to {MAX_HIDDEN}, got {hidden}")
        kern = self.kernel("rmsnorm_f16" if out_f16 else "rmsnorm", hidden=hidden, block=default_block(hidden),
                           residual=residual is not None)
        values = {"x": self.addr(x, rows * hidden, "x"), "weight": self.addr(weight, hidden, "weight"),
                  "y": self.addr(out, rows * hidden, "out", np.float16, align=8) if out_f16
                  else self.addr(out, rows * hidden, "out")}
        if residual is not None:
            values["residual"] = self.addr(residual, rows * hidden, "residual")
        values["eps"] = float(eps)
        self.launch(kern, rows, values, stream)
