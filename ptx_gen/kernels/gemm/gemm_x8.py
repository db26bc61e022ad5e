"""Batch GEMM straight from the quantized weights on int8 tensor cores: ``Y[M, N] = X W^T`` for many tokens
(the batched decode above gemm_q's range, prefill chunks), X in the x8 format (:mod:`ptx_gen.kernels.gemm.x8`:
int8 codes, one f32 scale per 256 values, per-32 code sums), W tile-major as the decode GEMV reads it
(:func:`ptx_gen.kernels.gemv.gemv_mma_layout.tile_major`: "tiles", or "glu-tiles" for the fused gate/up).
No f16 copy of the weights: each weight byte is read once per CTA row of tokens and its codes go into
exact ``mma.sync.m16n8k32`` int8 products.

**Work split.** A warp owns one 32-row tile of W (two MMA row tiles of 16) and ``tn`` tiles of 8
tokens; a CTA is ``wn`` x ``wm`` warps: ``wn`` neighbouring W tiles, ``wm`` groups of ``8 tn`` tokens.
K is walked in units of 256 values. Per unit the CTA copies with ``cp.async`` its tiles' unit (``32 x
UNIT_BYTES`` contiguous bytes each), its tokens' 256 codes (rows 272 bytes apart in shared memory, so
the 8 tokens of an MMA column tile read distinct banks) and their records into one slot of a ring of
``stages``; one ``bar.sync`` a unit hands a slot from the copies to the MMAs.

**Fragments.** For 32 values of a unit (a sub-block of Q4_K, a block of Q8_0), lane (g, t) takes the
bytes ``4t..4t+3`` and ``16+4t..`` of them in rows g and g + 8 as A (the weight codes: Q4_K's nibbles
masked in place, unsigned) and the same k of token g as B (x codes), so A and B agree on k with plain
32-bit shared loads, conflict-free (rows 36 or 68 words apart). One MMA a (row tile, token tile, 32
values), from zero.

**Scales.** Q4_K: ``value = d sc_j q - dmin m_j`` (6-bit sc_j, m_j). The MMA's int32 sum of sub-block j
is weighted by sc_j in int32 (``mad``) across the unit; the mins term ``sum_j m_j S_j`` (S_j: x's code
sums) is two more MMAs a unit, the mins as A against the records' base-256 digits of S as B. Once a
unit: ``acc += dx (d main - dmin mins)`` in f32 (main below 2**26 and mins below 2**21: exact
conversions). Q8_0: ``value = d_j q``; each block's int32 sum becomes f32 exactly (``|sum| < 2**22``:
the bits of ``sum + 1.5 2**23``) and is weighted by d_j in a per-unit f32 sum, scaled by dx once a unit.

**Edges.** Tokens past M read the last token (their outputs are not written); W rows past N are the
tile's zero fill (not written). Epilogue per output ``Y[t, c]`` (f32, or f16 with ``out_f16``; rows ``ldy``
apart): ``+ bias[c]``, ``+ residual[t, c]`` (may be Y: one thread reads and writes each element);
``glu``: W is [gate; up] in "glu-tiles" (a tile's rows 0-15 gate rows ``16 T ..``, rows 16-31 the up
rows of the same outputs), so a lane holds both: ``Y[t, j] = silu(gate) * up``.

Params: w, xq, xs, y, [bias], [residual], m, n (W rows), ldq (bytes between code rows), ldy. Launch:
grid (ceil(m / meta["tokens_per_cta"]), ceil(outputs / meta["rows_per_cta"])), block meta["block"],
dynamic shared memory meta["dyn_smem"].
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.elementwise.elementwise import silu
from ptx_gen.kernels.gemm.x8 import RECORD, RECORD_D, UNIT
from ptx_gen.kernels.gemv.gemv_mma_layout import TILE_ROWS, UNIT_BYTES
from ptx_gen.kernels.gemv.quant_layout import F16_TYPE

X8_TYPES = ("Q4_K", "Q8_0")
XROW = UNIT + 16  # shared bytes between two tokens' codes
MAX_DYN_SMEM = 227 * 1024
MAGIC = 0x4B400000  # 1.5 * 2**23: an int32 |v| < 2**22 added to these bits is the float 1.5 * 2**23 + v


def tile_bytes(wtype: str) -> int:
    return TILE_ROWS * UNIT_BYTES[wtype]


def slot_bytes(wtype: str, wn: int, wm: int, tn: int) -> int:
    bm = 8 * wm * tn
    return wn * tile_bytes(wtype) + bm * XROW + bm * RECORD


def smem_bytes(wtype: str, wn: int, wm: int, tn: int, stages: int) -> int:
    return stages * slot_bytes(wtype, wn, wm, tn)


def check_shape(wtype: str, in_dim: int, layout: str, wn: int, wm: int, tn: int, stages: int, glu: bool) -> None:
    if wtype not in X8_TYPES:
        raise ValueError(f"gemm_x8 takes {X8_TYPES}, not {wtype}")
    if in_dim <= 0 or in_dim % UNIT:
        raise ValueError(f"in_dim must be a positive multiple of {UNIT}, got {in_dim}")
    if layout not in ("tiles", "glu-tiles") or (layout == "glu-tiles") != glu:
        raise ValueError(f"gemm_x8 reads tile-major weights: layout 'tiles', or 'glu-tiles' with glu; got {layout!r}"
                         f" with glu={glu}")
    if wn not in (1, 2, 4, 8) or wm not in (1, 2, 4) or wn * wm > 16 or tn not in range(1, 9):
        raise ValueError(f"wn must be 1, 2, 4 or 8, wm 1, 2 or 4 (at most 16 warps) and tn 1..8; got wn={wn}, "
                         f"wm={wm}, tn={tn}")
    if stages not in (2, 3, 4):
        raise ValueError(f"stages must be 2, 3 or 4, got {stages}")
    smem = smem_bytes(wtype, wn, wm, tn, stages)
    if smem > MAX_DYN_SMEM:
        raise ValueError(f"{wtype} wn={wn} wm={wm} tn={tn} stages={stages} needs {smem} bytes of shared memory, "
                         f"more than {MAX_DYN_SMEM}")


def _grid() -> list[dict]:
    g = []
    for wt in X8_TYPES:
        g.append({"wtype": wt, "in_dim": 4096, "layout": "tiles", "wn": 4, "wm": 2, "tn": 4, "stages": 3})
        g.append({"wtype": wt, "in_dim": 14336, "layout": "tiles", "wn": 4, "wm": 1, "tn": 4, "stages": 2,
                  "residual": True})
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "glu": True, "out_f16": True, "wn": 4, "wm": 2,
                  "tn": 4, "stages": 3})
        g.append({"wtype": wt, "in_dim": 512, "layout": "tiles", "wn": 1, "wm": 1, "tn": 2, "stages": 2, "bias": True})
    return g


@kernel("gemm_x8", grid=_grid())
def gemm_x8(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, layout: str = "tiles", wn: int = 4, wm: int = 2,
            tn: int = 4, stages: int = 3, bias: bool = False, residual: bool = False, out_f16: bool = False,
            glu: bool = False, ctas: int = 0) -> KernelBuilder:
    """Y[:m] = X[:m] W^T (+ bias) (+ residual), or with ``glu`` silu(X G^T) * (X U^T), X in x8, W tile-major
    ``wtype``; ``ctas`` (0: none): CTAs an SM must hold (``.minnctapersm``: ptxas fits the registers to it).
    Params: w, xq, xs, y, [bias], [residual], m, n, ldq, ldy. Launch: see the module docstring."""
    check_shape(wtype, in_dim, layout, wn, wm, tn, stages, glu)
    if glu and (bias or residual):
        raise ValueError("the SwiGLU epilogue takes no bias or residual")
    flags = "".join(f"_{n}" for n, on in (("bias", bias), ("res", residual), ("h", out_f16), ("glu", glu)) if on)
    name = f"gemm_x8_{wtype.lower()}_k{in_dim}_w{wn}x{wm}_t{tn}_s{stages}{flags}" + (f"_c{ctas}" if ctas else "")
    params = [("w", "u64"), ("xq", "u64"), ("xs", "u64"), ("y", "u64")]
    params += [("bias", "u64")] * bias + [("residual", "u64")] * residual
    params += [("m", "u32"), ("n", "u32"), ("ldq", "u32"), ("ldy", "u32")]
    threads = 32 * wn * wm
    k = m.kernel(name, params, max_threads=threads, min_blocks=ctas or None)
    bm = 8 * wm * tn
    tb = tile_bytes(wtype)
    slot = slot_bytes(wtype, wn, wm, tn)
    k.meta.update(block=threads, dyn_smem=smem_bytes(wtype, wn, wm, tn, stages),
                  rows_per_cta=(16 if glu else 32) * wn, tokens_per_cta=bm)
    units = in_dim // UNIT

    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    wi, wj = (k.and_(warp, wn - 1), k.shr(warp, wn.bit_length() - 1)) if wn > 1 else (k.mov(0, "u32"), warp)
    g, t = k.shr(lane, 2), k.and_(lane, 3)
    m_tok, n_rows = k.param("m"), k.param("n")
    n_tiles = k.shr(k.add(k.shr(n_rows, 1) if glu else n_rows, 15 if glu else 31), 4 if glu else 5)
    tile0 = k.mul(k.ctaid("y"), wn)
    tok0 = k.mul(k.ctaid(), bm)  # (x: the CTAs of one weight strip run together and share its bytes in L2)
    smem0 = k.dynamic_shared()

    # ---- copy plan, a unit: warp (wi, wj) copies its share of tile wi's bytes (pieces wj*32 + lane, then every
    # 32 wm on: one base address and constant offsets), every thread a few tokens' codes and records ----
    w_ptr, xq_ptr, xs_ptr = k.global_ptr("w"), k.global_ptr("xq"), k.global_ptr("xs")
    ldq = k.param("ldq")
    pieces = tb // 16
    first = k.mad(wj, 32, lane)
    tile = k.add(tile0, wi)
    w_src = k.add(w_ptr, k.add(k.mul_wide(k.mul(tile, units), tb), k.cvt(k.shl(first, 4), "u64")))
    w_dst = k.mad(wi, tb, k.shl(first, 4))
    w_ok = k.setp("lt", tile, n_tiles)
    w_copies = []  # (constant offset, predicate)
    for c in range(-(-pieces // (32 * wm))):
        ok = w_ok
        if (c + 1) * 32 * wm > pieces:
            ok = k.both(w_ok, k.setp("lt", first, pieces - c * 32 * wm))
        w_copies.append((c * 32 * wm * 16, ok))
    x_copies = []  # (src u64 at unit 0, bytes per unit, dst offset in a slot, predicate)
    for c in range(-(-(bm * 16) // threads)):
        idx = k.add(tid, c * threads) if c else tid
        tok = k.add(tok0, k.shr(idx, 4))
        ok = k.setp("lt", tok, m_tok)  # (tokens past m: never read into a written output)
        if (c + 1) * threads > bm * 16:
            ok = k.both(ok, k.setp("lt", idx, bm * 16))
        src = k.add(xq_ptr, k.add(k.mul_wide(tok, ldq), k.cvt(k.shl(k.and_(idx, 15), 4), "u64")))
        x_copies.append((src, UNIT, k.add(k.mad(k.shr(idx, 4), XROW, k.shl(k.and_(idx, 15), 4)), wn * tb), ok))
    for c in range(-(-(bm * 2) // threads)):
        idx = k.add(tid, c * threads) if c else tid
        tok = k.add(tok0, k.shr(idx, 1))
        ok = k.setp("lt", tok, m_tok)
        if (c + 1) * threads > bm * 2:
            ok = k.both(ok, k.setp("lt", idx, bm * 2))
        src = k.add(xs_ptr, k.add(k.mul_wide(k.mul(tok, units), RECORD), k.cvt(k.shl(k.and_(idx, 1), 4), "u64")))
        x_copies.append((src, RECORD, k.add(k.mad(k.shr(idx, 1), RECORD, k.shl(k.and_(idx, 1), 4)),
                                            wn * tb + bm * XROW), ok))

    def issue(u: Reg, slot_off: Reg) -> None:
        with k.if_(k.setp("lt", u, units)):
            base = k.add(smem0, slot_off)
            src = k.add(w_src, k.mul_wide(u, tb))
            dst = k.add(base, w_dst)
            for off, ok in w_copies:
                k.cp_async(dst, src, pred=ok, dst_offset=off, src_offset=off)
            for src0, step, d_off, ok in x_copies:
                k.cp_async(k.add(base, d_off), k.add(src0, k.mul_wide(u, step)), pred=ok)

    # ---- the warp's view of a slot ----
    rows_of = [[g, k.add(g, 8)], [k.add(g, 16), k.add(g, 24)]]  # rows of the tile, per MMA row tile
    w_off = k.mul(wi, tb)
    # ldmatrix: lane 8 i + r gives row r of matrix i: x codes of token r of a column tile, bytes 16 i.. of a
    # pair of 32-value groups (B for both); weight rows 8 (i % 2) + r of a row tile, bytes 16 (i / 2).. (A)
    mi, mr = k.shr(lane, 3), k.and_(lane, 7)
    x_off = k.add(k.mad(wj, 8 * tn * XROW, k.mad(mr, XROW, k.shl(mi, 4))), wn * tb)
    a_lane = k.mad(k.add(k.shl(k.and_(mi, 1), 3), mr), UNIT_BYTES[wtype], k.shl(k.shr(mi, 1), 4))
    r_tok = k.mul(wj, 8 * tn)
    r_base = wn * tb + bm * XROW
    acc = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(tn)] for _ in range(2)]
    body = _q4k_unit if wtype == "Q4_K" else _q8_0_unit

    k.grid_dependency_wait()  # X (and the residual) come from the kernels before
    for s in range(stages - 1):
        issue(k.mov(s, "u32"), k.mov(s * slot, "u32"))
        k.cp_async_commit()
    rd = k.var("u32", 0)
    wr = k.var("u32", (stages - 1) * slot)
    with k.loop(0, units) as u:
        k.cp_async_wait_group(stages - 2)
        k.bar_sync()
        issue(k.add(u, stages - 1), wr)
        k.cp_async_commit()
        base = k.add(smem0, rd)
        body(k, wtype, k.add(base, w_off), k.add(base, x_off), k.add(base, r_base), r_tok, rows_of, t, g, tn, acc,
             k.add(k.add(base, w_off), a_lane))
        for v in (rd, wr):
            nxt = k.add(v, slot)
            k.assign(v, k.selp(0, nxt, k.setp("eq", nxt, stages * slot), "u32"))
    k.cp_async_wait_all()

    # ---- epilogue ----
    y = k.global_ptr("y")
    ldy = k.param("ldy")
    tok_w = k.add(tok0, k.mul(wj, 8 * tn))
    for nt in range(tn):
        for e in range(4):
            tok = k.add(tok_w, k.add(k.shl(t, 1), 8 * nt + (e & 1)))
            tok_ok = k.setp("lt", tok, m_tok)
            for rt in range(1 if glu else 2):
                r_in = rows_of[rt][e >> 1]
                if glu:
                    col = k.add(k.shl(k.add(tile0, wi), 4), r_in)
                    ok = k.both(tok_ok, k.setp("lt", col, k.shr(n_rows, 1)))
                    v = k.mul(silu(k, acc[0][nt][e]), acc[1][nt][e])
                else:
                    col = k.add(k.shl(k.add(tile0, wi), 5), r_in)
                    ok = k.both(tok_ok, k.setp("lt", col, n_rows))
                    v = acc[rt][nt][e]
                off = k.add(k.mul_wide(tok, ldy), k.cvt(col, "u64"))
                if bias:
                    v = k.add(v, k.load("global", "f32", k.add(k.global_ptr("bias"), k.shl(k.cvt(col, "u64"), 2)),
                                        pred=ok, other=0.0))
                if residual:
                    v = k.add(v, k.load("global", "f32", k.add(k.global_ptr("residual"), k.shl(off, 2)), pred=ok,
                                        other=0.0))
                if out_f16:
                    k.store("global", "b16", k.add(y, k.shl(off, 1)), k.bitcast(k.cvt(v, "f16"), "b16"), pred=ok)
                else:
                    k.store("global", "f32", k.add(y, k.shl(off, 2)), v, pred=ok)
    k.ret()
    return k


def _f16_pair(k: KernelBuilder, word: Reg) -> tuple[Reg, Reg]:
    lo, hi = k.unpack_b32(word)
    return k.cvt(Reg(lo.name, F16_TYPE), "f32"), k.cvt(Reg(hi.name, F16_TYPE), "f32")


def _b_pair(k: KernelBuilder, xb: Reg, nt: int, p: int) -> tuple[tuple[Reg, Reg], tuple[Reg, Reg]]:
    """Column tile ``nt``'s B fragments for the 32-value groups ``2p`` and ``2p + 1`` (one ldmatrix.x4)."""
    b = k.ldmatrix_x4(xb, nt * 8 * XROW + 64 * p)
    return (b[0], b[1]), (b[2], b[3])


def _dx(k: KernelBuilder, rb: Reg, r_tok: Reg, t: Reg, nt: int) -> list[Reg]:
    """The unit's x scale of the lane's two tokens of column tile ``nt`` (elements e & 1)."""
    base = k.add(rb, k.mul(k.add(r_tok, k.add(k.shl(t, 1), 8 * nt)), RECORD))
    return [k.load("shared", "f32", base, RECORD_D + RECORD * i) for i in range(2)]


def _byte(k: KernelBuilder, word: Reg, i: int) -> Reg:
    """Byte ``i`` of ``word``, zero-extended (one prmt)."""
    return k.bitcast(k.prmt(word, 0, 0x4440 + i), "s32")


def _q4k_unit(k, wtype, wb, xb, rb, r_tok, rows_of, t, g, tn, acc, wa) -> None:
    ub = UNIT_BYTES[wtype]
    scal, mins, dm = [], [], []  # per row tile, per row: packed sc / m bytes (j < 4, j >= 4), (d, -dmin)
    for rows in rows_of:
        sr, mr, dr = [], [], []
        for r in rows:
            w_dm, s0, s1, s2 = k.load("shared", "u32", k.add(wb, k.mul(r, ub)), vec=4)
            d, dmin = _f16_pair(k, w_dm)
            dr.append((d, k.neg(dmin)))
            hi6 = lambda w: k.and_(k.shr(w, 2), 0x30303030)  # noqa: E731  (bits 6-7 of each byte at 4-5)
            sr.append([k.and_(s0, 0x3F3F3F3F), k.or_(k.and_(s2, 0x0F0F0F0F), hi6(s0))])
            mr.append([k.and_(s1, 0x3F3F3F3F), k.or_(k.and_(k.shr(s2, 4), 0x0F0F0F0F), hi6(s1))])
        scal.append(sr)
        mins.append(mr)
        dm.append(dr)
    imain = [[[k.var("s32", 0) for _ in range(4)] for _ in range(tn)] for _ in range(2)]
    for p in range(4):
        words = [k.ldmatrix_x4(wa, rt * 16 * ub + 16 + 32 * p) for rt in range(2)]  # codes of sub-blocks 2p, 2p+1
        bs = [_b_pair(k, xb, nt, p) for nt in range(tn)]
        for jj in range(2):
            j = 2 * p + jj
            if jj == 0:
                a = [[k.and_(w, 0x0F0F0F0F) for w in ws] for ws in words]
            else:
                a = [[k.and_(k.shr(w, 4), 0x0F0F0F0F) for w in ws] for ws in words]
            sc = [[_byte(k, scal[rt][i][j >> 2], j & 3) for i in range(2)] for rt in range(2)]
            # every MMA of the group first, then their weighting: independent work between an MMA and its use
            cs = [[k.mma_s8(a[rt], bs[nt][jj], [0, 0, 0, 0], a_unsigned=True) for rt in range(2)] for nt in range(tn)]
            for nt in range(tn):
                for rt in range(2):
                    for e in range(4):
                        k.assign(imain[rt][nt][e], k.mad(cs[nt][rt][e], sc[rt][e >> 1], imain[rt][nt][e]))
    # mins: sum_j m_j S_j as two MMAs (digits of S), A = the rows' 8 mins in k 0..7
    zero = k.mov(0, "u32")
    is_t0, is_t1 = k.setp("eq", t, 0), k.setp("eq", t, 1)
    am = []
    for rt in range(2):
        regs = [k.selp(mins[rt][i][0], k.selp(mins[rt][i][1], 0, is_t1, "u32"), is_t0, "u32") for i in range(2)]
        am.append([regs[0], regs[1], zero, zero])
    lo_t = k.setp("lt", t, 2)
    for nt in range(tn):
        rec = k.add(rb, k.mad(k.add(r_tok, k.add(g, 8 * nt)), RECORD, k.shl(t, 2)))
        b_lo = k.load("shared", "u32", rec, 0, pred=lo_t, other=0)
        b_hi = k.load("shared", "u32", rec, 8, pred=lo_t, other=0)
        dx = _dx(k, rb, r_tok, t, nt)
        for rt in range(2):
            clo = k.mma_s8(am[rt], [b_lo, zero], [0, 0, 0, 0])
            chi = k.mma_s8(am[rt], [b_hi, zero], [0, 0, 0, 0])
            for e in range(4):
                d, ndmin = dm[rt][e >> 1]
                main = k.cvt(imain[rt][nt][e], "f32")
                mn = k.cvt(k.mad(chi[e], 256, clo[e]), "f32")
                v = k.fma(ndmin, mn, k.mul(d, main))
                k.assign(acc[rt][nt][e], k.fma(dx[e & 1], v, acc[rt][nt][e]))


def _q8_0_unit(k, wtype, wb, xb, rb, r_tok, rows_of, t, g, tn, acc, wa) -> None:
    ub = UNIT_BYTES[wtype]
    accu = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(tn)] for _ in range(2)]
    roff = [[k.mul(r, ub) for r in rows] for rows in rows_of]
    t4 = k.shl(t, 2)
    for j in range(8):
        q0 = 34 * j + 2  # the block's codes (2-byte aligned: realigned from two words where j is even)
        a = []
        for rt in range(2):
            regs = {}
            for i, ro in enumerate(roff[rt]):
                base = k.add(wb, k.add(ro, t4))
                for h in range(2):
                    at = q0 + 16 * h
                    if at % 4 == 0:
                        regs[(i, h)] = k.load("shared", "u32", base, at)
                    else:
                        w0 = k.load("shared", "u32", base, at - 2)
                        w1 = k.load("shared", "u32", base, at + 2)
                        regs[(i, h)] = k.prmt(w0, w1, 0x5432)
            a.append([regs[(0, 0)], regs[(1, 0)], regs[(0, 1)], regs[(1, 1)]])
        dws = []
        for rt in range(2):
            pair = []
            for ro in roff[rt]:
                at = 34 * j
                word = k.load("shared", "u32", k.add(wb, ro), at - (at % 4))
                lo, hi = _f16_pair(k, word)
                pair.append(hi if at % 4 else lo)
            dws.append(pair)
        if j % 2 == 0:
            bs = [_b_pair(k, xb, nt, j // 2) for nt in range(tn)]
        for nt in range(tn):
            b = bs[nt][j % 2]
            for rt in range(2):
                c = k.mma_s8(a[rt], b, [0, 0, 0, 0])
                for e in range(4):
                    f = k.sub(k.bitcast(k.add(c[e], MAGIC), "f32"), 12582912.0)
                    k.assign(accu[rt][nt][e], k.fma(dws[rt][e >> 1], f, accu[rt][nt][e]))
    for nt in range(tn):
        dx = _dx(k, rb, r_tok, t, nt)
        for rt in range(2):
            for e in range(4):
                k.assign(acc[rt][nt][e], k.fma(dx[e & 1], accu[rt][nt][e], acc[rt][nt][e]))
