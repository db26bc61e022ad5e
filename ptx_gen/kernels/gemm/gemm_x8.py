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

**Per unit** (:mod:`ptx_gen.kernels.gemm.gemm_x8_units`): the warp's A fragments (weight codes), one MMA a
(row tile, token tile, 32 values) from zero, and the scale work: the K-quants' integer sub-block scales
weight the int32 sums in int32 and their mins are two more MMAs a unit, f32 once a unit; the 32-value
block types weight each block's exact int32 sum by its f16 scale in f32. The weight bytes stay as the
GEMV reads them: every type of ``X8_TYPES``.

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
from ptx_gen.kernels.gemm.signature import epilogue_signature
from ptx_gen.kernels.gemm.x8 import RECORD, UNIT
from ptx_gen.kernels.gemm.gemm_x8_units import UNIT_TYPES, XROW, B32_TYPES, Ctx, block32_unit, kquant_unit
from ptx_gen.kernels.gemv.gemv_mma_layout import TILE_ROWS, UNIT_BYTES

X8_TYPES = UNIT_TYPES
MAX_DYN_SMEM = 227 * 1024


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
        g.append({"wtype": wt, "in_dim": 4096, "layout": "tiles", "wn": 4, "wm": 1, "tn": 4, "stages": 3})
        g.append({"wtype": wt, "in_dim": 14336, "layout": "tiles", "wn": 4, "wm": 1, "tn": 4, "stages": 2,
                  "residual": True})
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "glu": True, "out_f16": True, "wn": 4, "wm": 1,
                  "tn": 4, "stages": 2})
        g.append({"wtype": wt, "in_dim": 512, "layout": "tiles", "wn": 1, "wm": 2, "tn": 2, "stages": 2, "bias": True})
    g.append({"wtype": "Q8_0", "in_dim": 4096, "layout": "tiles", "wn": 4, "wm": 1, "tn": 4, "stages": 2, "ctas": 3})
    return g


@kernel("gemm_x8", grid=_grid())
def gemm_x8(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, layout: str = "tiles", wn: int = 4, wm: int = 2,
            tn: int = 4, stages: int = 3, bias: bool = False, residual: bool = False, out_f16: bool = False,
            glu: bool = False, ctas: int = 0) -> KernelBuilder:
    """Y[:m] = X[:m] W^T (+ bias) (+ residual), or with ``glu`` silu(X G^T) * (X U^T), X in x8, W tile-major
    ``wtype``; ``ctas`` (0: none): CTAs an SM must hold (``.minnctapersm``: ptxas fits the registers to it).
    Params: w, xq, xs, y, [bias], [residual], m, n, ldq, ldy. Launch: see the module docstring."""
    check_shape(wtype, in_dim, layout, wn, wm, tn, stages, glu)
    flags, params = epilogue_signature(["w", "xq", "xs", "y"], ["m", "n", "ldq", "ldy"], bias=bias, residual=residual,
                                       out_f16=out_f16, glu=glu)
    name = f"gemm_x8_{wtype.lower()}_k{in_dim}_w{wn}x{wm}_t{tn}_s{stages}{flags}" + (f"_c{ctas}" if ctas else "")
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
    g, t = k.shr(lane, 2), k.and_(lane, 3)
    rows_of = [[g, k.add(g, 8)], [k.add(g, 16), k.add(g, 24)]]  # rows of the tile, per MMA row tile
    w_off = k.mul(wi, tb)
    # ldmatrix: lane 8 i + r gives row r of matrix i: x codes of token r of a token tile, bytes 16 i.. of a pair
    # of 32-value groups (B for both)
    x_off = k.add(k.mad(wj, 8 * tn * XROW, k.mad(k.and_(lane, 7), XROW, k.shl(k.shr(lane, 3), 4))), wn * tb)
    r_off = k.add(k.mul(wj, 8 * tn * RECORD), wn * tb + bm * XROW)
    acc = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(tn)] for _ in range(2)]
    ctx = Ctx(k, wtype, lane, tn, acc)
    body = block32_unit if wtype in B32_TYPES else kquant_unit

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
        body(ctx, k.add(base, w_off), k.add(base, x_off), k.add(base, r_off))
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
