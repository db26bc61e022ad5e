"""Mixture-of-experts launches: the router's top-k on the device and the weighted sum of the experts' outputs
(:mod:`ptx_gen.kernels.moe.route`), both capturable (no allocation, no synchronisation).

    ops.moe_route(logits, ids, weights, rows, experts=128, used=8)   # ids, weights [rows, used]
    ops.moe_combine(x, y, weights, rows, hidden, used=8)             # x += sum_s weights[:, s] y[:, s]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher

__all__ = ["MoeOps"]


class MoeOps(Dispatcher):
    """Launches of the mixture-of-experts kernels."""

    def moe_route(self, logits: Any, ids: Any, weights: Any, rows: int, *, experts: int, used: int, norm: bool = True,
                  stream: Any = None) -> None:
        """``ids [rows, used]`` (u32) and ``weights [rows, used]`` (f32): each row's ``used`` experts of largest
        router logit (``logits [rows, experts]`` f32; the lower expert first among equal ones) and their softmax
        probabilities, renormalised to sum to 1 with ``norm``."""
        rows, experts, used = self.check_int("rows", rows), self.check_int("experts", experts), self.check_int("used", used)
        if used > experts:
            raise ShapeError(f"used={used} experts a token exceeds the {experts} experts")
        kern = self.kernel("moe_route", experts=experts, used=used, norm=bool(norm))
        values = {"logits": self.addr(logits, rows * experts, "logits"),
                  "ids": self.addr(ids, rows * used, "ids", np.uint32, align=4),
                  "weights": self.addr(weights, rows * used, "weights", align=4), "rows": rows}
        self.launch(kern, -(-rows // kern.meta["rows_per_cta"]), values, stream)

    def moe_combine(self, x: Any, y: Any, weights: Any, rows: int, hidden: int, *, used: int,
                    stream: Any = None) -> None:
        """``x[r] += sum_s weights[r, s] * y[r, s]`` for ``x [rows, hidden]``, the experts' outputs ``y [rows, used,
        hidden]`` and ``weights [rows, used]`` (all f32)."""
        rows, hidden, used = self.check_int("rows", rows), self.check_int("hidden", hidden), self.check_int("used", used)
        kern = self.kernel("moe_combine", used=used)
        values = {"x": self.addr(x, rows * hidden, "x", align=4), "y": self.addr(y, rows * used * hidden, "y", align=4),
                  "weights": self.addr(weights, rows * used, "weights", align=4), "hidden": hidden}
        self.launch(kern, (-(-hidden // kern.meta["block"]), rows), values, stream)
