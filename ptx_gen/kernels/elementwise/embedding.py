"""Embedding lookup: ``out[t, :] = dequantize(table[tokens[t], :])`` for every weight type.

The token ids are u32 in a device buffer (so a captured graph replays with a new token); an id past
the vocabulary is clamped to the last row (the host validates ids before they are uploaded). One CTA
per token; its warps take the row's tiles in turn, staging each tile's raw bytes in shared memory
with 16-byte loads and decoding 8 values per lane per round (the GEMV's decoders:
value = A * f + C).
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv_plan import plan
from ptx_gen.kernels.gemv.gemv_tiles import RowCtx, after_store, decode_round, k_table_constants, stage_tile
from ptx_gen.kernels.gemv.quant_layout import K_TABLE, ROUND  # noqa: F401


def _emit_tile(k: KernelBuilder, p: dict, wtype: str, row, lc: dict, sel, out, t, rounds, npieces) -> None:
    lane = lc["lane"]
    stage_tile(k, p, [row], lane, t, npieces)
    after_store(k, p, wtype, [row], lc, len(rounds))
    tile_values = p["rpt"] * ROUND
    ob = k.add(out, k.mul_wide(t, tile_values * 4)) if not isinstance(t, int) else (
        k.add(out, t * tile_values * 4) if t else out)
    ob = k.add(ob, k.cvt(k.shl(lane, 5), "u64"))

    def one(i: int) -> None:
        dec = decode_round(k, p, wtype, row, lc, sel, i)
        fs = dec.fs
        a, c = ql.affine(k, dec)
        if isinstance(a, float):
            vals = fs if a == 1.0 else [k.mul(f, a) for f in fs]
        elif c is None:
            vals = [k.mul(f, a) for f in fs]
        else:
            vals = [k.fma(a, f, c) for f in fs]
        k.store("global", "f32", ob, vals[:4], i * ROUND * 4)
        k.store("global", "f32", ob, vals[4:], i * ROUND * 4 + 16)

    for i, nvalid in rounds:
        if nvalid == ROUND:
            one(i)
        else:
            with k.if_(k.setp("lt", k.shl(lane, 3), nvalid)):
                one(i)
    k.bar_warp_sync()


@kernel("embedding", grid=[{"wtype": wt, "hidden": h} for wt in ql.WEIGHT_TYPES
                           for h in ((256, 2304) if wt in ql.K_QUANTS else (64, 576, 4096))]
        + [{"wtype": "Q8_0", "hidden": 576, "warps": 1}])
def embedding(m: Module, wtype: str = "Q8_0", hidden: int = 576, warps: int = 4) -> KernelBuilder:
    """out[t, :] = table[min(tokens[t], vocab - 1), :] dequantized to f32, for t < grid.x.
    Params: table (GGUF rows, allocation rounded up to 16 bytes), tokens (u32), out, vocab.
    Launch: grid n_tokens, block 32 * warps."""
    p = plan(wtype, hidden)
    if warps not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {warps}")
    name = f"embedding_{wtype.lower()}_h{hidden}_w{warps}"
    k = m.kernel(name, [("table", "u64"), ("tokens", "u64"), ("out", "u64"), ("vocab", "u32")],
                 max_threads=32 * warps)
    per_row = p["stage"] + p["table"]
    k.meta.update(block=32 * warps, smem=per_row * warps)
    info = p["info"]
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    tok = k.load("global", "u32", k.add(k.global_ptr("tokens"), k.mul_wide(k.ctaid(), 4)))
    tok = k.min(tok, k.sub(k.param("vocab"), 1))
    smem = k.shared_array(f"{name}_stage", "u8", per_row * warps)
    sbuf = k.add(smem, k.mul(warp, per_row))
    table = k.add(sbuf, p["stage"]) if p["table"] else None
    row = RowCtx(k, p, k.global_ptr("table"), tok, sbuf, table)
    row.align = None
    sel = None
    lc = ql.lane_constants(k, wtype, lane)
    if wtype in K_TABLE:
        lc.update(k_table_constants(k, lane))
    if info.block_values == 32:
        B = info.block_bytes
        row.lane_bb = k.add(row.bbase, k.mul(lc["blk"], B))
        if p["aligned"] and B % 4 == 0:
            row.align = 8 if B % 8 == 0 else 4
        else:
            sel = ql.realign_selector(k, row.lane_bb, ql.field_offset(wtype, "qs"))
    elif wtype == "Q6_K" and not p["aligned"]:
        sel = (ql.realign_selector(k, row.bbase), ql.realign_selector(k, row.bbase, info.block_bytes))
    out = k.add(k.global_ptr("out"), k.mul_wide(k.ctaid(), hidden * 4))
    nfull = p["n_full_tiles"]
    if nfull:
        full = [(i, ROUND) for i in range(p["rpt"])]
        with k.loop(warp, nfull, warps) as t:
            _emit_tile(k, p, wtype, row, lc, sel, out, t, full, p["pieces_full"])
    if p["tail"]:
        with k.if_(k.setp("eq", warp, nfull % warps)):
            _emit_tile(k, p, wtype, row, lc, sel, out, nfull, p["tail"], p["pieces_tail"])
    k.ret()
    return k
