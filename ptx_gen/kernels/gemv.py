"""GEMV ``y = W x (+ bias) (+ residual)`` with W in GGUF block form, for decode.

Weights are read exactly once, as 16-byte coalesced ``ld.global.nc.L1::no_allocate.v4`` loads of the
raw row bytes, staged per warp in shared memory (so blocks of 18, 34 or 210 bytes at any even
alignment decode the same way), then decoded there (see :mod:`ptx_gen.kernels.quant_layout`). x (f32)
is read through L1 as two float4 per lane per round; y is f32.

Work split: a CTA has ``warps`` warps; each warp owns ``rows`` consecutive output rows and walks the
whole row, a *tile* of ``RPT`` rounds (256 values each) at a time: all 32 lanes load the tile's
bytes of every one of its rows (several independent 16-byte loads per lane), store them to the warp's
staging buffers, synchronise (``bar.warp.sync``), then *start loading the next tile into the same
registers* and decode the staged one meanwhile (a two-stage software pipeline: each warp keeps its
loads in flight through its own compute). Each lane decodes its 8 values per round per row and FMAs
them with x (loaded once per round, used for all rows). At the end a butterfly reduction gives each
row's sum; lane 0 adds bias/residual and stores. Grid: ``ceil(out_dim / (rows * warps))`` CTAs of
``32 * warps``. Variants: ``glu`` (rows of [gate; up], silu(g) * u epilogue) and the prefill GEMM
(``tokens`` x vectors per CTA on grid.y, each weight round decoded once for all of them).

Rows: ``row r`` starts at byte ``r * row_bytes`` of ``w`` (``w`` 16-byte aligned, and the allocation
rounded up to a multiple of 16 bytes: loads are whole 16-byte vectors). ``in_dim`` is a generation
parameter; ``out_dim`` is a runtime argument. ``residual`` may alias ``y`` (in-place ``h += W x``).
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels import quant_layout as ql
from ptx_gen.kernels.quant_layout import DENSE, K_TABLE, PER_LANE, ROUND, type_info

# rounds per staged tile, per type: ~1-2 KB of weights per row per tile (2-4 loads per lane); with the
# next tile prefetched into registers during decode, each warp has about that much in flight per row
TILE_ROUNDS = {"F32": 1, "F16": 2, "BF16": 2, "Q8_0": 4, "Q4_0": 8, "Q4_1": 8, "Q5_0": 8, "Q5_1": 8,
               "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}
TABLE_BYTES = 8 * 8  # per K-quant block: 8 sub-blocks x (A, C) f32
MAX_STATIC_SMEM = 48 * 1024


def plan(wtype: str, in_dim: int) -> dict:
    """Static facts of the tiling for one shape (also used by tests and the GEMM)."""
    ql.check_in_dim(wtype, in_dim)
    info = type_info(wtype)
    rb = info.round_bytes
    rpt = TILE_ROUNDS[wtype]
    row_bytes = info.row_bytes(in_dim)
    aligned = row_bytes % 16 == 0
    full_rounds, rem = divmod(in_dim, ROUND)
    n_full_tiles, tail_full = divmod(full_rounds, rpt)
    tail = [(i, ROUND) for i in range(tail_full)] + ([(tail_full, rem)] if rem else [])
    rem_bytes = rem // info.block_values * info.block_bytes
    extra = 0 if aligned else 1
    pieces_full = rpt * rb // 16 + extra
    pieces_tail = -(-(tail_full * rb + rem_bytes) // 16) + extra if tail else 0
    # +16: a realigning read (lds_words) may fetch one word past the last block
    stage = 16 * max(pieces_full if n_full_tiles else 0, pieces_tail) + (0 if wtype in DENSE else 16)
    table = rpt * TABLE_BYTES if wtype in K_TABLE else 0
    return dict(info=info, rb=rb, rpt=rpt, tile_bytes=rpt * rb, row_bytes=row_bytes, aligned=aligned,
                n_full_tiles=n_full_tiles, tail=tail, pieces_full=pieces_full, pieces_tail=pieces_tail,
                stage=stage, table=table)


def _grid_shapes() -> list[dict]:
    shapes = []
    for wt in ql.WEIGHT_TYPES:
        dims = [256, 4096] if wt in ql.K_QUANTS else [64, 576, 4096]
        for d in dims:
            shapes.append({"wtype": wt, "in_dim": d})
    shapes += [{"wtype": "Q8_0", "in_dim": 1536, "rows": 1, "bias": True},
               {"wtype": "Q4_1", "in_dim": 576, "rows": 2, "glu": True},
               {"wtype": "Q4_K", "in_dim": 4096, "rows": 4, "glu": True},
               {"wtype": "Q4_K", "in_dim": 14336, "rows": 2, "residual": True},
               {"wtype": "Q6_K", "in_dim": 1536, "rows": 4, "bias": True, "residual": True}]
    return shapes


class RowCtx:
    """Per-row registers of one warp."""

    def __init__(self, k: KernelBuilder, p: dict, w: Reg, r: Reg, sbuf: Reg, table: Reg | None, ntok: int = 1):
        info = p["info"]
        self.start = k.add(w, k.mul_wide(r, p["row_bytes"]))
        s0_64 = k.and_(self.start, 15)
        self.s0 = k.cvt(s0_64, "u32")
        self.a0 = k.sub(self.start, s0_64)
        self.aend = k.and_(k.add(self.start, p["row_bytes"] + 15), 0xFFFFFFFFFFFFFFF0)
        self.sbuf = sbuf
        self.bbase = sbuf if p["aligned"] else k.add(sbuf, self.s0)
        self.table = table
        self.acc = [k.var("f32", 0.0) for _ in range(ntok)]
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


def _stage(k: KernelBuilder, p: dict, rows: list[RowCtx], lane: Reg, t: Reg | int, npieces: int) -> None:
    """Load tile ``t`` and store it to the staging buffers (no prefetch)."""
    regs = _piece_regs(k, len(rows), npieces)
    _issue(k, p, rows, lane, t, npieces, regs)
    _store(k, rows, lane, npieces, regs)


def _k_table(k: KernelBuilder, p: dict, wtype: str, rows: list[RowCtx], lc: dict, nblocks: int) -> None:
    """Decode the (A, C) scale terms of every (block, sub-block) of the tile into the table."""
    B = p["info"].block_bytes
    lane = lc["lane"]
    for e in range(-(-nblocks // 4)):
        blk = k.add(k.shr(lane, 3), 4 * e)
        entry = k.add(k.shl(blk, 3), lc["tj"])
        body = lambda: [  # noqa: E731
            k.store("shared", "f32", k.add(row.table, k.shl(entry, 3)),
                    list(ql.k_scale_entry(k, wtype, k.add(row.bbase, k.mul(blk, B)), lc["ksel"])))
            for row in rows
        ]
        if 4 * (e + 1) <= nblocks:
            body()
        else:
            with k.if_(k.setp("lt", blk, nblocks)):
                body()


def _decode(k: KernelBuilder, p: dict, wtype: str, row: RowCtx, lc: dict, sel, i: int):
    """(fs[8], A, C) of the lane's 8 values of round ``i`` of the staged tile of ``row``."""
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
        return fs, a, c
    if p["aligned"]:  # Q6_K, each block's phase is known
        align = {0: 8, 4: 4}.get((i * info.block_bytes) % 8)
        return ql.decode_q6k(k, bb, lc, 0x5432 if align is None else None, align)
    return ql.decode_q6k(k, bb, lc, sel[i % 2], None)


def _round(k: KernelBuilder, p: dict, wtype: str, rows: list[RowCtx], lc: dict, sels: list, xbases: list[Reg],
           i: int) -> None:
    """Round ``i`` of the current tile: each row's 8 values of the lane decoded once and FMA'd with
    the lane's 8 x values of every token. With more tokens than rows the rows are decoded first
    (fewer registers: 8 per row instead of 8 per token), otherwise x is loaded first."""

    def load_x(xb):
        return (list(k.load("global", "f32", xb, i * ROUND * 4, vec=4, nc=True))
                + list(k.load("global", "f32", xb, i * ROUND * 4 + 16, vec=4, nc=True)))

    def contribute(row: RowCtx, m: int, dec, xs, sx_box) -> None:
        fs, a, c = dec
        dot = k.mul(fs[0], xs[0])  # one chain: rows and rounds give the ILP
        for j in range(1, 8):
            dot = k.fma(fs[j], xs[j], dot)
        acc = row.acc[m]
        if isinstance(a, float):
            new = k.add(acc, dot) if a == 1.0 else k.fma(dot, a, acc)
        else:
            new = k.fma(a, dot, acc)
        if c is not None:
            if sx_box[0] is None:
                s01 = k.add(k.add(xs[0], xs[1]), k.add(xs[2], xs[3]))
                s23 = k.add(k.add(xs[4], xs[5]), k.add(xs[6], xs[7]))
                sx_box[0] = k.add(s01, s23)
            new = k.fma(c, sx_box[0], new)
        k.assign(acc, new)

    if len(xbases) > len(rows):
        decs = [_decode(k, p, wtype, row, lc, sels[ri], i) for ri, row in enumerate(rows)]
        for m, xb in enumerate(xbases):
            xs, box = load_x(xb), [None]
            for row, dec in zip(rows, decs):
                contribute(row, m, dec, xs, box)
    else:
        xss = [load_x(xb) for xb in xbases]
        boxes = [[None] for _ in xbases]
        for ri, row in enumerate(rows):
            dec = _decode(k, p, wtype, row, lc, sels[ri], i)
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


def _after_store(k: KernelBuilder, p: dict, wtype: str, rows: list[RowCtx], lc: dict, nblocks: int) -> None:
    k.bar_warp_sync()
    if wtype in K_TABLE:
        _k_table(k, p, wtype, rows, lc, nblocks)
        k.bar_warp_sync()


def build(m: Module, wtype: str, in_dim: int, rows: int, warps: int, bias: bool, residual: bool,
          tokens: int = 0, glu: bool = False) -> KernelBuilder:
    """The GEMV (``tokens == 0``: one x vector) or the token-tiled GEMM (``tokens`` x vectors per CTA,
    grid.y over token tiles). With ``glu`` the weight holds ``2 * out_dim`` rows (gate rows, then up
    rows) and ``y[o] = silu(gate_o . x) * (up_o . x)``."""
    p = plan(wtype, in_dim)
    if rows not in (1, 2, 3, 4) or warps not in (1, 2, 4, 8):
        raise ValueError(f"rows must be 1..4 and warps 1, 2, 4 or 8; got rows={rows}, warps={warps}")
    if glu and (rows % 2 or bias or residual):
        raise ValueError("glu needs an even number of rows per warp and no bias/residual")
    if tokens < 0 or tokens > 8 or rows * tokens > 8:
        raise ValueError(f"tokens (per CTA) must be 0 (GEMV) or 1..8 with rows * tokens <= 8 (registers); "
                         f"got tokens={tokens}, rows={rows}")
    params = [("w", "u64"), ("x", "u64"), ("y", "u64")]
    if bias:
        params.append(("bias", "u64"))
    if residual:
        params.append(("residual", "u64"))
    params.append(("out_dim", "u32"))
    if tokens:
        params.append(("n_tokens", "u32"))
    kind = "gemm" if tokens else "gemv"
    name = (f"{kind}_{wtype.lower()}_k{in_dim}_r{rows}_w{warps}" + (f"_t{tokens}" if tokens else "")
            + ("_glu" if glu else "") + ("_bias" if bias else "") + ("_res" if residual else ""))
    # no .maxntid: with it ptxas aims at an occupancy of its own and spills a few bytes in some variants
    # (e.g. 64 registers for Q4_0 at 4352); without it the same kernels take <= ~100 registers, no spills
    k = m.kernel(name, params)
    per_row = p["stage"] + p["table"]
    if per_row * rows * warps > MAX_STATIC_SMEM:
        raise ValueError(f"{wtype} rows of {in_dim} with rows={rows}, warps={warps} need {per_row * rows * warps} "
                         f"bytes of shared memory, more than {MAX_STATIC_SMEM}: use fewer rows or warps")
    outs_per_warp = rows // 2 if glu else rows
    k.meta.update(block=32 * warps, rows_per_cta=outs_per_warp * warps, tokens_per_cta=max(tokens, 1),
                  smem=per_row * rows * warps, row_bytes=p["row_bytes"])
    info = p["info"]
    nt = max(tokens, 1)

    out_dim = k.param("out_dim")
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    row0 = k.mul(k.mad(k.ctaid(), warps, warp), outs_per_warp)
    done_label = k.new_label("done")
    k.bra(done_label, k.setp("ge", row0, out_dim), uniform=True)
    smem = k.shared_array(f"{name}_stage", "u8", per_row * rows * warps)
    wbase = k.add(smem, k.mul(warp, per_row * rows))
    w, x, y = k.global_ptr("w"), k.global_ptr("x"), k.global_ptr("y")
    last = k.sub(out_dim, 1)
    # token tile: x rows m0 .. m0 + nt - 1 (clamped for loads; stores are guarded)
    if tokens:
        n_tok = k.param("n_tokens")
        m0 = k.mul(k.ctaid("y"), nt)
        last_tok = k.sub(n_tok, 1)
        tok = [k.min(k.add(m0, j), last_tok) if j else k.min(m0, last_tok) for j in range(nt)]
        xs = [k.add(x, k.mul_wide(tk, in_dim * 4)) for tk in tok]
    else:
        m0 = None
        xs = [x]
    lc = ql.lane_constants(k, wtype, lane)
    if wtype in K_TABLE:
        lc["tentry"] = k.shl(k.shr(lane, 2), 3)  # 8 * sub-block j: this lane's table entry in a block
    row_ctx: list[RowCtx] = []
    sels: list = []
    for rr in range(rows):
        if glu:
            half = rows // 2
            r = k.min(k.add(row0, rr % half), last)
            if rr >= half:
                r = k.add(r, out_dim)
        else:
            r = k.min(k.add(row0, rr), last)
        sbuf = k.add(wbase, rr * per_row) if rr else wbase
        table = k.add(sbuf, p["stage"]) if p["table"] else None
        row = RowCtx(k, p, w, r, sbuf, table, nt)
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
        elif wtype == "Q6_K" and not p["aligned"]:
            sel = (ql.realign_selector(k, row.bbase), ql.realign_selector(k, row.bbase, info.block_bytes))
        sels.append(sel)
        row_ctx.append(row)

    # Software pipeline: tile t+1's weights are loaded into registers while tile t is decoded from
    # shared memory, so each warp keeps its loads in flight through its own compute.
    nfull = p["n_full_tiles"]
    npieces = max(p["pieces_full"] if nfull else 0, p["pieces_tail"])
    regs = _piece_regs(k, rows, npieces)
    _issue(k, p, row_ctx, lane, 0, npieces, regs)
    if nfull:
        full = [(i, ROUND) for i in range(p["rpt"])]
        with k.loop(0, nfull) as t:
            _store(k, row_ctx, lane, npieces, regs)
            _after_store(k, p, wtype, row_ctx, lc, p["rpt"])
            _issue(k, p, row_ctx, lane, k.add(t, 1), npieces, regs)  # the next tile, the tail, or nothing
            _compute(k, p, wtype, row_ctx, lc, sels, xs, t, full)
            k.bar_warp_sync()  # the staging buffers are overwritten by the next tile
    if p["tail"]:
        _store(k, row_ctx, lane, npieces, regs)
        _after_store(k, p, wtype, row_ctx, lc, len(p["tail"]))
        _compute(k, p, wtype, row_ctx, lc, sels, xs, nfull, p["tail"])

    totals = [[k.warp_reduce(a) for a in row.acc] for row in row_ctx]
    # recompute the indices rather than keep them live across the loop (ptxas otherwise may spill them)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    row0 = k.mul(k.mad(k.ctaid(), warps, warp), outs_per_warp)
    if tokens:
        m0 = k.mul(k.ctaid("y"), nt)
    is_lane0 = k.setp("eq", lane, 0)
    for o in range(outs_per_warp):
        r = k.add(row0, o) if o else row0
        ok_row = k.and_(is_lane0, k.setp("lt", r, out_dim))
        for j in range(nt):
            if glu:
                g, u = totals[o][j], totals[o + outs_per_warp][j]
                e = k.ex2(k.mul(g, -1.4426950408889634))
                val = k.mul(k.div(g, k.add(e, 1.0)), u)  # silu(g) * u
            else:
                val = totals[o][j]
            ok = ok_row
            if tokens:
                mj = k.add(m0, j) if j else m0
                ok = k.and_(ok_row, k.setp("lt", mj, k.param("n_tokens")))
                idx = k.mad(mj, out_dim, r)
            else:
                idx = r
            with k.if_(ok):
                off = k.mul_wide(idx, 4)
                if bias:
                    val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(r, 4))))
                if residual:
                    val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("residual"), off)))
                k.store("global", "f32", k.add(y, off), val)
    k.label(done_label)
    k.ret()
    return k


@kernel("gemv", grid=_grid_shapes())
def gemv(m: Module, wtype: str = "Q8_0", in_dim: int = 4096, rows: int = 2, warps: int = 4,
         bias: bool = False, residual: bool = False, glu: bool = False) -> KernelBuilder:
    """y[r] = sum_k W[r, k] x[k] (+ bias[r]) (+ residual[r]) for r < out_dim; W in GGUF block form
    (``wtype``: F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K), x/y/bias/residual f32.
    With ``glu``: W is [gate; up] (2 out_dim rows) and y[r] = silu(gate_r . x) * (up_r . x).
    Launch: grid ceil(out_dim / meta["rows_per_cta"]), block meta["block"], no dynamic shared memory."""
    return build(m, wtype, in_dim, rows, warps, bias, residual, tokens=0, glu=glu)


@kernel("gemm", grid=[{"wtype": wt, "in_dim": 256 if wt in ql.K_QUANTS else 576, "tokens": 4}
                      for wt in ql.WEIGHT_TYPES] + [{"wtype": "Q4_K", "in_dim": 4096, "tokens": 8, "rows": 1},
                                                    {"wtype": "Q8_0", "in_dim": 4096, "tokens": 2, "glu": True}])
def gemm(m: Module, wtype: str = "Q8_0", in_dim: int = 4096, rows: int = 2, warps: int = 4, tokens: int = 4,
         bias: bool = False, residual: bool = False, glu: bool = False) -> KernelBuilder:
    """Batched (prefill) Y[t, r] = sum_k W[r, k] X[t, k] (+ bias[r]) (+ residual[t, r]) for t < n_tokens,
    X [n_tokens, in_dim] and Y [n_tokens, out_dim] row-major f32: the GEMV with ``tokens`` x rows per
    CTA (each weight round is decoded once and used for all of them). ``glu`` as for gemv.
    Launch: grid (ceil(out_dim / meta["rows_per_cta"]), ceil(n_tokens / tokens)), block meta["block"]."""
    return build(m, wtype, in_dim, rows, warps, bias, residual, tokens=tokens, glu=glu)
