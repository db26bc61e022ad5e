"""Linear: ``y = x W^T`` for ``rows`` rows of x over a GGUF weight, the kernel chosen by the row count.

* 1 row: the decode GEMV (f32 x; fused gate/up: the SwiGLU GEMV), weights exact;
* 2 .. ``cols_rows`` rows: the tensor-core GEMV's columns kernel where it takes the weight (each
  weight unit read and decoded once, the MMAs per row);
* up to :data:`GEMM_Q_MAX_ROWS` rows: ``gemm_q``, the small-M GEMM straight from the quantized blocks;
* more: on sm_90 ``gemm_wg``, the warpgroup-MMA GEMM straight from the quantized blocks (above ``WS_OVER_WG_ROWS``
  rows its warp-specialized form ``gemm_ws``: producer warps decode, consumer warpgroups multiply), except up to
  ``WG_OVER_F16_ROWS`` rows where an f16 copy of the weight is kept (:meth:`Linear.keep_f16`): the f16 GEMM over
  it; elsewhere the f16 GEMM over the copy, or over the weight expanded into a scratch first (one weight at a
  time: the quantized copy stays the model's only copy).

Above one row x enters as f16 (:meth:`Linear.f16_input`); products accumulate in f32. Epilogues:
``bias``, ``residual`` (may be ``out``: in place), ``glu`` (the [gate; up] weight's SwiGLU), ``out_f16``.
Every call is capturable: no allocation or synchronisation (the scratch and the room of gemm_ws launches that
split K over two CTAs are sized by :meth:`reserve` before a step).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from realizar.errors import ShapeError, UnsupportedError
from realizar.gpu.policy.gemm import WG_OVER_F16_ROWS, WS_OVER_WG_ROWS

__all__ = ["GEMM_Q_MAX_ROWS", "GEMV_COLS_DEFAULT_ROWS", "GEMV_COLS_MAX_ROWS", "Linear", "rows_unsupported"]

# batches up to this many rows run on gemm_q (each weight byte read once); more on the f16 GEMM
GEMM_Q_MAX_ROWS = 32
# the columns kernel takes up to GEMV_COLS_MAX_ROWS rows; by default batches of up to
# GEMV_COLS_DEFAULT_ROWS rows run on it where it takes the weight (docs/performance.md, "Small batches")
GEMV_COLS_MAX_ROWS = 8
GEMV_COLS_DEFAULT_ROWS = 4


def rows_unsupported(device, config) -> str | None:
    """Why more than one row cannot run through the Linear (and the batched attention) on ``device``
    for ``config``; None: they can."""
    if device.target.compute_capability < (8, 0):
        return f"the tensor-core kernels need sm_80 or newer, this device is {device.target}"
    if config.is_moe and config.num_experts % 8:  # (the router's logits: a Linear of num_experts outputs)
        from realizar.gpu.decoder import MOE_ON_GPU

        return MOE_ON_GPU
    if config.hidden_size % 8 or config.intermediate_size % 8 or config.q_dim % 8:
        return "the f16 kernels need hidden, FFN and attention widths that are multiples of 8"
    return None


class Linear:
    """The Linear seam on ``ops`` (a :class:`~realizar.gpu.ops.LayerOps`). ``cols_rows``: batches of
    2 .. this many rows run the columns kernel where it applies (0: never)."""

    def __init__(self, ops, *, cols_rows: int = GEMV_COLS_DEFAULT_ROWS):
        if isinstance(cols_rows, bool) or not isinstance(cols_rows, int) or not 0 <= cols_rows <= GEMV_COLS_MAX_ROWS:
            raise ShapeError(f"gemv_cols_rows must be an integer in [0, {GEMV_COLS_MAX_ROWS}], got {cols_rows!r}")
        self.ops = ops
        self.cols_rows = cols_rows
        self.f16_weights: dict[int, Any] = {}  # id(weight) -> its f16 rows (gate/up interleaved)
        self.scratch = None  # f16 expansion of a weight without a kept copy
        self._wg_takes: dict[int, tuple] = {}  # id(weight) -> (weight, _wg(weight)): asked for every weight each step
        self.split = None  # the SplitSpace of gemm_ws launches that split K over two CTAs (sized by reserve)
        self._split_rooms: dict[tuple, tuple] = {}  # (id(weights), rows, the split policy) -> (weights, their room)

    @staticmethod
    def f16_input(rows: int) -> bool:
        """Whether x enters as f16 at ``rows`` rows (f32 for the one-row GEMV)."""
        return rows > 1

    # ---- f16 copies and the expansion scratch ------------------------------------------------------
    def keep_f16(self, weights: Sequence, glu_ids: set[int], stream) -> None:
        """Expand ``weights`` to f16 rows once and keep them (``glu_ids``: fused [gate; up] weights,
        interleaved as the SwiGLU GEMM reads them)."""
        ops = self.ops
        for w in weights:
            if id(w) in self.f16_weights:
                continue
            buf = ops.buffer(w.out_dim * w.in_dim, np.float16)
            ops.dequantize_f16(w, buf, interleave=id(w) in glu_ids, stream=stream)
            self.f16_weights[id(w)] = buf
        stream.synchronize()

    def reserve(self, weights: Sequence, rows: int) -> bool:
        """Size the expansion scratch and the K split's room for ``weights`` at ``rows`` rows (before a step,
        outside any capture); True when either had to grow (graphs that read the old one must be rebuilt)."""
        if rows <= GEMM_Q_MAX_ROWS:
            return False
        grew = False
        if rows > WS_OVER_WG_ROWS:
            floats, tiles = self._split_room(weights, rows)
            if floats and (self.split is None or not self.split.fits(floats, tiles)):
                if self.split is not None:
                    floats, tiles = max(floats, self.split.part.count), max(tiles, self.split.counters.count)
                    self.split.free()
                self.split = self.ops.split_space(floats, tiles)
                grew = True
        need = max([w.out_dim * w.in_dim for w in weights if id(w) not in self.f16_weights and not self._wg(w)]
                   or [0])
        if need == 0 or (self.scratch is not None and self.scratch.count >= need):
            return grew
        if self.scratch is not None:
            self.scratch.free()
        self.scratch = self.ops.buffer(need, np.float16)
        return True

    def _split_room(self, weights: Sequence, rows: int) -> tuple[int, int]:
        """(floats, counters) the gemm_ws launches of ``weights`` at ``rows`` rows need in :attr:`split` (a fused
        gate/up weight's launch shape and room are those of its rows without the SwiGLU epilogue)."""
        import realizar.gpu.gemm_wg as wg

        key = (id(weights), rows, wg.ws_policy())  # (a tool may change the policy between steps)
        hit = self._split_rooms.get(key)
        if hit is not None and hit[0] is weights:
            return hit[1]
        ops = self.ops
        rooms = [wg.split_room(wg.ws_config(w.wtype, w.in_dim, w.layout, w.out_dim, rows, ops.sm_count,
                                            ops.device.max_shared_per_block_optin), w.out_dim, rows)
                 for w in weights if self._wg(w)]
        room = (max([f for f, _ in rooms] or [0]), max([t for _, t in rooms] or [0]))
        self._split_rooms[key] = (weights, room)
        return room

    def free(self) -> None:
        for buf in self.f16_weights.values():
            buf.free()
        self.f16_weights.clear()
        self._wg_takes.clear()
        self._split_rooms.clear()
        if self.split is not None:
            self.split.free()
            self.split = None
        if self.scratch is not None:
            self.scratch.free()
            self.scratch = None

    # ---- the product ------------------------------------------------------------------------------
    def __call__(self, weight, x, out, rows: int, *, ldy: int | None = None, bias: Any = None,
                 residual: Any = None, glu: bool = False, out_f16: bool = False, stream: Any = None) -> None:
        ops = self.ops
        if rows == 1:
            if glu:
                ops.gemv_glu(weight, x, out, stream=stream)
            else:
                ops.gemv(weight, x, out, bias=bias, residual=residual, stream=stream)
            return
        epilogue = dict(ldy=ldy, bias=bias, residual=residual, glu=glu, out_f16=out_f16)
        if rows <= self.cols_rows and self._cols_applies(weight, rows, glu):
            ops.gemv_cols(weight, x, out, rows, xh=True, stream=stream, **epilogue)
            return
        if rows <= GEMM_Q_MAX_ROWS:
            ops.gemm_q(x, weight, out, rows, stream=stream, **epilogue)
            return
        w16 = self.f16_weights.get(id(weight))
        if (w16 is None or rows > WG_OVER_F16_ROWS) and self._wg(weight):
            if rows > WS_OVER_WG_ROWS:
                ops.gemm_ws(x, weight, out, rows, split=self.split, stream=stream, **epilogue)
            else:
                ops.gemm_wg(x, weight, out, rows, stream=stream, **epilogue)
            return
        if w16 is None:
            w16 = self.scratch
            if w16 is None or w16.count < weight.out_dim * weight.in_dim:
                raise UnsupportedError(f"no f16 scratch for {weight!r}: Linear.reserve runs before a step")
            ops.dequantize_f16(weight, w16, interleave=glu, stream=stream)
        ops.gemm_f16(x, w16, out, rows, weight.out_dim, weight.in_dim, stream=stream, **epilogue)

    def _wg(self, weight) -> bool:
        """Whether ``weight`` runs on the warpgroup-MMA GEMM when it has no f16 copy."""
        from realizar.gpu.gemm_wg import wg_applies

        hit = self._wg_takes.get(id(weight))
        if hit is not None and hit[0] is weight:
            return hit[1]
        takes = wg_applies(self.ops.device, weight.wtype, weight.layout, weight.in_dim) and weight.nbytes + 16 < 2**32
        self._wg_takes[id(weight)] = (weight, takes)
        return takes

    def _cols_applies(self, weight, rows: int, glu: bool) -> bool:
        """Whether ``weight`` at ``rows`` rows runs on the tensor-core GEMV's columns kernel."""
        from realizar.gpu.gemv import cols_per_launch

        n_out = weight.out_dim // 2 if glu else weight.out_dim
        cols = min(rows, cols_per_launch(weight.wtype, glu))
        return self.ops.mma_cols_config(n_out, weight.in_dim, weight.wtype, cols, glu=glu,
                                        layout=weight.layout) is not None
