"""The per-type unit bodies of the int8 batch GEMM (:mod:`ptx_gen.kernels.gemm.gemm_x8`): for one unit of 256
values staged in shared memory, a warp's A fragments (weight codes of its two 16-row tiles), the MMAs against
each token tile's B fragments (x codes) and the scale work. Two families:

* **K-quants** (Q4_K, Q5_K, Q6_K): integer sub-block scales. Each MMA's int32 sum is weighted by its
  sub-block's scale in int32 (``mad``) across the unit; Q4_K / Q5_K's mins term ``sum_j m_j S_j`` is two
  MMAs (the mins as A, the records' base-256 digits of x's code sums S as B); once a unit
  ``acc += dx (d main - dmin mins)``. Q6_K's 16-value sub-blocks: two MMAs a 32-value group, each with
  half of A zero, its codes made signed (``q - 32``) in place.
* **32-value blocks** (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): f16 block scales. Each block's int32 sum becomes f32
  exactly (below 2**22: the bits of ``sum + 1.5 2**23``) and is weighted by the row's block scale d_j in a
  per-unit f32 sum (Q4_1 / Q5_1 add ``m_j S_j``); Q4_0 / Q5_0's codes are made signed in place
  (``q - 8``, ``q - 16``); the unit's sum is scaled by dx once.

Fragments (lane g = lane / 4, t = lane % 4): A = bytes 4t.. and 16+4t.. of a 32-value group in rows g, g+8,
B = the same k of token g, so a group's 32 values are the MMA's k in their stored order; ldmatrix loads them
where a group's codes are 16-byte aligned (all but Q8_0's GGUF blocks).
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.gemm.x8 import RECORD, RECORD_D
from ptx_gen.kernels.gemv.gemv_mma_layout import Q6K_D, Q6K_HALF, Q6K_ROW, SWIZZLE, TILED_B32, UNIT_BYTES
from ptx_gen.kernels.gemv.quant_layout import F16_TYPE

XROW = 256 + 16  # shared bytes between two tokens' codes
MAGIC = 0x4B400000  # 1.5 * 2**23: an int32 |v| < 2**22 added to these bits is the float 1.5 * 2**23 + v
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
B32_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
UNIT_TYPES = K_TYPES + B32_TYPES


def _f16_pair(k: KernelBuilder, word: Reg) -> tuple[Reg, Reg]:
    lo, hi = k.unpack_b32(word)
    return k.cvt(Reg(lo.name, F16_TYPE), "f32"), k.cvt(Reg(hi.name, F16_TYPE), "f32")


def _byte(k: KernelBuilder, word: Reg, i: int, signed: bool = False) -> Reg:
    """Byte ``i`` of ``word``, zero- or sign-extended (one prmt)."""
    sel = i | (((8 | i) * 0x111) << 4) if signed else 0x4440 + i
    return k.bitcast(k.prmt(word, 0, sel), "s32")


def _signed(k: KernelBuilder, w: Reg, offset: int) -> Reg:
    """Four unsigned byte codes made ``code - offset`` as signed bytes, in place (no carry between bytes: the
    codes are below ``0x80 + offset``)."""
    return k.xor(k.add(w, (0x80 - offset) * 0x01010101, "u32"), 0x80808080)


class Ctx:
    """What a unit body reads: the warp's staged tile (``wb``), its x codes and records, its accumulators."""

    def __init__(self, k: KernelBuilder, wtype: str, lane: Reg, tn: int, acc: list):
        self.k, self.wtype, self.tn, self.acc = k, wtype, tn, acc
        self.t, self.g = k.and_(lane, 3), k.shr(lane, 2)
        self.mi, self.mr = k.shr(lane, 3), k.and_(lane, 7)
        self.rows = [[self.g, k.add(self.g, 8)], [k.add(self.g, 16), k.add(self.g, 24)]]  # per row tile
        self.zero = k.mov(0, "u32")

    def b_pair(self, xb: Reg, nt: int, p: int) -> tuple[tuple[Reg, Reg], tuple[Reg, Reg]]:
        """Token tile ``nt``'s B fragments for the groups ``2p`` and ``2p + 1`` (one ldmatrix.x4; ``xb``: this
        lane's row address, token ``mr``, bytes ``16 mi``)."""
        b = self.k.ldmatrix_x4(xb, nt * 8 * XROW + 64 * p)
        return (b[0], b[1]), (b[2], b[3])

    def dx(self, rb: Reg, nt: int) -> list[Reg]:
        """The unit's x scale of the lane's two tokens of token tile ``nt`` (elements e & 1)."""
        k = self.k
        base = k.add(rb, k.mul(k.add(k.shl(self.t, 1), 8 * nt), RECORD))
        return [k.load("shared", "f32", base, RECORD_D + RECORD * i) for i in range(2)]

    def sum_f32(self, rb: Reg, nt: int, j: int) -> list[Reg]:
        """The lane's two tokens' code sums S_j of 32-value group ``j`` (f32, exact) from the records' digits."""
        k = self.k
        out = []
        for i in range(2):
            rec = k.add(rb, k.mul(k.add(k.shl(self.t, 1), 8 * nt + i), RECORD))
            lo, hi = k.load("shared", "s8", rec, j), k.load("shared", "s8", rec, 8 + j)
            out.append(k.cvt(k.mad(k.cvt(hi, "s32"), 256, k.cvt(lo, "s32")), "f32"))
        return out


def kquant_unit(c: Ctx, wb: Reg, xb: Reg, rb: Reg) -> None:
    """One unit of Q4_K / Q5_K / Q6_K (see the module docstring)."""
    k, wt, tn = c.k, c.wtype, c.tn
    ub = UNIT_BYTES[wt]
    q6 = wt == "Q6_K"
    rstride = Q6K_ROW if q6 else ub
    rt_base = [rt * (Q6K_HALF if q6 else 16 * ub) for rt in range(2)]
    # this lane's ldmatrix row (8 (mi % 2) + mr of a row tile) and 16-byte half of a 32-byte window
    a_lane = k.add(wb, k.mad(k.add(k.shl(k.and_(c.mi, 1), 3), c.mr), rstride, k.shl(k.shr(c.mi, 1), 4)))
    imain = [[[k.var("s32", 0) for _ in range(4)] for _ in range(tn)] for _ in range(2)]
    dm, scal, mins = [], [], []  # per row tile, per row (g, g + 8)
    for rt in range(2):
        d_r, s_r, m_r = [], [], []
        for r in c.rows[rt]:
            if q6:  # int8 scales at 192.., d in the half's tail
                rl = k.and_(r, 15)
                row = k.add(wb, k.mad(rl, Q6K_ROW, rt_base[rt]))
                s_r.append(k.load("shared", "u32", row, 192, vec=4))
                d_r.append((k.cvt(Reg(k.load("shared", "b16", k.add(wb, k.mad(rl, 2, rt_base[rt] + Q6K_D))).name,
                                      F16_TYPE), "f32"), None))
                continue
            w_dm, s0, s1, s2 = k.load("shared", "u32", k.add(wb, k.mul(r, ub)), vec=4)
            d, dmin = _f16_pair(k, w_dm)
            d_r.append((d, k.neg(dmin)))
            hi6 = lambda w: k.and_(k.shr(w, 2), 0x30303030)  # noqa: E731  (bits 6-7 of each byte at 4-5)
            s_r.append([k.and_(s0, 0x3F3F3F3F), k.or_(k.and_(s2, 0x0F0F0F0F), hi6(s0))])
            m_r.append([k.and_(s1, 0x3F3F3F3F), k.or_(k.and_(k.shr(s2, 4), 0x0F0F0F0F), hi6(s1))])
        dm.append(d_r)
        scal.append(s_r)
        mins.append(m_r)

    def weigh(a: list, b: tuple, sc: list, e_rows=(0, 1)) -> None:
        cs = [[k.mma_s8(a[rt], b[nt], [0, 0, 0, 0], a_unsigned=not q6) for rt in range(2)] for nt in range(tn)]
        for nt in range(tn):
            for rt in range(2):
                for e in range(4):
                    k.assign(imain[rt][nt][e], k.mad(cs[nt][rt][e], sc[rt][e >> 1], imain[rt][nt][e]))

    if not q6:
        qs0 = 16 if wt == "Q4_K" else 48
        for p in range(4):
            words = [k.ldmatrix_x4(a_lane, rt_base[rt] + qs0 + 32 * p) for rt in range(2)]
            # (Q5_K's fifth bits, 32 bytes a row for all sub-blocks, loaded again per pair: fewer live registers)
            qh = [k.ldmatrix_x4(a_lane, rt_base[rt] + 16) for rt in range(2)] if wt == "Q5_K" else None
            bs = [c.b_pair(xb, nt, p) for nt in range(tn)]
            for jj in range(2):
                j = 2 * p + jj
                a = []
                for rt in range(2):
                    regs = [k.and_(w, 0x0F0F0F0F) if jj == 0 else k.and_(k.shr(w, 4), 0x0F0F0F0F) for w in words[rt]]
                    if qh is not None:  # bit j of each qh byte to bit 4
                        five = [k.and_(k.shl(h, 4 - j) if j <= 4 else k.shr(h, j - 4), 0x10101010) for h in qh[rt]]
                        regs = [k.or_(x, f) for x, f in zip(regs, five)]
                    a.append(regs)
                sc = [[_byte(k, scal[rt][i][j >> 2], j & 3) for i in range(2)] for rt in range(2)]
                weigh(a, [bs[nt][jj] for nt in range(tn)], sc)
    else:
        for vh in range(2):
            qh = [k.ldmatrix_x4(a_lane, rt_base[rt] + 128 + 32 * vh) for rt in range(2)]
            bsv = [[c.b_pair(xb, nt, 2 * vh + i) for nt in range(tn)] for i in range(2)]
            for half in range(2):  # groups half, half + 2 share ql bytes 64 vh + 32 half ..
                ql = [k.ldmatrix_x4(a_lane, rt_base[rt] + 64 * vh + 32 * half) for rt in range(2)]
                for g in (half, half + 2):  # x groups 4 vh + g: pair 2 vh + g // 2, member g % 2
                    bs = bsv[g >> 1]
                    a = []
                    for rt in range(2):
                        lo = [k.and_(w, 0x0F0F0F0F) if g < 2 else k.and_(k.shr(w, 4), 0x0F0F0F0F) for w in ql[rt]]
                        hb = [k.and_(k.shl(h, 4 - 2 * g) if 2 * g <= 4 else k.shr(h, 2 * g - 4), 0x30303030)
                              for h in qh[rt]]
                        a.append([_signed(k, k.or_(x, h), 32) for x, h in zip(lo, hb)])
                    for hi in range(2):  # the group's two 16-value sub-blocks: k 0..15, then 16..31
                        s = 8 * vh + 2 * g + hi
                        sc = [[_byte(k, scal[rt][i][s >> 2], s & 3, True) for i in range(2)] for rt in range(2)]
                        ah = [[c.zero, c.zero, a[rt][2], a[rt][3]] if hi else [a[rt][0], a[rt][1], c.zero, c.zero]
                              for rt in range(2)]
                        weigh(ah, [bs[nt][g & 1] for nt in range(tn)], sc)

    am = None
    if not q6:  # the mins as A: k 0..7 the rows' 8 mins (lanes t = 0, 1), zeros elsewhere
        is_t0, is_t1 = k.setp("eq", c.t, 0), k.setp("eq", c.t, 1)
        am = [[*(k.selp(mins[rt][i][0], k.selp(mins[rt][i][1], 0, is_t1, "u32"), is_t0, "u32") for i in range(2)),
               c.zero, c.zero] for rt in range(2)]
        lo_t = k.setp("lt", c.t, 2)
    for nt in range(tn):
        dx = c.dx(rb, nt)
        if am is not None:
            rec = k.add(rb, k.mad(k.add(c.g, 8 * nt), RECORD, k.shl(c.t, 2)))
            b_lo = k.load("shared", "u32", rec, 0, pred=lo_t, other=0)
            b_hi = k.load("shared", "u32", rec, 8, pred=lo_t, other=0)
        for rt in range(2):
            if am is not None:
                clo = k.mma_s8(am[rt], [b_lo, c.zero], [0, 0, 0, 0])
                chi = k.mma_s8(am[rt], [b_hi, c.zero], [0, 0, 0, 0])
            for e in range(4):
                d, ndmin = dm[rt][e >> 1]
                v = k.mul(d, k.cvt(imain[rt][nt][e], "f32"))
                if am is not None:
                    v = k.fma(ndmin, k.cvt(k.mad(chi[e], 256, clo[e]), "f32"), v)
                k.assign(c.acc[rt][nt][e], k.fma(dx[e & 1], v, c.acc[rt][nt][e]))


def block32_unit(c: Ctx, wb: Reg, xb: Reg, rb: Reg) -> None:
    """One unit of Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 (see the module docstring)."""
    k, wt, tn = c.k, c.wtype, c.tn
    ub = UNIT_BYTES[wt]
    accu = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(tn)] for _ in range(2)]
    mins = wt in ("Q4_1", "Q5_1")
    if wt == "Q8_0":
        roff = [[k.mul(r, ub) for r in rows] for rows in c.rows]
        t4 = k.shl(c.t, 2)
    else:
        tb = TILED_B32[wt]
        # the lane's ldmatrix row within a row tile and its chunk key (rows congruent mod 8 share it)
        lrow = k.add(k.shl(k.and_(c.mi, 1), 3), c.mr)
        key = _key(k, wt, c.mr)
        fkey = _key(k, wt, c.g)  # of the lane's fragment rows g, g + 8
        a_rows = k.add(wb, k.mul(lrow, ub))
    w_pair: list = []  # this pair of blocks' codes, per row tile
    for j in range(8):
        if j % 2 == 0:
            bs = [c.b_pair(xb, nt, j // 2) for nt in range(tn)]
        s_j = [c.sum_f32(rb, nt, j) for nt in range(tn)] if mins else None
        for rt in range(2):  # (a row tile at a time: its A fragments and scales, its MMAs, their weighting)
            if wt == "Q8_0":
                regs = {}
                for i, ro in enumerate(roff[rt]):
                    base = k.add(wb, k.add(ro, t4))
                    for h in range(2):
                        at = 34 * j + 2 + 16 * h  # (blocks are 2-byte aligned: even j realigned from two words)
                        if at % 4 == 0:
                            regs[(i, h)] = k.load("shared", "u32", base, at)
                        else:
                            regs[(i, h)] = k.prmt(k.load("shared", "u32", base, at - 2),
                                                  k.load("shared", "u32", base, at + 2), 0x5432)
                a = [regs[(0, 0)], regs[(1, 0)], regs[(0, 1)], regs[(1, 1)]]
                dws = []
                for ro in roff[rt]:
                    at = 34 * j
                    lo, hi = _f16_pair(k, k.load("shared", "u32", k.add(wb, ro), at - (at % 4)))
                    dws.append((hi if at % 4 else lo, None))
            else:
                if j % 2 == 0:  # blocks j, j + 1 of rows 0-15 of the row tile: one ldmatrix
                    chunk = k.add(k.shr(c.mi, 1), tb["qs"] // 16 + j)
                    if wt in SWIZZLE:
                        chunk = k.xor(chunk, key)
                    words = k.ldmatrix_x4(k.add(a_rows, k.shl(chunk, 4)), rt * 16 * ub)
                    w_pair = [words] if rt == 0 else [*w_pair[:1], words]
                w4 = w_pair[rt]
                row_w = [w4[2 * (j % 2)], w4[2 * (j % 2) + 1]]  # rows g, g + 8 of block j
                regs = []
                for h in range(2):  # values 4t.. (low nibbles), then 16 + 4t.. (high nibbles)
                    for i in range(2):
                        x = k.and_(row_w[i], 0x0F0F0F0F) if h == 0 else k.and_(k.shr(row_w[i], 4), 0x0F0F0F0F)
                        if tb["qh"] is not None:
                            qh = k.load("shared", "u32", _field(k, wb, c.rows[rt][i], ub, tb["qh"] + 4 * j, fkey))
                            x = k.or_(x, k.and_(k.shl(k.shr(qh, k.add(c.t, 4 * h)), 4), 0x10101010))
                        regs.append(_signed(k, x, 16 if tb["qh"] is not None else 8) if tb["sc"] == 2 else x)
                a = regs
                dws = []
                for i in range(2):
                    at = tb["sc"] * j
                    lo, hi = _f16_pair(k, k.load("shared", "u32", _field(k, wb, c.rows[rt][i], ub, at - at % 4, fkey)))
                    dws.append((hi, None) if tb["sc"] == 2 and j % 2 else (lo, hi if tb["sc"] == 4 else None))
            cs = [k.mma_s8(a, bs[nt][j % 2], [0, 0, 0, 0], a_unsigned=mins) for nt in range(tn)]
            for nt in range(tn):
                for e in range(4):
                    d, m = dws[e >> 1]
                    f = k.sub(k.bitcast(k.add(cs[nt][e], MAGIC), "f32"), 12582912.0)
                    v = k.fma(d, f, accu[rt][nt][e])
                    if mins:
                        v = k.fma(m, s_j[nt][e & 1], v)
                    k.assign(accu[rt][nt][e], v)
    for nt in range(tn):
        dx = c.dx(rb, nt)
        for rt in range(2):
            for e in range(4):
                k.assign(c.acc[rt][nt][e], k.fma(dx[e & 1], accu[rt][nt][e], c.acc[rt][nt][e]))


def _key(k: KernelBuilder, wt: str, row: Reg) -> Reg | int:
    """The 16-byte chunk permutation key of tile row ``row`` (mod 8) of a swizzled type (0: none)."""
    if wt not in SWIZZLE:
        return 0
    shift, mask = SWIZZLE[wt]
    return k.and_(k.shr(row, shift) if shift else row, mask)


def _field(k: KernelBuilder, wb: Reg, row: Reg, ub: int, byte: int, key: Reg | int) -> Reg:
    """Shared address of logical byte ``byte`` (word-aligned) of tile row ``row``'s unit (swizzled rows hold
    logical byte B at B ^ 16 key)."""
    base = k.add(wb, k.mul(row, ub))
    if isinstance(key, int):
        return k.add(base, byte)
    return k.add(base, k.xor(k.shl(key, 4), byte))
