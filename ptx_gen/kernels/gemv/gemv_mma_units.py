"""Building blocks of the tensor-core GEMV (:mod:`ptx_gen.kernels.gemv.gemv_mma`): x turned into base-256
digit fragments in a warp's x slot, and the per-unit MMA bodies of each weight type."""

from __future__ import annotations

import contextlib

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv_mma_layout import (BLOCK32, INVF, MINS, PAIRED, PLANE, Q6K_D, Q6K_ROW, SWIZZLE,
                                                   TILED_B32, XSUM)


def mod_by(k: KernelBuilder, j: Reg, n: int) -> Reg:
    return k.and_(j, n - 1) if n & (n - 1) == 0 else k.rem(j, n)


def div_by(k: KernelBuilder, j: Reg, n: int) -> Reg:
    return k.shr(j, n.bit_length() - 1) if n & (n - 1) == 0 else k.div(j, n)


def _digits(k: KernelBuilder, v: Reg, f: Reg) -> Reg:
    """The four signed base-256 digits of X = round(v f) (|v f| < 2**30) as the bytes of a word.

    v f is exact (f is a power of two) and rounds to X exactly (``cvt.rni``). Balanced digits (each in
    [-128, 127]) are the bytes of X + 0x80808080, each minus 128: that word xor 0x80808080. Four
    instructions; the conversion unit's quarter rate is far from a limit here."""
    x = k.cvt(k.mul(v, f), "s32", rounding="rni")
    return k.xor(k.add(k.bitcast(x, "u32"), 0x80808080), 0x80808080)


def x_lane_constants(k: KernelBuilder, wtype: str, lane: Reg) -> dict:
    """Where lane l's two quads of a unit's x (values 4l.. and 128 + 4l..) go in an x slot.

    Q8_0: chunk c = q / 8 (32 values), u = q % 8, word [pair c / 2][t = u % 4][c % 2][hi = u / 4] of
    each plane (the B fragments of lane (g, t) are then one 16-byte load per pair); the second quad is
    128 bytes on. Q4_K: see below. Q6_K: quad q = 32 n + 8 i + 4 lh + t (value 128 n + 32 i + 16 lh + 4 t.., i.e. sub-block
    8 n + 2 i + lh) feeds MMA m = 4 n + 2 (i % 2) + lh as column class i / 2, at word
    [m / 2][column 4 (i / 2) + digit][t][m % 2][i / 2] (see unit_q6k)."""
    if wtype == "Q6_K":
        cls = k.shr(lane, 4)
        woff = k.add(k.add(k.shl(k.and_(k.shr(lane, 3), 1), 9), k.mul(cls, 260)),
                     k.add(k.shl(k.and_(lane, 3), 4), k.shl(k.and_(k.shr(lane, 2), 1), 3)))
        return {"woff": woff, "lane0": k.setp("eq", lane, 0), "plane": 64, "half": 1024}
    c, u = k.shr(lane, 3), k.and_(lane, 7)
    if wtype in PAIRED:
        # quad q = 16 j + 8 c + 4 h + t (pair j, class c) feeds MMA 2 j + h, lane t, as column class c:
        # digit d at word [j][4 c + d][t][h] (no zero words: the unit bodies mask them in), and (types
        # with mins) the 8 sums of x per 32 values after the fragments
        woff = k.add(k.add(k.shl(k.shr(lane, 4), 8), k.shl(k.and_(c, 1), 7)),
                     k.add(k.shl(k.and_(lane, 3), 3), k.shl(k.and_(k.shr(lane, 2), 1), 2)))
        xc = {"woff": woff, "lane0": k.setp("eq", lane, 0), "plane": 32, "half": 512}
        if wtype in MINS:
            xc.update(sum_off=k.add(k.shl(c, 2), XSUM[wtype]), sum_lane=k.setp("eq", u, 0))
        return xc
    woff = k.add(k.add(k.shl(k.shr(c, 1), 6), k.shl(k.and_(u, 3), 4)),
                 k.add(k.shl(k.and_(c, 1), 3), k.shl(k.shr(u, 2), 2)))
    return {"woff": woff, "lane0": k.setp("eq", lane, 0), "plane": PLANE, "half": 128}


def load_x(k: KernelBuilder, x: Reg, lane16: Reg, unit: Reg | int, valid: Reg | None, into: list | None = None) -> list:
    """Lane l's 8 values of x unit ``unit`` (256 values): quads l and 32 + l (``into``: into Vars)."""
    base = k.add(x, k.add(k.mul_wide(unit, 1024) if isinstance(unit, Reg) else unit * 1024, lane16))
    out = []
    for h in range(2):
        dst = into[4 * h:4 * h + 4] if into is not None else None
        v = k.load("global", "f32", base, 512 * h, vec=4, pred=valid, into=dst,
                   other=None if into is not None or valid is None else 0.0)
        out += list(v)
    return out


def convert_x(k: KernelBuilder, wtype: str, vals: list, slot: Reg, xc: dict) -> None:
    """One unit of x (lane l's 8 values) -> the warp's x slot: ``f`` = a power of two with
    max |x f| < 2**30 over the unit (a warp max), the four digit planes, 1 / f, and (Q4_K) the sums
    of x per 32 values. Warp-collective: every lane must take part."""
    # max |x| as the integer max of the bit patterns without their signs (those of an Inf or NaN are
    # the largest: one in the unit makes the max one too), over the warp in one redux
    mags = [k.and_(k.bitcast(v, "u32"), 0x7FFFFFFF) for v in vals]
    mx = mags[0]
    for v in mags[1:]:
        mx = k.max(mx, v)
    e = k.max(k.shr(k.redux(mx, "max"), 23), 30)  # biased exponent of max |x| (>= 30)
    f = k.bitcast(k.shl(k.sub(283, e), 23), "f32")  # 2**(156 - e): |x| f < 2**30
    # 1 / f = 2**(e - 156); NaN for a unit holding an Inf or NaN (exponent 255), which its digits cannot
    # represent: every row's result becomes NaN, as a float dot product with such an x at best is
    inv_f = k.selp(float("nan"), k.bitcast(k.shl(k.sub(e, 29), 23), "f32"), k.setp("eq", e, 255), "f32")
    k.store("shared", "f32", slot, inv_f, INVF[wtype], pred=xc["lane0"])
    addr = k.add(slot, xc["woff"])
    for h in range(2):
        v = vals[4 * h:4 * h + 4]
        ws = [_digits(k, val, f) for val in v]
        t0, t1 = k.prmt(ws[0], ws[1], 0x5140), k.prmt(ws[2], ws[3], 0x5140)  # a 4 x 4 byte transpose
        t2, t3 = k.prmt(ws[0], ws[1], 0x7362), k.prmt(ws[2], ws[3], 0x7362)
        planes = (k.prmt(t0, t1, 0x5410), k.prmt(t0, t1, 0x7632), k.prmt(t2, t3, 0x5410), k.prmt(t2, t3, 0x7632))
        for p, word in enumerate(planes):
            k.store("shared", "u32", addr, word, p * xc["plane"] + xc["half"] * h)
        if "sum_off" in xc:
            sm = k.warp_reduce(k.add(k.add(v[0], v[1]), k.add(v[2], v[3])), "add", width=8)
            k.store("shared", "f32", k.add(slot, xc["sum_off"]), sm, 16 * h, pred=xc["sum_lane"])


def lanes_with_rows(k: KernelBuilder, c: dict):
    """The lanes r < R (one per row of the warp) only: a branch for 16-row warps, nothing for 32."""
    return k.if_(c["t_lane"]) if c["t_lane"] is not None else contextlib.nullcontext()


def unit_q4k(k: KernelBuilder, c: dict, sbase: Reg, xslot: Reg, acc: list, minacc, q5: bool = False) -> None:
    """One Q4_K super-block of the warp's rows (staged at ``sbase``).

    Block: d, dmin (f16), 12 bytes of 6-bit scales and mins, qs (128 bytes: byte 32 j + l holds value
    64 j + l of sub-block 2 j in its low nibble and value 64 j + 32 + l of sub-block 2 j + 1 in its
    high nibble). MMA 2 j + h (h = 0, 1) takes values 16 h .. 16 h + 15 of sub-block 2 j (low nibbles,
    class 0) as k 0..15 and the same values of sub-block 2 j + 1 (high nibbles, class 1) as k 16..31:
    both come from one staged word per lane and row, the high nibbles masked in place (16 times the
    code, as unsigned bytes) with no shift. B's columns 0..3 are the digits of class 0's x (zero at
    k >= 16), 4..7 those of class 1's (zero at k < 16), so lanes t = 0, 1 receive sub-block 2 j's sums
    and t = 2, 3 those of 2 j + 1; the two halves h chain through the accumulator and each lane weights
    its sums by one integer scale (class 1's 1 / 16 goes into its d).

    ``q5`` (Q5_K: 32 bytes of qh between the scales and qs): bit j of qh[l] is the fifth bit of value
    32 j + l, so the qh bytes l..l+3 of a row match its qs word of each pair j: one ``ldmatrix.x4`` of
    qh per tile serves all four pairs, its bits 2 j and 2 j + 1 moved to bit 4 of each byte; class 1's
    codes are shifted down (5-bit codes do not fit an unsigned byte as 16 times the code)."""
    U, TR = c["U"], c["TR"]
    qs0 = 48 if q5 else 16
    # the table: lane r unpacks row r's scales by class ([0, 2, 4, 6][1, 3, 5, 7] as int32), d / f for
    # class 0 and d / 16 f for class 1, and adds its min terms
    with lanes_with_rows(k, c):
        d_h, dmin_h, mins = q4k_table_row(k, c, sbase)
        inv_f = k.load("shared", "f32", xslot, INVF["Q4_K"])  # the unit's x digits are x f
        dq = k.mul(k.cvt(Reg(d_h.name, ql.F16_TYPE), "f32"), inv_f)
        k.store("shared", "f32", c["t_mine"], [dq, dq if q5 else k.mul(dq, 0.0625)], 32)
        sx = [v for o in (0, 16) for v in k.load("shared", "f32", xslot, XSUM["Q4_K"] + o, vec=4)]
        dmin = k.cvt(Reg(dmin_h.name, ql.F16_TYPE), "f32")
        msum = None
        for i in range(8):  # dmin m_j first: sum_j m_j sum(x) alone could overflow where the result does not
            mf = q4k_min(k, mins, i, dmin)
            msum = k.mul(mf, sx[i]) if msum is None else k.fma(mf, sx[i], msum)
        # one update of the loop-carried register a unit, not one a sub-block: each update lengthens the
        # dependency chain that runs through every unit of the row
        k.assign(minacc, k.add(minacc, msum))
    k.bar_warp_sync()
    bfr = []  # MMAs 2j, 2j+1: B words (b0, b1) of half 0, then of half 1; the zero half masked in
    for j in range(4):
        w0, w1 = k.load("shared", "u32", k.add(xslot, c["b_q4"]), 256 * j, vec=2)
        bfr.append([k.and_(w, m) for w in (w0, w1) for m in c["b_mask"]])
    for r in range(c["tiles"]):
        # lane (g, t)'s scales (class t / 2 of rows g and g + 8, one per j); |sums| <= 4 * 32 * 240 * 128 * 63
        scl = [k.load("shared", "u32", c["t_gc"], (16 * r + h) * TR, vec=4) for h in (0, 8)]
        ints = [None] * 4
        qh = k.ldmatrix_x4(k.add(sbase, c["ldm"]), 16 * r * U + 16) if q5 else None
        for j in range(4):
            regs = k.ldmatrix_x4(k.add(sbase, c["ldm"]), 16 * r * U + qs0 + 32 * j)
            if q5:
                lo = [or_bit4(k, k.and_(x, 0x0F0F0F0F), h, 2 * j) for x, h in zip(regs, qh)]
                hi = [or_bit4(k, k.and_(k.shr(x, 4), 0x0F0F0F0F), h, 2 * j + 1) for x, h in zip(regs, qh)]
            else:
                lo = [k.and_(x, 0x0F0F0F0F) for x in regs]
                hi = [k.and_(x, 0xF0F0F0F0) for x in regs]
            dd = k.mma_s8([lo[0], lo[1], hi[0], hi[1]], bfr[j][0:2], c["zeros"], a_unsigned=True)
            dd = k.mma_s8([lo[2], lo[3], hi[2], hi[3]], bfr[j][2:4], dd, a_unsigned=True)
            for n in range(4):
                sc = k.bitcast(scl[n // 2][j], "s32")
                ints[n] = k.mul(dd[n], sc) if ints[n] is None else k.mad(dd[n], sc, ints[n])
        dg = k.load("shared", "f32", c["t_gd"], 16 * r * TR)
        dg8 = k.load("shared", "f32", c["t_gd"], (16 * r + 8) * TR)
        for n, d in ((0, dg), (1, dg), (2, dg8), (3, dg8)):
            k.assign(acc[r][n], k.fma(d, k.cvt(ints[n], "f32"), acc[r][n]))


def q4k_table_row(k: KernelBuilder, c: dict, sbase: Reg) -> tuple[Reg, Reg, tuple[Reg, Reg]]:
    """Lane r's (< R) part of a Q4_K / Q5_K unit's table: row r's 8 sub-block scales unpacked by class
    ([0, 2, 4, 6][1, 3, 5, 7], int32) into the table; returns d and dmin (f16 halves) and the 6-bit
    mins packed a byte each (sub-blocks 0..3, 4..7) for :func:`q4k_min`."""
    dm, s0, s1, s2 = k.load("shared", "u32", k.add(sbase, c["row_stage"]), vec=4)
    sc_lo = k.and_(s0, 0x3F3F3F3F)
    sc_hi = k.or_(k.and_(s2, 0x0F0F0F0F), k.and_(k.shr(s0, 2), 0x30303030))
    mn_lo = k.and_(s1, 0x3F3F3F3F)
    mn_hi = k.or_(k.and_(k.shr(s2, 4), 0x0F0F0F0F), k.and_(k.shr(s1, 2), 0x30303030))
    for o, sel in ((0, 0x6420), (16, 0x7531)):
        cls = k.prmt(sc_lo, sc_hi, sel)
        k.store("shared", "u32", c["t_mine"], [k.prmt(cls, 0, 0x4440 | i) for i in range(4)], o)
    d_h, dmin_h = k.unpack_b32(dm)
    return d_h, dmin_h, (mn_lo, mn_hi)


def q4k_min(k: KernelBuilder, mins: tuple[Reg, Reg], i: int, dmin: Reg) -> Reg:
    """``dmin m_i`` of sub-block i from :func:`q4k_table_row`'s packed mins (the byte made the float
    2**23 + m by one ``prmt``, the 2**23 taken off exactly)."""
    mf = k.add(k.bitcast(k.prmt(mins[0] if i < 4 else mins[1], 0x4B000000, 0x7440 | (i % 4)), "f32"), -8388608.0)
    return k.mul(mf, dmin)


def or_bit4(k: KernelBuilder, codes: Reg, bits: Reg, b: int) -> Reg:
    """``codes`` (4-bit codes, one a byte) with bit ``b`` of each byte of ``bits`` as their bit 4."""
    moved = bits if b == 4 else k.shl(bits, 4 - b) if b < 4 else k.shr(bits, b - 4)
    return k.or_(codes, k.and_(moved, 0x10101010))


def _sext_byte(k: KernelBuilder, word: Reg, b: int) -> Reg:
    """Byte ``b`` of ``word`` sign-extended to 32 bits (one ``prmt`` in sign-replicate mode)."""
    s = 8 | b
    return k.prmt(word, 0, (s << 12) | (s << 8) | (s << 4) | b)


def unit_q6k(k: KernelBuilder, c: dict, sbase: Reg, xslot: Reg, acc: list, p: Reg | None) -> None:
    """One Q6_K block of the warp's rows, staged at ``sbase`` + 240 r + ``p`` (row r; p = 0, 2, .., 14),
    or with ``p`` None (tile-major weights, :data:`Q6K_HALF`) at ``sbase`` + 3360 (r / 16) + 208 (r % 16),
    its d at ``sbase`` + 3360 (r / 16) + 3328 + 2 (r % 16).

    Block: ql (128 bytes: value 128 n + 32 i + l has the low nibble (i < 2) or high nibble (i >= 2) of
    ql[64 n + 32 (i % 2) + l]), qh (64: its bits 2i, 2i + 1 of qh[32 n + l]), 16 int8 scales (one per
    16 values: sub-block 8 n + 2 i + l / 16), d. The codes c = low | high << 4 (0..63) stand for c - 32.

    MMA m = 4 n + 2 i0 + lh (i0, lh in {0, 1}) takes sub-block a = (n, i0, lh) as k 0..15 and
    b = (n, i0 + 2, lh) as k 16..31: both come from the same ql word (low / high nibbles) and qh word
    of each lane (byte 16 m + 4 t of ql, 128 + 16 (2 n + lh) + 4 t, for row g). B's columns 0..3 are the
    four digits of sub-block a's x (zero at k >= 16), columns 4..7 those of b's (zero at k < 16): the
    lanes t = 0, 1 receive sub-block a's sums, t = 2, 3 b's, each weighted by its own integer scale.
    Codes go in unsigned (``.u8.s8``); the offset of 32 goes in as the accumulator: an MMA of A = -32
    in every byte with the same B gives -32 times the sums of the digits over each sub-block (the same
    for every row), exactly, so the result is sum (c - 32) X in integers (a float offset term lost
    accuracy where codes sit near 32, i.e. small weights, and its own instructions cost more). Staged
    words are 2 bytes off for odd p / 2: two loads and a funnel shift each."""
    TR = c["TR"]
    row_w, a_w, realign = q6k_lane(k, c, p)
    with lanes_with_rows(k, c):  # lane r: row r's scales (table [class 0: m 0..7][class 1: m 0..7]) and d / f
        d = q6k_table_row(k, c, sbase, row_w, p, realign)
        inv_f = k.load("shared", "f32", xslot, INVF["Q6_K"])  # the unit's x digits are x f
        k.store("shared", "f32", c["t_mine"], k.mul(d, inv_f), 64)
    k.bar_warp_sync()
    bfr = [k.load("shared", "u32", k.add(xslot, c["b_q6"]), 512 * mp, vec=4) for mp in range(4)]
    # -32 times the sums of B over k, per column: the same for every row, so once for the warp's tiles
    offs = [k.mma_s8(c["minus32"], bfr[m >> 1][2 * (m & 1):2 * (m & 1) + 2], c["zeros"]) for m in range(8)]
    a0 = k.add(sbase, a_w)
    for r in range(c["tiles"]):
        words, scales, qab = q6k_rows(k, c, a0, r, p, realign)
        ints = [None] * 4
        for m in range(8):
            a_lo, a_hi = q6k_codes(k, words, qab, m)
            b = bfr[m >> 1][2 * (m & 1):2 * (m & 1) + 2]
            dd = k.mma_s8([a_lo[0], a_lo[1], a_hi[0], a_hi[1]], b, offs[m], a_unsigned=True)
            for nn in range(4):
                sc = k.bitcast(scales[nn // 2][m], "s32")
                ints[nn] = k.mul(dd[nn], sc) if ints[nn] is None else k.mad(dd[nn], sc, ints[nn])
        dg = k.load("shared", "f32", c["t_g"], 16 * r * TR + 64)
        dg8 = k.load("shared", "f32", c["t_g"], (16 * r + 8) * TR + 64)
        for nn, dv in ((0, dg), (1, dg), (2, dg8), (3, dg8)):
            k.assign(acc[r][nn], k.fma(dv, k.cvt(ints[nn], "f32"), acc[r][nn]))


def q6k_lane(k: KernelBuilder, c: dict, p: Reg | None):
    """A Q6_K unit's lane offsets (its table row, its A words) and ``realign(lo, hi)``: the word 2 bytes
    into ``lo:hi`` where the block starts 2 bytes off a word (GGUF rows, ``p`` / 2 odd), else ``lo``."""
    if p is None:  # word-aligned rows
        row_w, a_w = c["row_stage"], c["a_lane"]
    else:
        sh = k.shl(k.and_(p, 2), 3)  # 0 or 16 bits
        pw = k.and_(p, 12)  # the block's first word, p rounded down to 4
        row_w, a_w = k.add(c["row_stage"], pw), k.add(c["a_lane"], pw)

    def realign(lo: Reg, hi: Reg) -> Reg:
        return lo if p is None else k.shf("r", lo, hi, sh)
    return row_w, a_w, realign


def q6k_table_row(k: KernelBuilder, c: dict, sbase: Reg, row_w: Reg, p: Reg | None, realign) -> Reg:
    """Lane r's (< R) part of a Q6_K unit's table: row r's 16 int8 scales sign-extended into the table
    ([class 0: m 0..7][class 1: m 0..7]); returns its d as f32."""
    row = k.add(sbase, row_w)
    if p is None:  # (tile-major: the scales one 16-byte vector; d after the 16 rows of the half, Q6K_HALF:
        # Q6K_D - 206 (r % 16) bytes past the row, r % 16 recomputed here rather than held in a register)
        sw = list(k.load("shared", "u32", row, 192, vec=4))
        r16 = k.and_(k.tid(), 15)
        d = ql.lds_f16(k, k.sub(k.add(row, Q6K_D), k.mul(r16, Q6K_ROW - 2)), 0)
    else:
        ws = [k.load("shared", "u32", row, 192 + 4 * i) for i in range(5)]
        sw = [realign(ws[i], ws[i + 1]) for i in range(4)]  # scales 4i..4i+3
        d = k.cvt(Reg(k.unpack_b32(realign(ws[4], ws[4]))[0].name, ql.F16_TYPE), "f32")
    scs = [[_sext_byte(k, w_, b) for b in range(4)] for w_ in sw]
    for o, i in ((0, 0), (16, 2), (32, 1), (48, 3)):  # class 0: scales 0..3, 8..11; class 1: 4..7, 12..15
        k.store("shared", "u32", c["t_mine"], scs[i], o)
    return d


def q6k_rows(k: KernelBuilder, c: dict, a0: Reg, r: int, p: Reg | None, realign):
    """Lane (g, t)'s staged words of rows 16 r + g and 16 r + 8 + g (12 each: 8 of ql, 4 of qh), its
    scales of both rows from the table, and the qh words masked into their bit pairs 0 and 2 (qa) and
    1 and 3 (qb), for :func:`q6k_codes`."""
    S, TR = c["U"], c["TR"]
    words, scales = [], []
    for h in (0, 8):  # rows 16 r + g, 16 r + 8 + g
        ro = r * c["tile_step"] + h * S

        def word(mi: int) -> Reg:
            lo = k.load("shared", "u32", a0, ro + 16 * mi)
            return lo if p is None else realign(lo, k.load("shared", "u32", a0, ro + 16 * mi + 4))
        words.append([word(mi) for mi in range(12)])
        scales.append([v for o in (0, 16) for v in k.load("shared", "u32", c["t_gc"], (16 * r + h) * TR + o, vec=4)])
    qab = [[(k.and_(wd[8 + i], 0x33333333), k.and_(wd[8 + i], 0xCCCCCCCC)) for i in range(4)] for wd in words]
    return words, scales, qab


def q6k_codes(k: KernelBuilder, words: list, qab: list, m: int) -> tuple[list, list]:
    """MMA m's A fragments (codes as unsigned bytes) of both rows: bits 0..3 from ql, 4..5 from qh, as
    one bitwise select (LOP3) each; the shifts of the masked qh bit pairs leave bits 6, 7 zero."""
    def code(low: Reg, high: Reg) -> Reg:
        return k.or_(k.and_(low, 0x0F0F0F0F), k.and_(high, 0xF0F0F0F0))
    n, i0, lh = m >> 2, (m >> 1) & 1, m & 1
    a_lo, a_hi = [], []
    for wd, qh in zip(words, qab):
        qlw, (qa, qb) = wd[m], qh[2 * n + lh]
        a_lo.append(code(qlw, k.shl(qb, 2) if i0 else k.shl(qa, 4)))
        a_hi.append(code(k.shr(qlw, 4), k.shr(qb, 2) if i0 else qa))
    return a_lo, a_hi


def exact_float(k: KernelBuilder, i: Reg) -> Reg:
    """float(i) for |i| < 2**22 with two ALU instructions (no conversion unit): the float whose
    mantissa is i + 2**22, minus 1.5 * 2**23."""
    return k.add(k.bitcast(k.add(k.bitcast(i, "u32"), 0x4B400000), "f32"), -12582912.0)


def unit_q8_0(k: KernelBuilder, c: dict, sbase: Reg, xslot: Reg, acc: list) -> None:
    """Eight Q8_0 blocks (34 bytes each) of the warp's rows (staged at ``sbase``)."""
    U = c["U"]
    # the blocks' scales d / f as floats: lane r converts row r's 8
    with lanes_with_rows(k, c):
        inv_f = k.load("shared", "f32", xslot, INVF["Q8_0"])  # the unit's x digits are x f
        row = k.add(sbase, c["row_stage"])
        ds = [k.mul(ql.lds_f16(k, row, 34 * i), inv_f) for i in range(8)]
        k.store("shared", "f32", c["t_mine"], ds[:4])
        k.store("shared", "f32", c["t_mine"], ds[4:], 16)
    k.bar_warp_sync()
    rg_t = k.add(k.add(sbase, k.mul(c["g"], U)), c["t4"])
    bj = k.add(xslot, c["b_lane"])
    b = None
    for blk in range(8):
        if blk % 2 == 0:
            b = k.load("shared", "u32", bj, 32 * blk, vec=4, pred=c["b_ok"], other=0)
        q = 34 * blk + 2  # the codes; 4-byte aligned for odd blocks, 2 for even ones
        for r in range(c["tiles"]):
            words = q8_0_words(k, rg_t, 16 * r * U + q, U)
            d = k.mma_s8(words, b[0:2] if blk % 2 == 0 else b[2:4], c["zeros"])
            sg = k.load("shared", "f32", c["t_g"], 16 * r * c["TR"] + 4 * blk)
            sg8 = k.load("shared", "f32", c["t_g"], (16 * r + 8) * c["TR"] + 4 * blk)
            for n, s in ((0, sg), (1, sg), (2, sg8), (3, sg8)):  # |d| <= 32 * 128 * 128 < 2**22
                k.assign(acc[r][n], k.fma(s, exact_float(k, d[n]), acc[r][n]))


def q8_0_words(k: KernelBuilder, rg_t: Reg, off0: int, U: int) -> list[Reg]:
    """Lane (g, t)'s A words of a Q8_0 block whose codes start ``off0`` bytes into row g's stage
    (``rg_t``: row g, byte 4 t): codes 4 t.. and 16 + 4 t.. of rows g and g + 8, in A's order; a word
    2 bytes off is two aligned loads and a ``prmt``."""
    words = []
    for roff, half in ((0, 0), (8 * U, 0), (0, 16), (8 * U, 16)):
        off = off0 + roff + half
        if off % 4 == 0:
            words.append(k.load("shared", "u32", rg_t, off))
        else:
            w0 = k.load("shared", "u32", rg_t, off - 2)
            w1 = k.load("shared", "u32", rg_t, off + 2)
            words.append(k.prmt(w0, w1, 0x5432))
    return words


def _word(k: KernelBuilder, base: Reg, off: int) -> Reg:
    """The 32-bit word at ``base`` + ``off`` in shared memory (``off`` even: two aligned loads and a
    ``prmt`` where it is 2 mod 4)."""
    if off % 4 == 0:
        return k.load("shared", "u32", base, off)
    return k.prmt(k.load("shared", "u32", base, off - 2), k.load("shared", "u32", base, off + 2), 0x5432)


def _spread_bit4(k: KernelBuilder, qh: Reg, shift: Reg) -> Reg:
    """Bits ``shift`` .. ``shift`` + 3 of ``qh`` as bit 4 of the bytes 0..3 of a word (one multiply: the
    nibble's four copies 7 bits apart land each bit in its byte, none overlapping)."""
    return k.and_(k.mul(k.and_(k.shr(qh, shift), 0xF), 0x02040810), 0x10101010)


def unit_b32(k: KernelBuilder, wtype: str, c: dict, sbase: Reg, xslot: Reg, acc: list, minacc) -> None:
    """Eight blocks of 32 values (Q4_0, Q4_1, Q5_0, Q5_1; GGUF's bytes, :data:`BLOCK32`) of the warp's
    rows, staged at ``sbase``.

    Two blocks per pair of MMAs, as Q4_K's two sub-blocks: MMA h (h = 0, 1) of pair p takes values
    16 h .. 16 h + 15 of block 2 p as k 0..15 and the same values of block 2 p + 1 as k 16..31, against
    the digits of block 2 p's x in B's columns 0..3 (zero at k >= 16) and of block 2 p + 1's in columns
    4..7 (zero at k < 16) (x laid out as Q4_K's). Lane (g, t)'s A words are the low (h = 0: values
    4t..) or high (h = 1: values 16 + 4t..) nibbles of qs word t of both blocks, rows g and g + 8, as
    unsigned bytes; the fifth bits (Q5_0, Q5_1) are bits 16 h + 4t.. of the block's qh, moved to bit 4
    of each byte. Both MMAs of a pair accumulate into one result: the lanes t = 0, 1 then hold block
    2 p's digit sums, t = 2, 3 block 2 p + 1's, so each lane weights its results by one block scale
    (half the float work of an MMA a block, whose lanes t = 2, 3 held zero columns). A lane's two
    columns (digits 2 t' and 2 t' + 1, t' = t % 2) of a row are first merged into one integer,
    ``lo + 256 hi`` (< 2**26), rounded once to float32, so one conversion and one FMA a row
    (``acc[r]``: rows g, g + 8, see :func:`_row_sums`). Q4_0 / Q5_0's
    offset (codes stand for q - 8 / q - 16) enters exactly as the accumulator input: the MMAs of -8
    (-16) in every byte of A with the same B, once per pair for the warp (as Q6_K's). Q4_1 / Q5_1's
    min adds ``m sum(x over the block)`` per row, from the sums of x per block kept in the x slot, by
    the lane of the row (subtracted from its negative in :func:`_row_sums`, as Q4_K's).

    Tile-major weights (``c["tiled"]``) are re-encoded (:data:`TILED_B32`): the scales load as whole
    vectors, every code word is aligned, and the fifth bits, in lane order, reach bit 4 of their bytes
    with one shift and one mask, read by the lanes from the staged unit itself; Q4_1's and Q5_1's rows
    have their 16-byte chunks permuted (``SWIZZLE``), each lane's loads addressed through its rows' key
    (:func:`b32_rows`)."""
    f = BLOCK32[wtype]
    TR = c["TR"]
    # the table: lane r converts row r's 8 block scales d / f (even blocks, then odd ones), gathers its
    # qh words (GGUF rows) and adds its mins
    with lanes_with_rows(k, c):
        inv_f = k.load("shared", "f32", xslot, INVF[wtype])  # the unit's x digits are x f
        ds, m16 = b32_table_row(k, wtype, c, sbase, inv_f)
        if f["m"] is not None:
            sx = [v for o in (0, 16) for v in k.load("shared", "f32", xslot, XSUM[wtype] + o, vec=4)]
            msum = None
            for i in range(8):
                mi = k.cvt(Reg(m16[i].name, ql.F16_TYPE), "f32")
                msum = k.mul(mi, sx[i]) if msum is None else k.fma(mi, sx[i], msum)
            k.assign(minacc, k.sub(minacc, msum))
    k.bar_warp_sync()
    a_words = b32_rows(k, wtype, c, sbase)
    # lane (g, t)'s block scales: class t / 2 of rows g and g + 8, one per pair
    scl = []
    for p in range(4):
        if p % 2 == 0:  # (two pairs' scales at a time: fewer live registers)
            scl = [k.load("shared", "f32", c["t_gc"], (16 * r + h) * TR + 4 * p, vec=2) for r in range(c["tiles"])
                   for h in (0, 8)]
        w0, w1 = k.load("shared", "u32", k.add(xslot, c["b_q4"]), 256 * p, vec=2)
        bfr = [k.and_(w, m) for w in (w0, w1) for m in c["b_mask"]]  # MMA 0's (b0, b1), then MMA 1's
        cin = c["zeros"]
        if f["zero"]:  # -zero times the blocks' sums of x digits, per column
            cin = k.mma_s8([c["minus_zero"]] * 4, bfr[0:2], cin)
            cin = k.mma_s8([c["minus_zero"]] * 4, bfr[2:4], cin)
        for r in range(c["tiles"]):
            lo, hi = a_words(r, p)
            d = k.mma_s8(lo, bfr[0:2], cin, a_unsigned=True)
            d = k.mma_s8(hi, bfr[2:4], d, a_unsigned=True)
            for h in range(2):  # rows g, g + 8: |d| <= 2 * 16 * 31 * 128 + 16 * 32 * 128 < 2**17
                v = k.mad(k.bitcast(d[2 * h + 1], "s32"), 256, k.bitcast(d[2 * h], "s32"))
                k.assign(acc[r][h], k.fma(scl[2 * r + h][p % 2], k.cvt(v, "f32"), acc[r][h]))


def b32_table_row(k: KernelBuilder, wtype: str, c: dict, sbase: Reg, inv_f: Reg | None) -> tuple[list, list | None]:
    """Lane r's (< R) part of a 32-value block type's per-unit table (:func:`unit_b32`): row r's 8 block
    scales d (times ``inv_f`` unless None) stored as f32, even blocks then odd ones, and (GGUF rows, Q5_0 /
    Q5_1) its 8 qh words after them; returns the scales and (Q4_1 / Q5_1) the 8 mins as f16 registers."""
    f = BLOCK32[wtype]
    bs = f["bs"]
    tiled = TILED_B32[wtype] if c["tiled"] else None
    row = k.add(sbase, c["row_stage"])
    d16 = m16 = None  # the 8 blocks' d (and m) as f16 registers, where loaded as words
    if tiled is not None:  # d (and m) of the 8 blocks side by side
        if "row_sw" in c:  # (chunks permuted: the row's chunk j at lane offset row_sw[j])
            loads = [(k.add(sbase, c["row_sw"][o // 16]), 0) for o in range(0, 8 * tiled["sc"], 16)]
        else:
            loads = [(row, o) for o in range(0, 8 * tiled["sc"], 16)]
        words = [w for a, o in loads for w in k.load("shared", "u32", a, o, vec=4)]
        halves = [h for w in words for h in k.unpack_b32(w)]
        d16, m16 = (halves[0::2], halves[1::2]) if f["m"] is not None else (halves, None)
    elif f["m"] is not None:  # (Q4_1, Q5_1: d and m are the block's first word)
        d16, m16 = zip(*(k.unpack_b32(k.load("shared", "u32", row, bs * i)) for i in range(8)))
    if d16 is not None:
        ds = [k.cvt(Reg(d_.name, ql.F16_TYPE), "f32") for d_ in d16] if inv_f is None else \
            [k.mul(k.cvt(Reg(d_.name, ql.F16_TYPE), "f32"), inv_f) for d_ in d16]
    else:
        ds = [ql.lds_f16(k, row, bs * i) if inv_f is None else k.mul(ql.lds_f16(k, row, bs * i), inv_f) for i in range(8)]
    k.store("shared", "f32", c["t_mine"], ds[0::2])
    k.store("shared", "f32", c["t_mine"], ds[1::2], 16)
    if f["qh"] is not None and tiled is None:
        qhs = [_word(k, row, bs * i + f["qh"]) for i in range(8)]
        k.store("shared", "u32", c["t_mine"], qhs[:4], 32)
        k.store("shared", "u32", c["t_mine"], qhs[4:], 48)
    return ds, m16


def b32_rows(k: KernelBuilder, wtype: str, c: dict, sbase: Reg):
    """Lane (g, t)'s A words of a 32-value block type's unit staged at ``sbase`` (:func:`unit_b32`):
    returns ``a_words(r, p)``, the (lo, hi) A fragments of pair p (blocks 2 p, 2 p + 1) of rows
    16 r + g, 16 r + 8 + g: qs word t of both blocks as unsigned bytes, low and high nibbles, with
    their fifth bits (Q5_0, Q5_1) at bit 4. Tile-major units: the four qs words are one
    ``ldmatrix.x4`` (matrix 2 cc + h: block 2 p + cc of rows 8 h + 0..7, one 16-byte row a lane, at the
    addresses of :func:`b32_ldmatrix_lanes`); the fifth bits load from the lane's row g, where with
    permuted chunks (``SWIZZLE``) a row's logical byte B sits at ``B - 16 j + 16 (j ^ key)``,
    j = (B / 16) & mask (rows g + 8 n share the key). GGUF rows: four word loads of the blocks as they
    lie (2-byte aligned)."""
    f = BLOCK32[wtype]
    U, TR, bs = c["U"], c["TR"], f["bs"]
    tiled = TILED_B32[wtype] if c["tiled"] else None
    if tiled is not None:
        ldm = [k.add(sbase, o) for o in c["ldm_b32"]]  # (per class of p, see b32_ldmatrix_lanes)
    if "h_sw" in c:
        mask = SWIZZLE[wtype][1]
        h_bases = {}

        def at(B: int) -> tuple[Reg, int]:  # (the fifth bits of row g)
            j = (B >> 4) & mask
            if j not in h_bases:
                h_bases[j] = k.add(sbase, c["h_sw"][j])
            return h_bases[j], B - 16 * j
    else:
        rg = k.add(sbase, c["gU"])
        rg_t = k.add(rg, c["t4"]) if tiled is None else None

        def at(B: int) -> tuple[Reg, int]:
            return rg, B

    def a_words(r: int, p: int) -> tuple[list, list]:
        # qs word t of blocks 2p, 2p + 1 of rows 16 r + g, 16 r + 8 + g: [row g: b0, b1, row g + 8: b0, b1]
        if tiled is not None:  # (matrices in A's order: rows g, g + 8 of block 2p, then of 2p + 1)
            b = p % len(ldm)
            words = list(k.ldmatrix_x4(ldm[b], 16 * r * U + 32 * (p - b)))
        else:
            ws = [_word(k, rg_t, 16 * r * U + roff + bs * (2 * p + cc) + f["qs"]) for roff in (0, 8 * U)
                  for cc in (0, 1)]
            words = [ws[0], ws[2], ws[1], ws[3]]  # A's order: rows g, g + 8 of block 2p, then of 2p + 1
        lo = [k.and_(w, 0x0F0F0F0F) for w in words]
        hi = [k.and_(k.shr(w, 4), 0x0F0F0F0F) for w in words]
        if tiled is not None and tiled["qh"] is not None:  # lane order: values 4t.. at bit t of each
            # byte, values 16 + 4t.. at bit 4 + t (see lane_order_qh)
            base, off = at(tiled["qh"] + 8 * p)
            q0, q8 = (k.load("shared", "u32", base, 16 * r * U + roff + off, vec=2) for roff in (0, 8 * U))
            hq = [q0[0], q8[0], q0[1], q8[1]]
            lo = [k.or_(v, k.and_(k.shl(h, c["t_up"]), 0x10101010)) for v, h in zip(lo, hq)]
            hi = [k.or_(v, k.and_(k.shr(h, c["t"]), 0x10101010)) for v, h in zip(hi, hq)]
        elif f["qh"] is not None:  # the blocks' qh words, in A's order
            q0 = k.load("shared", "u32", c["t_g"], 16 * r * TR + 32 + 8 * p, vec=2)
            q8 = k.load("shared", "u32", c["t_g"], (16 * r + 8) * TR + 32 + 8 * p, vec=2)
            hq = [q0[0], q8[0], q0[1], q8[1]]
            lo = [k.or_(v, _spread_bit4(k, h, c["t4"])) for v, h in zip(lo, hq)]
            hi = [k.or_(v, _spread_bit4(k, h, c["t4_16"])) for v, h in zip(hi, hq)]
        return lo, hi
    return a_words


def b32_ldmatrix_lanes(k: KernelBuilder, wtype: str, lane: Reg, U: int) -> list[Reg]:
    """Lane l's row offsets in a staged tile-major unit for :func:`b32_rows`'s ``ldmatrix.x4``: row
    ``8 h + l % 8`` (h = (l / 8) % 2) of matrix ``2 cc + h`` (cc = l / 16), i.e. the 16 qs bytes of
    block 2 p + cc of that row, at offset ``L[b] + 32 (p - b)``, b = p % len(L). With permuted chunks
    the block's chunk C = qs / 16 + cc + 2 p sits at ``C ^ key`` of the row, which moves by 2 p - 2 b
    with p (key < 2, or < 4 with two classes b of p); so one offset a class."""
    tb = TILED_B32[wtype]
    mask = SWIZZLE[wtype][1] if wtype in SWIZZLE else 0
    rr = k.and_(lane, 7)
    row = k.add(rr, k.and_(lane, 8))
    cc = k.shr(lane, 4)
    key = k.shr(ql.swizzle_key16(k, wtype, rr), 4) if mask else None
    out = []
    for b in range(max(1, (mask + 1) // 2)):
        chunk = k.add(cc, tb["qs"] // 16 + 2 * b)
        if key is not None:
            chunk = k.xor(chunk, key)
        out.append(k.mad(row, U, k.shl(chunk, 4)))
    return out
