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


def _grouped(rng, experts: int, tokens: int, used: int, mt: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(ids, order, tiles, max_tiles) of ``tokens`` rows choosing ``used`` distinct experts each, grouped by expert."""
    from ptx_gen.kernels.moe.group import max_tiles

    ids = np.stack([rng.choice(experts, used, replace=False) for _ in range(tokens)]).astype(np.uint32).reshape(-1)
    order = np.argsort(ids, kind="stable").astype(np.uint32)
    n_tiles = max_tiles(ids.size, experts, mt)
    tiles = np.zeros((n_tiles, 2), np.uint32)
    t = start = 0
    for e in range(experts):
        c = int((ids == e).sum())
        for j in range(0, c, mt):
            tiles[t] = (start + j, e << 8 | min(mt, c - j))
            t += 1
        start += c
    return ids, order, tiles.reshape(-1), n_tiles


@example("moe_group")
def _moe_group(k, sizes, rng) -> Example:
    shape = k.shape_dict
    ids, _, _, n_tiles = _grouped(rng, shape["experts"], sizes.get("rows", 5), min(2, shape["experts"]), shape["mt"])
    return Example({"ids": ids, "order": np.full(ids.size, 0xFFFFFFFF, np.uint32),
                    "tiles": np.full(2 * n_tiles, 0xFFFFFFFF, np.uint32), "pairs": ids.size, "max_tiles": n_tiles},
                   (1,), (k.meta["block"],), ("order", "tiles"))


@example("gemm_q_experts")
def _gemm_q_experts(k, sizes, rng) -> Example:
    from ptx_gen.emulator.examples import _weights
    from ptx_gen.kernels.gemv.quant_layout import type_info

    shape = k.shape_dict
    wtype, in_dim, glu = shape["wtype"], shape["in_dim"], shape.get("glu", False)
    experts, tokens, used, cols = 3, sizes.get("tokens", 3), 2, sizes.get("out_dim", 16)
    n = 2 * cols if glu else cols
    expert_bytes = -(-n * type_info(wtype).row_bytes(in_dim) // 16) * 16
    stack = np.concatenate([np.concatenate([w := _weights(rng, wtype, n, in_dim)[:expert_bytes],
                                            np.zeros(expert_bytes - w.size, np.uint8)]) for _ in range(experts)])
    ids, order, tiles, n_tiles = _grouped(rng, experts, tokens, used, k.meta["mt"])
    out = np.float16 if shape.get("out_f16") else np.float32
    params = {"w": stack, "x": _f32(rng, tokens * in_dim, scale=1e-3).astype(np.float16),
              "y": np.full(ids.size * cols, np.nan, out), "tiles": tiles, "order": order, "n": n, "lda": in_dim,
              "ldy": cols, "expert_bytes": expert_bytes, "x_group": used}
    return Example(params, (_cdiv(cols, k.meta["rows_per_cta"]), n_tiles), (k.meta["block"],), ("y",),
                   k.meta["dyn_smem"])
