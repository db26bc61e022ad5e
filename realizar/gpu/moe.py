"""Mixture-of-experts launches: the router's top-k on the device and the weighted sum of the experts' outputs
(:mod:`ptx_gen.kernels.moe.route`), both capturable (no allocation, no synchronisation).

    ops.moe_route(logits, ids, weights, rows, experts=128, used=8)   # ids, weights [rows, used]
    ops.gemv_expert(gate_up, h, ffn, ids, 64 * 8, x_group=8, x_stride=2048, y_stride=768)  # SwiGLU, ids [64, 8]
    ops.gemv_expert(down, ffn, y, ids, 64 * 8, x_stride=768, y_stride=2048)                 # y [64, 8, 2048]
    ops.moe_combine(x, y, weights, rows, hidden, used=8)             # x += sum_s weights[:, s] y[:, s]

A larger batch groups its pairs by expert and multiplies each expert's tile of pairs on tensor cores:

    g = ops.moe_group(ids, order, tiles, 512 * 8, experts=128)      # order, tiles on the device; g: the plan
    ops.gemm_experts(gate_up, h16, ffn16, g, x_group=8, lda=2048, ldy=768, out_f16=True)
    ops.gemm_experts(down, ffn16, y, g, lda=768, ldy=2048)

:class:`ExpertWeights` holds a layer's stacked expert matrices on the device (GGUF rows, expert after expert).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from realizar.errors import ShapeError, UnsupportedError
from realizar.gpu.dispatch import Dispatcher

__all__ = ["ExpertGroups", "ExpertWeights", "MoeOps", "expert_gemm_config", "tile_tokens"]


def tile_tokens(pairs: int, experts: int) -> int:
    """The grouped GEMM's token tile for ``pairs`` pairs over ``experts`` experts: their average per expert,
    rounded up to a tile size, within the policy's bounds."""
    from ptx_gen.kernels.moe.group import TILE_TOKENS
    from realizar.gpu.policy.moe import MOE_TILE_MAX, MOE_TILE_MIN

    avg = -(-pairs // experts)
    return next((t for t in TILE_TOKENS if t >= max(avg, MOE_TILE_MIN) and t <= MOE_TILE_MAX), MOE_TILE_MAX)


def expert_gemm_config(wtype: str, in_dim: int, mt: int, max_smem: int) -> tuple[int, int]:
    """(warps, stages) of the grouped expert GEMM (one K part: the tiles fill the GPU): gemm_q's CTA of warps and its
    deepest ring that fits ``max_smem``, fewer warps where none does."""
    from ptx_gen.kernels.gemm.gemm_q import smem_bytes
    from realizar.gpu.policy.gemm import GEMM_Q_CTA_WARPS, GEMM_Q_STAGES

    return next(((wp, st) for wp in (GEMM_Q_CTA_WARPS, 2, 1) for st in GEMM_Q_STAGES
                 if smem_bytes(wtype, in_dim, "rows", mt, wp, 1, st) <= max_smem), (1, 2))


@dataclass(frozen=True)
class ExpertGroups:
    """A batch's pairs grouped by expert on the device (:meth:`MoeOps.moe_group`): ``order`` (u32 pair indices) and
    ``tiles`` (records of ``mt`` pairs at most; ``max_tiles`` of them, the grouped GEMM's grid.y)."""

    order: Any
    tiles: Any
    pairs: int
    mt: int
    max_tiles: int


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
        # the grouped GEMM copies an expert's rows in 16-byte pieces from its start
        self.groupable = self.expert_bytes % 16 == 0

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

    def moe_group(self, ids: Any, order: Any, tiles: Any, pairs: int, *, experts: int, mt: int | None = None,
                  stream: Any = None) -> ExpertGroups:
        """Group the ``pairs`` expert ids ``ids`` (u32, the router's ``[rows, used]``) by expert on the device:
        ``order`` (u32 ``[pairs]``) and ``tiles`` (u32 records, ``2 * max_tiles`` words, of at most ``mt`` pairs;
        default :func:`tile_tokens`). Returns the plan the grouped GEMMs take."""
        from ptx_gen.kernels.moe.group import max_tiles

        pairs, experts = self.check_int("pairs", pairs), self.check_int("experts", experts)
        mt = tile_tokens(pairs, experts) if mt is None else int(mt)
        n_tiles = max_tiles(pairs, experts, mt)
        kern = self.kernel("moe_group", experts=experts, mt=mt)
        values = {"ids": self.addr(ids, pairs, "ids", np.uint32, align=4),
                  "order": self.addr(order, pairs, "order", np.uint32, align=4),
                  "tiles": self.addr(tiles, 2 * n_tiles, "tiles", np.uint32, align=8), "pairs": pairs,
                  "max_tiles": n_tiles}
        self.launch(kern, 1, values, stream)
        return ExpertGroups(order, tiles, pairs, mt, n_tiles)

    def gemm_experts(self, ew: ExpertWeights, x16: Any, out: Any, groups: ExpertGroups, *, x_group: int = 1,
                     lda: int, ldy: int, out_f16: bool = False, stream: Any = None) -> None:
        """``out[p] = W_e x16[p / x_group]`` for every pair ``p`` of ``groups``, ``e`` its expert (f16 X rows
        ``lda`` apart, f32 accumulation on tensor cores; ``out`` rows ``ldy`` apart, f16 with ``out_f16``); with a
        [gate; up] stack ``silu(G_e x) * (U_e x)``. Each tile reads its expert's weights once. Needs sm_80 or newer."""
        if self.device.target.compute_capability < (8, 0):
            raise ShapeError(f"the grouped expert GEMM needs sm_80 or newer, this device is {self.device.target}")
        if not ew.groupable:
            raise ShapeError(f"the grouped expert GEMM needs experts 16-byte aligned; {ew.weight.name}'s are "
                             f"{ew.expert_bytes} bytes apart")
        w = ew.weight
        n_out = ew.rows // 2 if ew.glu else ew.rows
        x_group, lda, ldy = self.check_int("x_group", x_group), self.check_int("lda", lda), self.check_int("ldy", ldy)
        x_rows = -(-groups.pairs // x_group)
        if lda < w.in_dim or lda % 8 or ldy < n_out:
            raise ShapeError(f"the grouped expert GEMM needs lda >= {w.in_dim} (a multiple of 8) and ldy >= {n_out}; "
                             f"got {lda}, {ldy}")
        if (x_rows - 1) * lda * 2 >= 2**32:
            raise ShapeError(f"x16 spans {(x_rows - 1) * lda * 2} bytes, the GEMM addresses fewer than 2**32")
        warps, stages = expert_gemm_config(w.wtype, w.in_dim, groups.mt, self.device.max_shared_per_block_optin)
        kern = self.kernel("gemm_q_experts", wtype=w.wtype, in_dim=w.in_dim, mt=groups.mt, kparts=1, warps=warps,
                           stages=stages, out_f16=bool(out_f16), glu=ew.glu)
        values = {"w": w.ptr, "x": self.addr(x16, (x_rows - 1) * lda + w.in_dim, "x16", np.float16),
                  "y": self.addr(out, (groups.pairs - 1) * ldy + n_out, "out", np.float16 if out_f16 else np.float32,
                                 align=2 if out_f16 else 4),
                  "tiles": self.addr(groups.tiles, 2 * groups.max_tiles, "tiles", np.uint32, align=8),
                  "order": self.addr(groups.order, groups.pairs, "order", np.uint32, align=4), "n": ew.rows,
                  "lda": lda, "ldy": ldy, "expert_bytes": ew.expert_bytes, "x_group": x_group}
        self.launch(kern, (-(-n_out // kern.meta["rows_per_cta"]), groups.max_tiles), values, stream)

    def moe_combine(self, x: Any, y: Any, weights: Any, rows: int, hidden: int, *, used: int,
                    stream: Any = None) -> None:
        """``x[r] += sum_s weights[r, s] * y[r, s]`` for ``x [rows, hidden]``, the experts' outputs ``y [rows, used,
        hidden]`` and ``weights [rows, used]`` (all f32)."""
        rows, hidden, used = self.check_int("rows", rows), self.check_int("hidden", hidden), self.check_int("used", used)
        kern = self.kernel("moe_combine", used=used)
        values = {"x": self.addr(x, rows * hidden, "x", align=4), "y": self.addr(y, rows * used * hidden, "y", align=4),
                  "weights": self.addr(weights, rows * used, "weights", align=4), "hidden": hidden}
        self.launch(kern, (-(-hidden // kern.meta["block"]), rows), values, stream)
