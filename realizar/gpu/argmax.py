"""Greedy sampling on the device: argmax in two launches (per-block partials, then one final block)
over a scratch buffer allocated once, so the step that ends in it can live in a CUDA graph."""

from __future__ import annotations

from typing import Any

import numpy as np

from realizar.errors import ShapeError
from realizar.gpu.dispatch import Dispatcher
from realizar.gpu.policy.sampling import ARGMAX_BLOCK, ARGMAX_CTAS_PER_SM, ARGMAX_FINAL_BLOCK

__all__ = ["ARGMAX_SCRATCH", "ArgmaxOps"]

_ARGMAX_PARTIALS = 1024
ARGMAX_SCRATCH = _ARGMAX_PARTIALS  # u64 elements of an argmax partials buffer


class ArgmaxOps(Dispatcher):
    def __init__(self, device: Any = None):
        super().__init__(device)
        self._argmax_scratch = self.buffer(_ARGMAX_PARTIALS, np.uint64)

    def argmax(self, x: Any, out: Any, n: int | None = None, stream: Any = None, scratch: Any = None) -> None:
        """out[0] (u32) = argmax of x[0:n] (ties: lowest index; NaN counts as the maximum). ``scratch``:
        the partials buffer (u64; ARGMAX_SCRATCH elements hold the partials of any n), default this
        dispatcher's own; a caller whose launches may run on another stream at the same time as other
        argmaxes brings its own."""
        if n is None:
            buf = x[0] if isinstance(x, tuple) else x
            n = buf.count - (x[1] if isinstance(x, tuple) else 0)
        n = self.check_int("n", n)
        if n >= 1 << 31:
            raise ShapeError(f"argmax handles fewer than 2**31 elements, got {n}")
        part = self.kernel("argmax_partial", block=ARGMAX_BLOCK)
        final = self.kernel("argmax_final", block=ARGMAX_FINAL_BLOCK)
        p = int(min(_ARGMAX_PARTIALS, max(1, ARGMAX_CTAS_PER_SM * self.sm_count), -(-n // ARGMAX_BLOCK)))
        partials = self._argmax_scratch if scratch is None else self.addr(scratch, p, "scratch", np.uint64, align=8)
        self.launch(part, p, {"x": self.addr(x, n, "x", align=4), "partials": partials, "n": n}, stream)
        self.launch(final, 1, {"partials": partials, "out": self.addr(out, 1, "out", np.uint32, align=4),
                               "n_partials": p}, stream)

    def argmax_candidate(self, x: Any, out: Any, base: int, n: int, stream: Any = None) -> None:
        """out[0] (u64) = the packed (value, base + index) candidate of x[0:n], a slice starting at element
        ``base`` of a longer vector (a tensor-parallel rank's vocabulary piece). Candidates of the slices,
        gathered side by side, reduce to the whole vector's argmax with :meth:`argmax_packed`."""
        n, base = self.check_int("n", n), self.check_int("base", base, lo=0)
        if n + base >= 1 << 31:
            raise ShapeError(f"argmax handles fewer than 2**31 elements, got a slice [{base}, {base + n})")
        part = self.kernel("argmax_partial", block=ARGMAX_BLOCK)
        pack = self.kernel("argmax_pack", block=ARGMAX_FINAL_BLOCK)
        p = int(min(_ARGMAX_PARTIALS, max(1, ARGMAX_CTAS_PER_SM * self.sm_count), -(-n // ARGMAX_BLOCK)))
        self.launch(part, p, {"x": self.addr(x, n, "x", align=4), "partials": self._argmax_scratch, "n": n}, stream)
        self.launch(pack, 1, {"partials": self._argmax_scratch, "out": self.addr(out, 1, "out", np.uint64, align=8),
                              "n_partials": p, "base": base}, stream)

    def argmax_packed(self, candidates: Any, out: Any, n: int, stream: Any = None) -> None:
        """out[0] (u32) = the index in the best of ``n`` packed u64 candidates (:meth:`argmax_candidate`)."""
        n = self.check_int("n", n)
        final = self.kernel("argmax_final", block=ARGMAX_FINAL_BLOCK)
        self.launch(final, 1, {"partials": self.addr(candidates, n, "candidates", np.uint64, align=8),
                               "out": self.addr(out, 1, "out", np.uint32, align=4), "n_partials": n}, stream)
