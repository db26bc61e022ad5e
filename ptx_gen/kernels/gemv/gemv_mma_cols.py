"""The tensor-core GEMV over several columns of x (:func:`ptx_gen.kernels.gemv.gemv_mma.build` with ``cols``):
``Y[c] = W X[c]`` for the columns c < C of a small batch (C <= ``MAX_COLS``), each weight byte read and
decoded once for all of them.

A warp's weights arrive as in the one-column kernel (the same ring, copies and tile-major layouts); what
depends on x is repeated per column: each column has its own pair of x slots (digits, sums of x per 32
values, 1 / f), its own accumulators and min terms, and its own MMAs, which share the A fragments (the
decoded weight codes) the lane built once. The scale table holds the rows' plain ``d`` here: every
column's x has its own power of two ``f``, so each column's FMA weights its integer sums by ``d / f_c``.

x: C columns of ``in_dim`` values, ``ldx`` values apart, f32 or (``xh``) f16 (the batched decode step's
activations); y (and ``residual``, f32): ``ldy`` apart, f32 or (``out_f16``) f16. The next unit's x is
loaded after each unit body, every column's loads issued before any is converted (one latency a unit, not
one a column), rather than kept in flight in registers across the body as the one-column kernel does:
C columns' worth of registers would not fit beside C sets of accumulators.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv import silu_mul
from ptx_gen.kernels.gemv.gemv_mma_layout import BLOCK32, INVF, XSUM
from ptx_gen.kernels.gemv.gemv_mma_units import (b32_rows, b32_table_row, exact_float, lanes_with_rows, or_bit4,
                                                  q4k_min, q4k_table_row, q6k_codes, q6k_lane, q6k_rows,
                                                  q6k_table_row, q8_0_words)


def load_x_cols(k: KernelBuilder, x: Reg, ldxb: Reg, lane: Reg, unit: Reg | int, cols: int, xh: bool,
                valid: Reg | None) -> list[list]:
    """Lane l's 8 values (quads l and 32 + l) of x unit ``unit`` in each of the ``cols`` columns (``ldxb``
    bytes apart, u64), as f32; every load is issued before any value is used. Past the warp's units
    (``valid`` false) the values are 0."""
    esize = 2 if xh else 4
    lane_off = k.cvt(k.shl(lane, 3 if xh else 4), "u64")
    ubytes = 256 * esize
    base = k.add(x, k.add(k.mul_wide(unit, ubytes) if isinstance(unit, Reg) else unit * ubytes, lane_off))
    raw = []
    for c in range(cols):
        col = base if c == 0 else k.add(base, k.mul(ldxb, c))
        if xh:  # 4 halves a quad: one 8-byte load
            raw.append([k.load("global", "u32", col, 128 * esize * h, vec=2, pred=valid, other=0) for h in range(2)])
        else:
            raw.append([k.load("global", "f32", col, 128 * esize * h, vec=4, pred=valid, other=0.0) for h in range(2)])
    if not xh:
        return [[v for quad in r for v in quad] for r in raw]
    return [[k.cvt(Reg(hh.name, ql.F16_TYPE), "f32") for quad in r for w in quad for hh in k.unpack_b32(w)]
            for r in raw]


def _inv_fs(k: KernelBuilder, wtype: str, xslots: list) -> list:
    """Each column's 1 / f for the unit (its digits are x f)."""
    return [k.load("shared", "f32", xs, INVF[wtype]) for xs in xslots]


def unit_q4k_cols(k: KernelBuilder, c: dict, sbase: Reg, xslots: list, accs: list, minaccs: list,
                  q5: bool = False) -> None:
    """:func:`~ptx_gen.kernels.gemv.gemv_mma_units._unit_q4k` over the columns of ``xslots``: the same table
    (d plain) and A fragments, per column its B words, two MMAs a pair, sums and min terms."""
    U, TR = c["U"], c["TR"]
    qs0 = 48 if q5 else 16
    with lanes_with_rows(k, c):
        d_h, dmin_h, mins = q4k_table_row(k, c, sbase)
        d = k.cvt(Reg(d_h.name, ql.F16_TYPE), "f32")
        k.store("shared", "f32", c["t_mine"], [d, d if q5 else k.mul(d, 0.0625)], 32)
        dmin = k.cvt(Reg(dmin_h.name, ql.F16_TYPE), "f32")
        mfs = [q4k_min(k, mins, i, dmin) for i in range(8)]
        for xs, minacc in zip(xslots, minaccs):
            sx = [v for o in (0, 16) for v in k.load("shared", "f32", xs, XSUM["Q4_K"] + o, vec=4)]
            msum = k.mul(mfs[0], sx[0])
            for i in range(1, 8):
                msum = k.fma(mfs[i], sx[i], msum)
            k.assign(minacc, k.add(minacc, msum))
    k.bar_warp_sync()
    inv_fs = _inv_fs(k, "Q4_K", xslots)
    for r in range(c["tiles"]):
        scl = [k.load("shared", "u32", c["t_gc"], (16 * r + h) * TR, vec=4) for h in (0, 8)]
        ints = [[None] * 4 for _ in xslots]
        qh = k.ldmatrix_x4(k.add(sbase, c["ldm"]), 16 * r * U + 16) if q5 else None
        for j in range(4):
            regs = k.ldmatrix_x4(k.add(sbase, c["ldm"]), 16 * r * U + qs0 + 32 * j)
            if q5:
                lo = [or_bit4(k, k.and_(x, 0x0F0F0F0F), h, 2 * j) for x, h in zip(regs, qh)]
                hi = [or_bit4(k, k.and_(k.shr(x, 4), 0x0F0F0F0F), h, 2 * j + 1) for x, h in zip(regs, qh)]
            else:
                lo = [k.and_(x, 0x0F0F0F0F) for x in regs]
                hi = [k.and_(x, 0xF0F0F0F0) for x in regs]
            for xs, it in zip(xslots, ints):
                w0, w1 = k.load("shared", "u32", k.add(xs, c["b_q4"]), 256 * j, vec=2)
                b = [k.and_(w, m) for w in (w0, w1) for m in c["b_mask"]]
                dd = k.mma_s8([lo[0], lo[1], hi[0], hi[1]], b[0:2], c["zeros"], a_unsigned=True)
                dd = k.mma_s8([lo[2], lo[3], hi[2], hi[3]], b[2:4], dd, a_unsigned=True)
                for n in range(4):
                    sc = k.bitcast(scl[n // 2][j], "s32")
                    it[n] = k.mul(dd[n], sc) if it[n] is None else k.mad(dd[n], sc, it[n])
        dg = k.load("shared", "f32", c["t_gd"], 16 * r * TR)
        dg8 = k.load("shared", "f32", c["t_gd"], (16 * r + 8) * TR)
        for inv_f, it, acc in zip(inv_fs, ints, accs):
            d0, d8 = k.mul(dg, inv_f), k.mul(dg8, inv_f)
            for n, dv in ((0, d0), (1, d0), (2, d8), (3, d8)):
                k.assign(acc[r][n], k.fma(dv, k.cvt(it[n], "f32"), acc[r][n]))


def unit_q6k_cols(k: KernelBuilder, c: dict, sbase: Reg, xslots: list, accs: list, p: Reg | None) -> None:
    """:func:`~ptx_gen.kernels.gemv.gemv_mma_units._unit_q6k` over the columns of ``xslots``: the codes are
    assembled once; per column the offset MMA (-32 times its digit sums) and the code MMA."""
    TR = c["TR"]
    row_w, a_w, realign = q6k_lane(k, c, p)
    with lanes_with_rows(k, c):
        d = q6k_table_row(k, c, sbase, row_w, p, realign)
        k.store("shared", "f32", c["t_mine"], d, 64)
    k.bar_warp_sync()
    inv_fs = _inv_fs(k, "Q6_K", xslots)
    a0 = k.add(sbase, a_w)
    for r in range(c["tiles"]):
        words, scales, qab = q6k_rows(k, c, a0, r, p, realign)
        ints = [[None] * 4 for _ in xslots]
        for m in range(8):
            a_lo, a_hi = q6k_codes(k, words, qab, m)
            for xs, it in zip(xslots, ints):
                b = k.load("shared", "u32", k.add(xs, c["b_q6"]), 512 * (m >> 1) + 8 * (m & 1), vec=2)
                off = k.mma_s8(c["minus32"], b, c["zeros"])
                dd = k.mma_s8([a_lo[0], a_lo[1], a_hi[0], a_hi[1]], b, off, a_unsigned=True)
                for nn in range(4):
                    sc = k.bitcast(scales[nn // 2][m], "s32")
                    it[nn] = k.mul(dd[nn], sc) if it[nn] is None else k.mad(dd[nn], sc, it[nn])
        dg = k.load("shared", "f32", c["t_g"], 16 * r * TR + 64)
        dg8 = k.load("shared", "f32", c["t_g"], (16 * r + 8) * TR + 64)
        for inv_f, it, acc in zip(inv_fs, ints, accs):
            d0, d8 = k.mul(dg, inv_f), k.mul(dg8, inv_f)
            for nn, dv in ((0, d0), (1, d0), (2, d8), (3, d8)):
                k.assign(acc[r][nn], k.fma(dv, k.cvt(it[nn], "f32"), acc[r][nn]))


def unit_q8_0_cols(k: KernelBuilder, c: dict, sbase: Reg, xslots: list, accs: list) -> None:
    """:func:`~ptx_gen.kernels.gemv.gemv_mma_units._unit_q8_0` over the columns of ``xslots``."""
    U = c["U"]
    with lanes_with_rows(k, c):
        row = k.add(sbase, c["row_stage"])
        ds = [ql.lds_f16(k, row, 34 * i) for i in range(8)]
        k.store("shared", "f32", c["t_mine"], ds[:4])
        k.store("shared", "f32", c["t_mine"], ds[4:], 16)
    k.bar_warp_sync()
    inv_fs = _inv_fs(k, "Q8_0", xslots)
    rg_t = k.add(k.add(sbase, k.mul(c["g"], U)), c["t4"])
    bjs = [k.add(xs, c["b_lane"]) for xs in xslots]
    bs: list = []
    for blk in range(8):
        if blk % 2 == 0:
            bs = [k.load("shared", "u32", bj, 32 * blk, vec=4, pred=c["b_ok"], other=0) for bj in bjs]
        q = 34 * blk + 2
        for r in range(c["tiles"]):
            words = q8_0_words(k, rg_t, 16 * r * U + q, U)
            sg = k.load("shared", "f32", c["t_g"], 16 * r * c["TR"] + 4 * blk)
            sg8 = k.load("shared", "f32", c["t_g"], (16 * r + 8) * c["TR"] + 4 * blk)
            for b, inv_f, acc in zip(bs, inv_fs, accs):
                d = k.mma_s8(words, b[0:2] if blk % 2 == 0 else b[2:4], c["zeros"])
                s0, s8 = k.mul(sg, inv_f), k.mul(sg8, inv_f)
                for n, s in ((0, s0), (1, s0), (2, s8), (3, s8)):
                    k.assign(acc[r][n], k.fma(s, exact_float(k, d[n]), acc[r][n]))


def unit_b32_cols(k: KernelBuilder, wtype: str, c: dict, sbase: Reg, xslots: list, accs: list,
                  minaccs: list | None) -> None:
    """:func:`~ptx_gen.kernels.gemv.gemv_mma_units._unit_b32` over the columns of ``xslots``: the table (plain
    block scales), the fifth bits and the A words once; per column the offset MMAs (Q4_0 / Q5_0), the
    pair of MMAs and the min terms (Q4_1 / Q5_1)."""
    f = BLOCK32[wtype]
    TR = c["TR"]
    with lanes_with_rows(k, c):
        _, m16 = b32_table_row(k, wtype, c, sbase, None)
        if f["m"] is not None:
            ms = [k.cvt(Reg(m_.name, ql.F16_TYPE), "f32") for m_ in m16]
            for xs, minacc in zip(xslots, minaccs):
                sx = [v for o in (0, 16) for v in k.load("shared", "f32", xs, XSUM[wtype] + o, vec=4)]
                msum = k.mul(ms[0], sx[0])
                for i in range(1, 8):
                    msum = k.fma(ms[i], sx[i], msum)
                k.assign(minacc, k.sub(minacc, msum))
    k.bar_warp_sync()
    inv_fs = _inv_fs(k, wtype, xslots)
    a_words = b32_rows(k, wtype, c, sbase)
    scl = []
    for p in range(4):
        if p % 2 == 0:
            scl = [k.load("shared", "f32", c["t_gc"], (16 * r + h) * TR + 4 * p, vec=2) for r in range(c["tiles"])
                   for h in (0, 8)]
        for r in range(c["tiles"]):
            lo, hi = a_words(r, p)
            for xs, inv_f, acc in zip(xslots, inv_fs, accs):
                w0, w1 = k.load("shared", "u32", k.add(xs, c["b_q4"]), 256 * p, vec=2)
                bfr = [k.and_(w, m) for w in (w0, w1) for m in c["b_mask"]]
                cin = c["zeros"]
                if f["zero"]:
                    cin = k.mma_s8([c["minus_zero"]] * 4, bfr[0:2], cin)
                    cin = k.mma_s8([c["minus_zero"]] * 4, bfr[2:4], cin)
                d = k.mma_s8(lo, bfr[0:2], cin, a_unsigned=True)
                d = k.mma_s8(hi, bfr[2:4], d, a_unsigned=True)
                for h in range(2):
                    v = k.mad(k.bitcast(d[2 * h + 1], "s32"), 256, k.bitcast(d[2 * h], "s32"))
                    k.assign(acc[r][h], k.fma(k.mul(scl[2 * r + h][p % 2], inv_f), k.cvt(v, "f32"), acc[r][h]))


def epilogue_cols(k: KernelBuilder, lay: dict, mtiles: int, kparts: int, col_sums: list, smem: Reg, tid: Reg,
                  lane: Reg, g: Reg, t: Reg, row_base: Reg, out_dim: Reg, bias: bool, residual: bool, glu: bool,
                  out_f16: bool) -> None:
    """Stores each column's rows (``col_sums[c]``: rows g, g + 8 (, 16 + g, 24 + g), complete in lanes
    t == 0) through :func:`store_rows`; + bias (per row) and residual (per column, f32), y f32 or f16,
    columns ``ldy`` apart."""
    warp = k.shr(tid, 5)
    ldy = k.param("ldy")
    y = k.global_ptr("y")
    osize = 2 if out_f16 else 4

    def store(val: Reg, r: Reg, col: int) -> None:
        if bias:
            val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(r, 4))))
        idx = k.mad(ldy, col, r) if col else r
        if residual:
            val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("residual"), k.mul_wide(idx, 4))))
        addr = k.add(y, k.mul_wide(idx, osize))
        if out_f16:
            k.store("global", "b16", addr, k.bitcast(k.cvt(val, "f16"), "b16"))
        else:
            k.store("global", "f32", addr, val)
    store_rows(k, lay, mtiles, kparts, col_sums, smem, warp, lane, g, t, row_base, out_dim, glu, store)


def store_rows(k: KernelBuilder, lay: dict, mtiles: int, kparts: int, col_sums: list, smem: Reg, warp: Reg,
               lane: Reg, g: Reg, t: Reg, row_base: Reg, out_dim: Reg, glu: bool, store) -> None:
    """The tensor-core GEMVs' end: ``store(value, row, col)`` of each column's rows below ``out_dim``
    (``col_sums[c]``: the warp's rows g, g + 8 (, 16 + g, 24 + g), complete in lanes t == 0; with
    ``glu`` output o is silu(row o) * (row 16 + o)). With K parts the parts meet in shared memory first
    (one ``bar.sync`` for every column) and the first part's warp adds them in order (deterministic)."""
    R = lay["rows"]
    C = len(col_sums)
    outs = 16 if glu else R
    t0 = k.setp("eq", t, 0)
    if kparts == 1:
        for i in range(2 if glu else len(col_sums[0])):
            rr = k.add(row_base, k.add(g, 8 * i) if i else g)
            with k.if_(k.and_(t0, k.setp("lt", rr, out_dim))):
                for col, sums in enumerate(col_sums):
                    store(silu_mul(k, sums[i], sums[2 + i]) if glu else sums[i], rr, col)
        return
    red = k.add(smem, lay["off"]["red"])
    mine = k.add(red, k.mul(warp, 4 * R * C))  # red[kp][mt][col][R] = red[warp][col][R]
    with k.if_(t0):
        for col, sums in enumerate(col_sums):
            for i, sm in enumerate(sums):
                k.store("shared", "f32", k.add(mine, k.shl(g, 2)), sm, 4 * R * col + 32 * i)
    k.bar_sync()
    r = k.add(row_base, lane)
    first = k.setp("lt", warp, mtiles)  # kp == 0
    with k.if_(k.and_(k.and_(first, k.setp("lt", lane, outs)), k.setp("lt", r, out_dim))):
        src = k.add(mine, k.shl(lane, 2))

        def part_sum(extra: int) -> Reg:
            v = k.load("shared", "f32", src, extra)
            for p in range(1, kparts):
                v = k.add(v, k.load("shared", "f32", src, p * mtiles * 4 * R * C + extra))
            return v

        for col in range(C):
            base = 4 * R * col
            store(silu_mul(k, part_sum(base), part_sum(base + 64)) if glu else part_sum(base), r, col)
