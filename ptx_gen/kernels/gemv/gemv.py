"""GEMV ``y = W x (+ bias) (+ residual)`` with W in GGUF block form, for decode.

Weights are read exactly once, as 16-byte coalesced ``ld.global.nc.L1::no_allocate.v4`` loads of the
raw row bytes, staged per warp in shared memory (so blocks of 18, 34 or 210 bytes at any even
alignment decode the same way), then decoded there (see :mod:`ptx_gen.kernels.gemv.quant_layout`). x (f32)
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

Split-K (``ksplit`` > 1, GEMV only): the CTA's warps form ``warps / ksplit`` groups; the warps of a
group own the same ``rows`` rows and each walks one K *slice* of them (:func:`split`), so a
4096 x 14336 GEMV has 4-8x the warps, each walking a few tiles instead of 56 rounds. A slice of at
most ``SPLIT_TILE_BYTES`` per row is one tile, copied with ``cp.async`` straight into shared memory
(every load in flight at once, no registers held, no stores); a longer one is walked with the
register pipeline above. Each warp reduces its rows' partial sums, lane 0 writes them to shared
memory, one ``bar.sync``, and lane ``o`` of the group's first warp adds the ``ksplit`` partials of
output ``o`` in slice order (deterministic) and applies the epilogue. There is no early exit (every
warp reaches the barrier): rows past ``out_dim`` are clamped for loads and not stored.

Rows: ``row r`` starts at byte ``r * row_bytes`` of ``w`` (``w`` 16-byte aligned, and the allocation
rounded up to a multiple of 16 bytes: loads are whole 16-byte vectors). ``in_dim`` is a generation
parameter; ``out_dim`` is a runtime argument. ``residual`` may alias ``y`` (in-place ``h += W x``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv_plan import (
    KSPLITS,
    L1_MARGIN,
    MAX_STATIC_SMEM,
    TABLE_BYTES,
    TILE_ROUNDS,
    plan,
    shared_bytes,
    slice_plans,
    split,
    tiles_per_slice,
)
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_TABLE, PER_LANE, ROUND, type_info

# The planning lives in gemv_plan; the GEMV launch policy and tools take it from here.
__all__ = ["gemv", "gemm", "build", "gemv_params", "plan", "split", "shared_bytes", "tiles_per_slice",
           "KSPLITS", "MAX_STATIC_SMEM", "TILE_ROUNDS"]


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
               {"wtype": "Q6_K", "in_dim": 1536, "rows": 4, "bias": True, "residual": True},
               {"wtype": "Q4_K", "in_dim": 14336, "rows": 2, "warps": 4, "ksplit": 4, "residual": True},
               {"wtype": "Q6_K", "in_dim": 14336, "rows": 2, "warps": 8, "ksplit": 8},
               {"wtype": "Q8_0", "in_dim": 4096, "rows": 2, "warps": 4, "ksplit": 2, "glu": True},
               {"wtype": "Q8_0", "in_dim": 576, "rows": 3, "warps": 4, "ksplit": 4, "bias": True}]
    return shapes


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


def _row_contexts(k: KernelBuilder, p: dict, wtype: str, rows: int, glu: bool, row0: Reg, last: Reg, out_dim: Reg,
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


def _walk(k: KernelBuilder, p: dict, wtype: str, row_ctx: list[RowCtx], lc: dict, sels: list, xs: list[Reg],
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


def _store_out(k: KernelBuilder, val: Reg, r: Reg, idx: Reg, bias: bool, residual: bool) -> None:
    """y[idx] = val (+ bias[r]) (+ residual[idx]); residual may be y itself (read before written by the
    same thread)."""
    off = k.mul_wide(idx, 4)
    if bias:
        val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(r, 4))))
    if residual:
        val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("residual"), off)))
    k.store("global", "f32", k.add(k.global_ptr("y"), off), val)


def silu_mul(k: KernelBuilder, g: Reg, u: Reg) -> Reg:
    """silu(g) * u = g / (1 + 2**(-g log2 e)) * u (the GLU epilogue)."""
    e = k.ex2(k.mul(g, -1.4426950408889634))
    return k.mul(k.div(g, k.add(e, 1.0)), u)  # silu(g) * u


def gemv_params(bias: bool, residual: bool) -> list[tuple[str, str]]:
    """The GEMV kernels' parameters: w, x, y (, bias) (, residual), out_dim."""
    return ([("w", "u64"), ("x", "u64"), ("y", "u64")] + ([("bias", "u64")] if bias else [])
            + ([("residual", "u64")] if residual else []) + [("out_dim", "u32")])


def _check_shape(rows: int, warps: int, glu: bool, bias: bool, residual: bool, tokens: int, ksplit: int) -> None:
    """Rejects the shapes :func:`build` cannot emit (emits nothing)."""
    if rows not in (1, 2, 3, 4) or warps not in (1, 2, 4, 8):
        raise ValueError(f"rows must be 1..4 and warps 1, 2, 4 or 8; got rows={rows}, warps={warps}")
    if glu and (rows % 2 or bias or residual):
        raise ValueError("glu needs an even number of rows per warp and no bias/residual")
    if tokens < 0 or tokens > 8 or rows * tokens > 8:
        raise ValueError(f"tokens (per CTA) must be 0 (GEMV) or 1..8 with rows * tokens <= 8 (registers); "
                         f"got tokens={tokens}, rows={rows}")
    if ksplit > warps or (tokens and ksplit > 1):
        raise ValueError(f"ksplit must divide warps (and be 1 for the GEMM); got ksplit={ksplit}, warps={warps}, "
                         f"tokens={tokens}")


@dataclass
class _Setup:
    """The registers :func:`_prologue` emits for the rest of :func:`build`."""
    out_dim: Reg
    row0: Reg  # the warp's first output
    s: Reg | None  # the warp's K slice (ksplit > 1)
    done_label: object  # the early exit of warps past out_dim (ksplit == 1)
    w: Reg
    x: Reg
    wbase: Reg  # the warp's staging area in shared memory
    last: Reg  # out_dim - 1
    xs: list  # the x rows (one per token)
    lc: dict  # the lane's decode constants


def _prologue(k: KernelBuilder, name: str, wtype: str, in_dim: int, warps: int, rows: int, tokens: int, ksplit: int,
              outs_per_warp: int, per_row: int, nt: int) -> _Setup:
    """Emits the warp's coordinates and first output (with ksplit == 1 the warp-uniform early exit of
    warps past out_dim), its staging area in shared memory, the global pointers, the token tile's x
    rows (GEMM) and the lane's decode constants."""
    groups = warps // ksplit
    s = done_label = None
    out_dim = k.param("out_dim")
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    if ksplit == 1:
        row0 = k.mul(k.mad(k.ctaid(), warps, warp), outs_per_warp)
        done_label = k.new_label("done")
        k.bra(done_label, k.setp("ge", row0, out_dim), uniform=True)
    else:  # no early exit: every warp must reach the bar.sync (rows past the end are clamped, not stored)
        s = k.and_(warp, ksplit - 1)
        row0 = k.mul(k.mad(k.ctaid(), groups, k.shr(warp, ksplit.bit_length() - 1)), outs_per_warp)
    smem = k.shared_array(f"{name}_stage", "u8", per_row * rows * warps)
    wbase = k.add(smem, k.mul(warp, per_row * rows))
    w, x = k.global_ptr("w"), k.global_ptr("x")
    k.global_ptr("y")  # converted once, up front: every store of the epilogue reuses it
    last = k.sub(out_dim, 1)
    # token tile: x rows m0 .. m0 + nt - 1 (clamped for loads; stores are guarded)
    if tokens:
        n_tok = k.param("n_tokens")
        m0 = k.mul(k.ctaid("y"), nt)
        last_tok = k.sub(n_tok, 1)
        tok = [k.min(k.add(m0, j), last_tok) if j else k.min(m0, last_tok) for j in range(nt)]
        xs = [k.add(x, k.mul_wide(tk, in_dim * 4)) for tk in tok]
    else:
        xs = [x]
    lc = ql.lane_constants(k, wtype, lane)
    if wtype in K_TABLE:
        lc.update(k_table_constants(k, lane))
    return _Setup(out_dim, row0, s, done_label, w, x, wbase, last, xs, lc)


def build(m: Module, wtype: str, in_dim: int, rows: int, warps: int, bias: bool, residual: bool,
          tokens: int = 0, glu: bool = False, ksplit: int = 1) -> KernelBuilder:
    """The GEMV (``tokens == 0``: one x vector) or the token-tiled GEMM (``tokens`` x vectors per CTA,
    grid.y over token tiles). With ``glu`` the weight holds ``2 * out_dim`` rows (gate rows, then up
    rows) and ``y[o] = silu(gate_o . x) * (up_o . x)``. With ``ksplit > 1`` (GEMV only) the CTA's warps
    form ``warps / ksplit`` groups; the ``ksplit`` warps of a group own the same rows and each walks one
    K slice of them; the slices' row sums meet in shared memory (one ``bar.sync``) and the group's
    first warp applies the epilogue, one output per lane."""
    sp = split(wtype, in_dim, ksplit)
    _check_shape(rows, warps, glu, bias, residual, tokens, ksplit)
    info = type_info(wtype)
    row_bytes = info.row_bytes(in_dim)
    p_full, p_last = slice_plans(wtype, sp)
    plans = [p for p in (p_full, p_last) if p is not None]
    params = gemv_params(bias, residual)
    if tokens:
        params.append(("n_tokens", "u32"))
    kind = "gemm" if tokens else "gemv"
    name = (f"{kind}_{wtype.lower()}_k{in_dim}_r{rows}_w{warps}" + (f"_s{ksplit}" if ksplit > 1 else "")
            + (f"_t{tokens}" if tokens else "") + ("_glu" if glu else "") + ("_bias" if bias else "")
            + ("_res" if residual else ""))
    # no .maxntid: with it ptxas aims at an occupancy of its own and spills a few bytes in some variants
    # (e.g. 64 registers for Q4_0 at 4352); without it the same kernels take <= ~100 registers, no spills
    k = m.kernel(name, params)
    stage = max(p["stage"] for p in plans)
    per_row = stage + max(p["table"] for p in plans)
    smem_bytes = shared_bytes(wtype, in_dim, rows, warps, ksplit)
    if smem_bytes > MAX_STATIC_SMEM:
        raise ValueError(f"{wtype} rows of {in_dim} with rows={rows}, warps={warps}, ksplit={ksplit} need "
                         f"{smem_bytes} bytes of shared memory, more than {MAX_STATIC_SMEM}: use fewer rows or warps "
                         f"(or a larger ksplit)")
    outs_per_warp = rows // 2 if glu else rows
    groups = warps // ksplit
    k.meta.update(block=32 * warps, rows_per_cta=outs_per_warp * groups, tokens_per_cta=max(tokens, 1),
                  smem=smem_bytes, row_bytes=row_bytes, ksplit=ksplit)
    if ksplit > 1:
        # every warp re-reads its slice of x through L1 (x_bytes per weight byte: 4 / (rows * bytes per
        # value), several times the weights): the launcher keeps L1 at least this large (a shared-memory
        # carveout preference) so x stays cached however many of these CTAs share an SM
        k.meta["l1_bytes"] = 4 * in_dim + L1_MARGIN
    nt = max(tokens, 1)

    g = _prologue(k, name, wtype, in_dim, warps, rows, tokens, ksplit, outs_per_warp, per_row, nt)
    out_dim, x, s, lc = g.out_dim, g.x, g.s, g.lc
    ctx_args = (wtype, rows, glu, g.row0, g.last, out_dim, g.w, g.wbase, per_row, stage, lc, nt, row_bytes)

    accs = _accumulate(k, p_full, p_last, sp, wtype, rows, ksplit, ctx_args, lc, g.xs, x, s)

    totals = [[k.warp_reduce(a) for a in acc] for acc in accs]
    # recompute the indices rather than keep them live across the loop (ptxas otherwise may spill them)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    if ksplit > 1:
        _combine_slices(k, name, totals, lane, warp, rows, warps, ksplit, outs_per_warp, glu, bias, residual)
        k.ret()
        return k
    _store_rows(k, totals, lane, warp, warps, outs_per_warp, nt, tokens, glu, out_dim, bias, residual)
    k.label(g.done_label)
    k.ret()
    return k


def _accumulate(k: KernelBuilder, p_full: dict, p_last: dict | None, sp: dict, wtype: str, rows: int, ksplit: int,
                ctx_args: tuple, lc: dict, xs: list, x: Reg, s: Reg | None) -> list:
    """Emits the walk over K: the warp's rows over all of K (ksplit == 1), or over its K slice, with
    warp-uniform branches for the full slices, the short last slice and idle warps. Returns the rows'
    accumulators ([row][token])."""
    if ksplit == 1:
        row_ctx, sels = _row_contexts(k, p_full, *ctx_args)
        _walk(k, p_full, wtype, row_ctx, lc, sels, xs)
        return [row.acc for row in row_ctx]
    else:
        accs = [[k.var("f32", 0.0)] for _ in range(rows)]

        def walk_slice(p: dict) -> None:
            off = k.mul_wide(s, sp["slice_bytes"])
            xsl = [k.add(x, k.mul_wide(s, sp["slice_vals"] * 4))]
            row_ctx, sels = _row_contexts(k, p, *ctx_args, offset=off, accs=accs)
            _walk(k, p, wtype, row_ctx, lc, sels, xsl, copy_async=True)

        if sp["n_full"] == ksplit:
            walk_slice(p_full)
        else:  # warp-uniform branches (bra.uni: ptxas then needs no reconvergence code for the warp
            # collectives inside): full slices, the short last slice; idle warps skip both
            after_full = k.new_label("after_full")
            k.bra(after_full, k.setp("ge", s, sp["n_full"]), uniform=True)
            walk_slice(p_full)
            k.label(after_full)
            if p_last is not None:
                after_last = k.new_label("after_last")
                k.bra(after_last, k.setp("ne", s, sp["n_full"]), uniform=True)
                walk_slice(p_last)
                k.label(after_last)
            k.grid_dependency_wait()  # (the idle warps', before the epilogue; a second wait is a no-op)

    return accs


def _store_rows(k: KernelBuilder, totals: list, lane: Reg, warp: Reg, warps: int, outs_per_warp: int, nt: int,
                tokens: int, glu: bool, out_dim: Reg, bias: bool, residual: bool) -> None:
    """Emits the one-slice epilogue: lane 0 stores each of the warp's outputs (per token; silu(g) * u
    with glu) for rows < out_dim (and tokens < n_tokens), + bias/residual."""
    row0 = k.mul(k.mad(k.ctaid(), warps, warp), outs_per_warp)
    if tokens:
        m0 = k.mul(k.ctaid("y"), nt)
    is_lane0 = k.setp("eq", lane, 0)
    for o in range(outs_per_warp):
        r = k.add(row0, o) if o else row0
        ok_row = k.and_(is_lane0, k.setp("lt", r, out_dim))
        for j in range(nt):
            if glu:
                val = silu_mul(k, totals[o][j], totals[o + outs_per_warp][j])
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
                _store_out(k, val, r, idx, bias, residual)


def _combine_slices(k: KernelBuilder, name: str, totals: list, lane: Reg, warp: Reg, rows: int, warps: int,
                    ksplit: int, outs_per_warp: int, glu: bool, bias: bool, residual: bool) -> None:
    """Split-K epilogue: lane 0 of every warp writes its slice's row sums to ``red[warp][row]``; after
    one ``bar.sync`` lane ``o`` of each group's first warp adds the group's ``ksplit`` partial sums of
    its output ``o`` (in slice order: deterministic) and applies bias/residual (or silu(g) * u)."""
    red = k.shared_array(f"{name}_red", "f32", rows * warps, align=16)
    mine = k.add(red, k.mul(warp, 4 * rows))
    vals = [t[0] for t in totals]
    with k.if_(k.setp("eq", lane, 0)):
        if rows in (2, 4):
            k.store("shared", "f32", mine, vals)
        else:
            for rr, v in enumerate(vals):
                k.store("shared", "f32", mine, v, 4 * rr)
    k.bar_sync()
    out_dim = k.param("out_dim")
    groups = warps // ksplit
    group = k.shr(warp, ksplit.bit_length() - 1)
    r = k.add(k.mul(k.mad(k.ctaid(), groups, group), outs_per_warp), lane)
    first = k.setp("eq", k.and_(warp, ksplit - 1), 0)
    ok = k.and_(k.and_(first, k.setp("lt", lane, outs_per_warp)), k.setp("lt", r, out_dim))
    with k.if_(ok):
        src = k.add(mine, k.shl(lane, 2))  # red[warp + s][lane] for s < ksplit

        def partial_sum(extra: int) -> Reg:
            acc = k.load("shared", "f32", src, extra)
            for sl in range(1, ksplit):
                acc = k.add(acc, k.load("shared", "f32", src, sl * 4 * rows + extra))
            return acc

        if glu:
            val = silu_mul(k, partial_sum(0), partial_sum(4 * outs_per_warp))
        else:
            val = partial_sum(0)
        _store_out(k, val, r, r, bias, residual)


@kernel("gemv", grid=_grid_shapes())
def gemv(m: Module, wtype: str = "Q8_0", in_dim: int = 4096, rows: int = 2, warps: int = 4,
         bias: bool = False, residual: bool = False, glu: bool = False, ksplit: int = 1) -> KernelBuilder:
    """y[r] = sum_k W[r, k] x[k] (+ bias[r]) (+ residual[r]) for r < out_dim; W in GGUF block form
    (``wtype``: F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K), x/y/bias/residual f32.
    With ``glu``: W is [gate; up] (2 out_dim rows) and y[r] = silu(gate_r . x) * (up_r . x).
    ``ksplit`` (1, 2, 4, 8; divides ``warps``): warps per row group, each summing one K slice.
    Launch: grid ceil(out_dim / meta["rows_per_cta"]), block meta["block"], no dynamic shared memory."""
    return build(m, wtype, in_dim, rows, warps, bias, residual, tokens=0, glu=glu, ksplit=ksplit)


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
