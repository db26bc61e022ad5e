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
