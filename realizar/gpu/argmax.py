"""Greedy sampling on the device: argmax in two launches (per-block partials, then one final block)
over a scratch buffer allocated once, so the step that ends in it can live in a CUDA graph."""

from __future__ import annotations

from typing import Any

import numpy as np

from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher

__all__ = ["ARGMAX_SCRATCH", "ArgmaxOps"]

_ARGMAX_PARTIALS = 1024
ARGMAX_SCRATCH = _ARGMAX_PARTIALS  # u64 elements of an argmax partials buffer


class ArgmaxOps(Dispatcher):
    def __init__(self, device: Any = None):
        super().__init__(device)
        self._argmax_scratch = self.buffer(_ARGMAX_PARTIALS, np.uint64)

    def argmax(self, x: Any, out: Any, n: int | None = None, stream: Any = None, scratch: Any = None) -> None:
        """out[0] (u32) = argmax of x[0:n] (ties: lowest index; NaN counts as the maximum). ``scratch``:
        the partials buffer (u64; ARGMAX_SCRATCH elements hold the partials of any n), default this dispatcher's own; a caller whose launches
        may run on another stream at the same time as other argmaxes brings its own."""
        if n is None:
            buf = x[0] if isinstance(x, tuple) else x
            n = buf.count - (x[1] if isinstance(x, tuple) else 0)
        n = self.check_int("n", n)
        if n >= 1 << 31:
            raise ShapeError(f"argmax handles fewer than 2**31 elements, got {n}")
        part = self.kernel("argmax_partial", block=256)
        final = self.kernel("argmax_final", block=1024)
        p = int(min(_ARGMAX_PARTIALS, max(1, 2 * self.sm_count), -(-n // 256)))
        partials = self._argmax_scratch if scratch is None else self.addr(scratch, p, "scratch", np.uint64, align=8)
        self.launch(part, p, {"x": self.addr(x, n, "x", align=4), "partials": partials, "n": n}, stream)
        self.launch(final, 1, {"partials": partials, "out": self.addr(out, 1, "out", np.uint32, align=4),
                               "n_partials": p}, stream)
