"""Example launches of the mixture-of-experts kernels (registered into :data:`examples.EXAMPLES`)."""

from __future__ import annotations

import numpy as np

from ptx_gen.emulator.examples import Example, _cdiv, _f32, example


@example("moe_route")
def _moe_route(k, sizes, rng) -> Example:
    rows, e, used = sizes.get("rows", 5), k.shape_dict["experts"], k.shape_dict["used"]
    return Example({"logits": _f32(rng, rows * e), "ids": np.full(rows * used, 0xFFFFFFFF, np.uint32),
                    "weights": np.full(rows * used, np.nan, np.float32), "rows": rows},
                   (_cdiv(rows, k.meta["rows_per_cta"]),), (k.meta["block"],), ("ids", "weights"))


@example("moe_combine")
def _moe_combine(k, sizes, rng) -> Example:
    rows, hidden, used = sizes.get("rows", 3), sizes.get("hidden", 300), k.shape_dict["used"]
    return Example({"x": _f32(rng, rows * hidden), "y": _f32(rng, rows * used * hidden),
                    "weights": _f32(rng, rows * used), "hidden": hidden},
                   (_cdiv(hidden, k.meta["block"]), rows), (k.meta["block"],), ("x",))


@example("gemv_expert_rows")
def _gemv_expert_rows(k, sizes, rng) -> Example:
    from ptx_gen.emulator.examples import _weights
    from ptx_gen.kernels.gemv.quant_layout import type_info

    shape = k.shape_dict
    in_dim, glu, experts, rows, group = shape["in_dim"], shape.get("glu", False), 3, sizes.get("rows", 4), 2
    out_dim = sizes.get("out_dim", 8)
    wrows = out_dim * (2 if glu else 1)
    stack = np.concatenate([_weights(rng, shape["wtype"], wrows, in_dim)[: wrows * type_info(shape["wtype"]).row_bytes(in_dim)]
                            for _ in range(experts)])
    stack = np.concatenate([stack, np.zeros(-stack.size % 16, np.uint8)])
    return Example({"w": stack, "x": _f32(rng, -(-rows // group) * in_dim),
                    "y": np.full(rows * out_dim, np.nan, np.float32), "out_dim": out_dim,
                    "experts": rng.integers(0, experts, rows).astype(np.uint32),
                    "expert_bytes": wrows * type_info(shape["wtype"]).row_bytes(in_dim), "x_group": group,
                    "x_stride": in_dim, "y_stride": out_dim},
                   (_cdiv(out_dim, k.meta["rows_per_cta"]), rows), (k.meta["block"],), ("y",))
