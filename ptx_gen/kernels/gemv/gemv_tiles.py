"""The SIMT GEMV's walk over K (:mod:`ptx_gen.kernels.gemv.gemv`): a warp's rows staged in shared memory a
tile at a time and decoded there, 8 values a lane a round.

Each tile's bytes of every row are loaded with coalesced 16-byte loads and stored to the warp's staging
buffers (or, for the one tile of a short K slice, copied there with ``cp.async``), then decoded from
there (:func:`decode_round`; the K-quants' scales through a per-tile table, :func:`after_store`). With
more than one tile the next one loads into registers while the staged one is decoded
(:func:`walk_tiles`). The embedding lookup (:mod:`ptx_gen.kernels.elementwise.embedding`) stages and
decodes its rows with the same pieces.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv_plan import TABLE_BYTES
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_TABLE, PER_LANE, ROUND


class RowCtx:
    """Per-row registers of one warp: where its bytes (the row, or the warp's K slice of it) start and
    end in global memory, its staging buffer and scale table, and its accumulators."""

    def __init__(self, k: KernelBuilder, p: dict, w: Reg, r: Reg, sbuf: Reg, table: Reg | None, ntok: int = 1,
                 stride: int | None = None, offset: Reg | None = None, acc: list | None = None):
        info = p["info"]
        self.start = k.add(w, k.mul_wide(r, p["row_bytes"] if stride is None else stride))
        if offset is not None:  # a K slice: `offset` bytes into the row (a multiple of 4, see split)
            self.start = k.add(self.start, offset)
        s0_64 = k.and_(self.start, 15)
        self.s0 = k.cvt(s0_64, "u32")
        self.a0 = k.sub(self.start, s0_64)
        self.aend = k.and_(k.add(self.start, p["row_bytes"] + 15), 0xFFFFFFFFFFFFFFF0)
        self.sbuf = sbuf
        self.bbase = sbuf if p["aligned"] else k.add(sbuf, self.s0)
        self.table = table
        self.acc = [k.var("f32", 0.0) for _ in range(ntok)] if acc is None else acc
        self.info = info


def _issue(k: KernelBuilder, p: dict, rows: list[RowCtx], lane: Reg, t: Reg | int, npieces: int,
           regs: list) -> None:
    """Start loading tile ``t``'s bytes of every row into ``regs[row][q]`` (4 Vars per 16-byte piece
    ``lane + 32 q``): coalesced 16-byte loads, all independent, skipping pieces past the row's last
    16-byte vector (so prefetching past the last tile loads nothing)."""
    tb = p["tile_bytes"]
    for row, row_regs in zip(rows, regs):
        if isinstance(t, int):
            win = k.add(row.a0, t * tb) if t else row.a0
        else:
            win = k.add(row.a0, k.mul_wide(t, tb))
        for q, into in enumerate(row_regs):
            piece = k.add(lane, 32 * q) if q else lane
            addr = k.add(win, k.cvt(k.shl(piece, 4), "u64"))
            ok = k.setp("lt", addr, row.aend)
            if (q + 1) * 32 > npieces:
                ok = k.and_(ok, k.setp("lt", piece, npieces))
            k.load("global", "u32", addr, vec=4, nc=True, cache="L1::no_allocate", pred=ok, into=into)


def _store(k: KernelBuilder, rows: list[RowCtx], lane: Reg, npieces: int, regs: list) -> None:
    """Write the loaded pieces to the rows' staging buffers (pieces past the row end hold stale data
    that no decode reads)."""
    for row, row_regs in zip(rows, regs):
        for q, vals in enumerate(row_regs):
            piece = k.add(lane, 32 * q) if q else lane
            guard = k.setp("lt", piece, npieces) if (q + 1) * 32 > npieces else None
            k.store("shared", "u32", k.add(row.sbuf, k.shl(piece, 4)), vals, pred=guard)


def _piece_regs(k: KernelBuilder, nrows: int, npieces: int) -> list:
    return [[[k.var("u32", 0) for _ in range(4)] for _ in range(-(-npieces // 32))] for _ in range(nrows)]


def stage_tile(k: KernelBuilder, p: dict, rows: list[RowCtx], lane: Reg, t: Reg | int, npieces: int) -> None:
    """Load tile ``t`` and store it to the staging buffers (no prefetch)."""
    regs = _piece_regs(k, len(rows), npieces)
    _issue(k, p, rows, lane, t, npieces, regs)
    _store(k, rows, lane, npieces, regs)


def _k_table(k: KernelBuilder, p: dict, wtype: str, rows: list[RowCtx], lc: dict, nblocks: int) -> None:
    """Decode the (A, C) scale terms of every (block, sub-block) of the tile into the table: lane l
    takes sub-blocks 2 (l % 4) and 2 (l % 4) + 1 of block l / 4 (+ 8 per pass), entries
    ``table[8 * block + j] = (A, C)``, i.e. 16 bytes at ``16 l (+ 512 per pass)``."""
    B = p["info"].block_bytes
    for e in range(-(-nblocks // 8)):
        blk = k.add(lc["kblk"], 8 * e) if e else lc["kblk"]
        body = lambda: [  # noqa: E731
            k.store("shared", "f32", k.add(row.table, lc["kentry"]),
                    list(ql.k_scale_pair(k, wtype, k.add(row.bbase, k.mul(blk, B)), lc["kpair"])), 512 * e)
            for row in rows
        ]
        if 8 * (e + 1) <= nblocks:
            body()
        else:
            with k.if_(k.setp("lt", blk, nblocks)):
                body()


def k_table_constants(k: KernelBuilder, lane: Reg) -> dict:
    """Lane constants of the K-quant scale table: the entry a lane reads when decoding (``tentry``,
    8 * sub-block j of its values) and what it builds (:func:`_k_table`)."""
    return {"tentry": k.shl(k.shr(lane, 2), 3), "kblk": k.shr(lane, 2), "kentry": k.shl(lane, 4),
            "kpair": ql.k_pair_selectors(k, k.and_(lane, 3))}


def decode_round(k: KernelBuilder, p: dict, wtype: str, row: RowCtx, lc: dict, sel, i: int) -> ql.Decoded:
    """The lane's 8 values of round ``i`` of the staged tile of ``row``."""
    info = p["info"]
    lane = lc["lane"]
    if wtype in DENSE:
        es = info.block_bytes
        bb = k.add(row.bbase, k.add(k.mul(lane, PER_LANE * es), i * p["rb"]))
        return ql.decode_dense(k, wtype, bb, 0)
    if info.block_values == 32:
        bb = k.add(row.lane_bb, i * 8 * info.block_bytes)
        return ql.decode_q32(k, wtype, bb, lc, sel, sel, row.align, row.align)
    bb = k.add(row.bbase, i * info.block_bytes)
    if wtype in K_TABLE:
        fs = ql.decode_kq(k, wtype, bb, lc)
        a, c = k.load("shared", "f32", k.add(row.table, lc["tentry"]), i * TABLE_BYTES, vec=2)
        return ql.Decoded(fs, a, m=c)
    if p["phase"] >= 4:  # Q6_K, each block's phase is known (mod 8 when the tile is 16-aligned, else mod 4)
        mod = 8 if p["aligned"] else 4
        return ql.decode_q6k(k, bb, lc, (mod, i * info.block_bytes % mod))
    return ql.decode_q6k(k, bb, lc, None, sel[i % 2])


def _round(k: KernelBuilder, p: dict, wtype: str, rows: list[RowCtx], lc: dict, sels: list, xbases: list[Reg],
           i: int) -> None:
    """Round ``i`` of the current tile: each row's 8 values of the lane decoded once and FMA'd with
    the lane's 8 x values of every token. With more tokens than rows the rows are decoded first
    (fewer registers: 8 per row instead of 8 per token), otherwise x is loaded first."""

    def load_x(xb):
        # x is written by the kernel before (under programmatic dependent launch still running when
        # this one starts): a coherent load, never ld.global.nc, whose read-only promise lets ptxas
        # hoist it above griddepcontrol.wait (that broke decode once the weight loads came first)
        return (list(k.load("global", "f32", xb, i * ROUND * 4, vec=4))
                + list(k.load("global", "f32", xb, i * ROUND * 4 + 16, vec=4)))

    def x_sum(xs, box: dict, beta: float) -> Reg:
        """beta * (the lane's 8 x values summed), made once per round and token for all rows."""
        if 1.0 not in box:
            s01 = k.add(k.add(xs[0], xs[1]), k.add(xs[2], xs[3]))
            s23 = k.add(k.add(xs[4], xs[5]), k.add(xs[6], xs[7]))
            box[1.0] = k.add(s01, s23)
        if beta not in box:
            box[beta] = k.mul(box[1.0], beta)
        return box[beta]

    def contribute(row: RowCtx, m: int, dec: ql.Decoded, xs, box: dict) -> None:
        """acc += s * (alpha * dot + beta * sum x) + m * sum x."""
        fs = dec.fs
        dot = k.mul(fs[0], xs[0])  # one chain: rows and rounds give the ILP
        for j in range(1, 8):
            dot = k.fma(fs[j], xs[j], dot)
        acc = row.acc[m]
        if dec.beta or dec.alpha != 1.0:
            dot = k.fma(dot, dec.alpha, x_sum(xs, box, dec.beta))
        new = k.add(acc, dot) if isinstance(dec.s, float) and dec.s == 1.0 else k.fma(dec.s, dot, acc)
        if dec.m is not None:
            new = k.fma(dec.m, x_sum(xs, box, 1.0), new)
        k.assign(acc, new)

    if len(xbases) > len(rows):
        decs = [decode_round(k, p, wtype, row, lc, sels[ri], i) for ri, row in enumerate(rows)]
        for m, xb in enumerate(xbases):
            xs, box = load_x(xb), {}
            for row, dec in zip(rows, decs):
                contribute(row, m, dec, xs, box)
    else:
        xss = [load_x(xb) for xb in xbases]
        boxes = [{} for _ in xbases]
        for ri, row in enumerate(rows):
            dec = decode_round(k, p, wtype, row, lc, sels[ri], i)
            for m, xs in enumerate(xss):
                contribute(row, m, dec, xs, boxes[m])


def _compute(k: KernelBuilder, p: dict, wtype: str, rows: list[RowCtx], lc: dict, sels: list, xs: list[Reg],
             t: Reg | int, rounds: list[tuple[int, int]]) -> None:
    """Decode the staged tile ``t`` (after the scale table, for K-quants) and accumulate."""
    lane = lc["lane"]
    tile_values = p["rpt"] * ROUND
    lane_off = k.cvt(k.shl(lane, 5), "u64")
    xbases = []
    for x in xs:
        if isinstance(t, int):
            xb = k.add(x, t * tile_values * 4) if t else x
        else:
            xb = k.add(x, k.mul_wide(t, tile_values * 4))
        xbases.append(k.add(xb, lane_off))
    for i, nvalid in rounds:
        if nvalid == ROUND:
            _round(k, p, wtype, rows, lc, sels, xbases, i)
        else:
            with k.if_(k.setp("lt", k.shl(lane, 3), nvalid)):
                _round(k, p, wtype, rows, lc, sels, xbases, i)


def after_store(k: KernelBuilder, p: dict, wtype: str, rows: list[RowCtx], lc: dict, nblocks: int) -> None:
    k.bar_warp_sync()
    if wtype in K_TABLE:
        _k_table(k, p, wtype, rows, lc, nblocks)
        k.bar_warp_sync()


def row_contexts(k: KernelBuilder, p: dict, wtype: str, rows: int, glu: bool, row0: Reg, last: Reg, out_dim: Reg,
                  w: Reg, wbase: Reg, per_row: int, stage: int, lc: dict, nt: int, stride: int,
                  offset: Reg | None = None, accs: list | None = None) -> tuple[list[RowCtx], list]:
    """The warp's rows (row indices clamped to the last row; for ``glu`` the first half are gate rows,
    the second half the matching up rows) and their realign selectors, for plan ``p``."""
    info = p["info"]
    outs_per_warp = rows // 2 if glu else rows
    row_ctx: list[RowCtx] = []
    sels: list = []
    for rr in range(rows):
        if glu:
            r = k.min(k.add(row0, rr % outs_per_warp), last)
            if rr >= outs_per_warp:
                r = k.add(r, out_dim)
        else:
            r = k.min(k.add(row0, rr), last)
        sbuf = k.add(wbase, rr * per_row) if rr else wbase
        table = k.add(sbuf, stage) if p["table"] else None
        row = RowCtx(k, p, w, r, sbuf, table, nt, stride=stride, offset=offset,
                     acc=None if accs is None else accs[rr])
        row.align = None
        sel = None
        if info.block_values == 32:
            B = info.block_bytes
            row.lane_bb = k.add(row.bbase, k.mul(lc["blk"], B))
            qs = ql.field_offset(wtype, "qs")
            if p["aligned"] and B % 4 == 0:
                row.align = 8 if B % 8 == 0 else 4  # of lane_bb (bbase is 16-aligned)
            else:
                sel = ql.realign_selector(k, row.lane_bb, qs)
        elif wtype == "Q6_K" and p["phase"] == 2:
            sel = (ql.realign_selector(k, row.bbase), ql.realign_selector(k, row.bbase, info.block_bytes))
        sels.append(sel)
        row_ctx.append(row)
    return row_ctx, sels


def _copy_async(k: KernelBuilder, p: dict, rows: list[RowCtx], lane: Reg, npieces: int) -> None:
    """Copy the (only) tile's bytes of every row straight into the staging buffers with ``cp.async``:
    no registers, so all of the warp's copies are in flight at once; then wait for this lane's copies
    to land. Piece ``lane + 32 q`` (16 bytes) is copied when it starts before the row's last 16-byte
    boundary: all ``npieces`` of them for 16-byte aligned rows, else ``ceil((s0 + bytes) / 16)``."""
    lane16 = k.shl(lane, 4)
    lane16_64 = k.cvt(lane16, "u64")
    for row in rows:
        src, dst = k.add(row.a0, lane16_64), k.add(row.sbuf, lane16)
        nvalid = npieces if p["aligned"] else k.shr(k.add(row.s0, p["row_bytes"] + 15), 4)
        for q in range(-(-npieces // 32)):
            if isinstance(nvalid, int):
                ok = k.setp("lt", lane, nvalid - 32 * q) if (q + 1) * 32 > nvalid else None
            else:
                ok = k.setp("lt", lane, k.sub(nvalid, 32 * q) if q else nvalid, "s32")
            k.cp_async(dst, src, pred=ok, dst_offset=512 * q, src_offset=512 * q)
    k.grid_dependency_wait()  # the weights are in flight: now wait for the kernel that writes x
    k.cp_async_wait_all()


def walk_tiles(k: KernelBuilder, p: dict, wtype: str, row_ctx: list[RowCtx], lc: dict, sels: list, xs: list[Reg],
          copy_async: bool = False) -> None:
    """Accumulate the rows' dot products over the plan's tiles.

    One tile with ``copy_async``: all of it is copied at once with ``cp.async``, then decoded. Else a
    software pipeline: tile t+1's weights are loaded into registers while tile t is decoded from
    shared memory, so each warp keeps its loads in flight through its own compute."""
    lane = lc["lane"]
    rows = len(row_ctx)
    nfull = p["n_full_tiles"]
    if copy_async and nfull + (1 if p["tail"] else 0) == 1:
        rounds = [(i, ROUND) for i in range(p["rpt"])] if nfull else p["tail"]
        _copy_async(k, p, row_ctx, lane, p["pieces_full"] if nfull else p["pieces_tail"])
        after_store(k, p, wtype, row_ctx, lc, len(rounds))
        _compute(k, p, wtype, row_ctx, lc, sels, xs, 0, rounds)
        return
    npieces = max(p["pieces_full"] if nfull else 0, p["pieces_tail"])
    regs = _piece_regs(k, rows, npieces)
    _issue(k, p, row_ctx, lane, 0, npieces, regs)
    k.grid_dependency_wait()  # the first tile is in flight: now wait for the kernel that writes x
    if nfull:
        full = [(i, ROUND) for i in range(p["rpt"])]
        with k.loop(0, nfull) as t:
            _store(k, row_ctx, lane, npieces, regs)
            after_store(k, p, wtype, row_ctx, lc, p["rpt"])
            _issue(k, p, row_ctx, lane, k.add(t, 1), npieces, regs)  # the next tile, the tail, or nothing
            _compute(k, p, wtype, row_ctx, lc, sels, xs, t, full)
            k.bar_warp_sync()  # the staging buffers are overwritten by the next tile
    if p["tail"]:
        _store(k, row_ctx, lane, npieces, regs)
        after_store(k, p, wtype, row_ctx, lc, len(p["tail"]))
        _compute(k, p, wtype, row_ctx, lc, sels, xs, nfull, p["tail"])
