"""Mixture-of-experts launches: the router's top-k on the device and the weighted sum of the experts' outputs
(:mod:`ptx_gen.kernels.moe.route`), both capturable (no allocation, no synchronisation).

    ops.moe_route(logits, ids, weights, rows, experts=128, used=8)   # ids, weights [rows, used]
    ops.gemv_expert(gate_up, h, ffn, ids, 64 * 8, x_group=8, x_stride=2048, y_stride=768)  # SwiGLU, ids [64, 8]
    ops.gemv_expert(down, ffn, y, ids, 64 * 8, x_stride=768, y_stride=2048)                 # y [64, 8, 2048]
    ops.moe_combine(x, y, weights, rows, hidden, used=8)             # x += sum_s weights[:, s] y[:, s]

:class:`ExpertWeights` holds a layer's stacked expert matrices on the device (GGUF rows, expert after expert).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from realizar.errors import ShapeError, UnsupportedError
from realizar.gpu.dispatch import Dispatcher

__all__ = ["ExpertWeights", "MoeOps"]


class ExpertWeights:
    """``experts`` matrices of one type and shape stacked on the device, GGUF rows, expert after expert: the
    [gate; up] pairs of a layer (``glu``: each expert's gate rows then its up rows) or its down matrices."""

    def __init__(self, parts: Sequence[Any], experts: int, name: str, device: Any, glu: bool = False):
        from realizar.gpu.weights import GpuWeight, weight_type_name

        types = {weight_type_name(t.ggml_type) for t in parts}
        if len(types) != 1 or len({t.shape for t in parts}) != 1:
            raise UnsupportedError(f"{name}: the experts' gate and up matrices differ in type or shape "
                                   f"({sorted(types)}); the GPU's fused expert GEMV needs one")
        e, rows, cols = parts[0].shape
        stacked = np.concatenate([np.asarray(t.data).reshape(e, rows, -1) for t in parts], axis=1)  # per expert
        self.experts, self.glu = e, glu
        self.weight = GpuWeight(data=stacked, ggml_type=parts[0].ggml_type, shape=(e * rows * len(parts), cols),
                                name=name, device=device)
        self.rows = rows * len(parts)  # per expert
        self.expert_bytes = self.rows * self.weight.row_bytes

    def free(self) -> None:
        self.weight.free()


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

    def gemv_expert(self, ew: ExpertWeights, x: Any, out: Any, ids: Any, rows: int, *, x_group: int = 1,
                    x_stride: int = 0, y_stride: int = 0, stream: Any = None) -> None:
        """``out[i] = W_e x[i / x_group]`` (f32) for ``i < rows``, the expert ``e = ids[i]`` of ``ew`` (ids: u32 device
        memory, read by the kernel: the graph stays the same whatever the router chose); with a [gate; up] stack
        ``silu(G_e x) * (U_e x)``. Row i's x at ``(i / x_group) * x_stride`` floats (a multiple of 4), its out at
        ``i * y_stride``: a layer's tokens x chosen experts in one launch."""
        from realizar.gpu.gemv import gemv_config

        w = ew.weight
        n_out = ew.rows // 2 if ew.glu else ew.rows
        cfg = gemv_config(ew.rows, self.sm_count, w.in_dim, w.wtype)
        per_warp = max(2, cfg.rows - cfg.rows % 2) if ew.glu else cfg.rows
        rows, x_group = self.check_int("rows", rows), self.check_int("x_group", x_group)
        x_rows = -(-rows // x_group)
        if (x_rows > 1 and (x_stride < w.in_dim or x_stride % 4)) or (rows > 1 and y_stride < n_out):
            raise ShapeError(f"{rows} expert rows need x_stride >= {w.in_dim} (a multiple of 4) and y_stride >= "
                             f"{n_out}; got {x_stride}, {y_stride}")
        kern = self.kernel("gemv_expert_rows", wtype=w.wtype, in_dim=w.in_dim, rows=per_warp, warps=cfg.warps,
                           glu=ew.glu, ksplit=cfg.ksplit)
        values = {"w": w.ptr, "x": self.addr(x, (x_rows - 1) * x_stride + w.in_dim, "x"),
                  "y": self.addr(out, (rows - 1) * y_stride + n_out, "out", align=4), "out_dim": n_out,
                  "experts": self.addr(ids, rows, "ids", np.uint32, align=4), "expert_bytes": ew.expert_bytes,
                  "x_group": x_group, "x_stride": int(x_stride), "y_stride": int(y_stride)}
        self.launch(kern, (-(-n_out // kern.meta["rows_per_cta"]), rows), values, stream)

    def moe_combine(self, x: Any, y: Any, weights: Any, rows: int, hidden: int, *, used: int,
                    stream: Any = None) -> None:
        """``x[r] += sum_s weights[r, s] * y[r, s]`` for ``x [rows, hidden]``, the experts' outputs ``y [rows, used,
        hidden]`` and ``weights [rows, used]`` (all f32)."""
        rows, hidden, used = self.check_int("rows", rows), self.check_int("hidden", hidden), self.check_int("used", used)
        kern = self.kernel("moe_combine", used=used)
        values = {"x": self.addr(x, rows * hidden, "x", align=4), "y": self.addr(y, rows * used * hidden, "y", align=4),
                  "weights": self.addr(weights, rows * used, "weights", align=4), "hidden": hidden}
        self.launch(kern, (-(-hidden // kern.meta["block"]), rows), values, stream)
