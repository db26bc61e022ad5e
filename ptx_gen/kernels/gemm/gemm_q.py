"""Small-M GEMM straight from the quantized weights: ``Y[M, N] = X[M, K] W[N, K]^T`` for the batched decode
step (M = 1..128 tokens), W the GGUF weight exactly as the decode GEMV reads it (GGUF rows, tile-major
"tiles" or "glu-tiles", see :func:`ptx_gen.kernels.gemv.gemv_mma_layout.tile_major`), X f16 row-major (row
stride ``lda``), f32 accumulation on tensor cores (``mma.sync.m16n8k16`` f16).

**Work split.** A warp owns 16 weight rows (the MMA's A operand: 16 rows) and all ``mt`` tokens of the
launch's token tile (``mt / 8`` MMA column tiles), so each weight byte is read from DRAM once per launch
whatever M. A CTA holds ``warps`` such row strips and ``kparts`` warps per strip, each walking one part of
K; the parts are summed through shared memory at the end. K is walked in *chunks* of 256 values (a
round of the GEMV: one K-quant block, eight 32-value blocks, 256 dense values).

**Weights.** Per chunk a warp copies the bytes of its 16 rows' chunk (one *segment* per row) into a ring
of ``stages`` shared-memory slots with ``cp.async`` (two lanes per segment, 16-byte pieces at 32-byte
steps; a segment not 16-byte aligned, Q6_K's 210-byte rounds or rows of 32-value blocks whose length is
no multiple of 256, is copied from its aligned start and read at its phase; a tile-major Q6_K segment is
its row's 208 aligned bytes and the 16 bytes of its half-tile that hold the row's d). The ring runs
``stages - 1`` chunks ahead of the decoding, so a warp keeps that many chunks of bytes in flight.

**Decoding into the A fragments.** The MMA sums over k in any order, as long as A and B agree. Lane
``l`` (``r = l / 4``, ``q = l % 4``) takes, for each 32-value k block ``b`` of a chunk, values
``32 b + 8 q .. + 7`` of rows ``r`` and ``r + 8`` (decoded by the per-type block decoders of
:mod:`ptx_gen.kernels.gemv.quant_layout`, the same lane split the dequantization uses within a block) and
the same 8 k of tokens ``r`` of each column tile, one 16-byte load of X. Its first two k pairs are
the k pairs ``2q``, ``2q + 8`` of one m16n8k16 step and the last two those of a second step: no shuffle,
no shared-memory round trip of the decoded weights. Values are formed in f32 as ``A f + C`` from the
decoded codes (scale terms of GGUF's dequantization) and rounded to f16 (nearest even): the MMA
multiplies exactly these f16 weights and f16 X, accumulating in f32.

**Edges.** Tokens past M read the last token's row (their columns are never written); rows past N are
not copied (their garbage stays in their own output rows, never written); K past the weight's length
(32-value block types or dense rows of a length that is no multiple of 256) reads zeros of X, and the
weight values there are zeroed (copies zero-filled, blocks past the row's end masked).

Epilogue per output ``Y[t, c]`` (f32 or f16 with ``out_f16``, row stride ``ldy``): ``+ bias[c]``,
``+ residual[t, c]`` (may be Y itself: one thread reads and writes each element). ``glu``: W is [gate;
up] (``2 ffn`` rows; GGUF rows or "glu-tiles") and a warp's MMA rows 0-7 are gate rows ``j0 .. j0 + 7``,
rows 8-15 the up rows of the same outputs, so one lane holds both: ``Y[t, j] = silu(gate) * up``.

Params: w, x, y, [bias], [residual], m (tokens, 1..mt), n (weight rows), lda, ldy. Requirements: X
16-byte aligned with ``lda`` a multiple of 8; the weight's bytes below 2**32. Launch: grid
``ceil(rows_out / meta["rows_per_cta"])`` (rows_out = n, or n / 2 with glu), block ``meta["block"]``,
dynamic shared memory ``meta["dyn_smem"]``.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.dequant.dequant import check_weight_layout
from ptx_gen.kernels.elementwise.elementwise import silu
from ptx_gen.kernels.gemv.gemv_mma_layout import MMA_TYPES, Q6K_D, Q6K_HALF, Q6K_ROW, TILE_ROWS, TILE_UNIT
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_TABLE, ROUND, type_info

MTS = (8, 16, 32, 64, 128)
CHUNK = ROUND  # K values per chunk
TABLE = 16 * 64  # K_TABLE types: per warp, 16 rows x 8 sub-blocks x (A, C) f32
MAX_DYN_SMEM = 227 * 1024
X_GROUP = 4  # column tiles whose X a lane loads at once


def chunk_bytes(wtype: str) -> int:
    """Bytes of one row's chunk of 256 values."""
    return type_info(wtype).round_bytes


def aligned(wtype: str, in_dim: int, layout: str) -> bool:
    """Whether every row's chunk starts 16-byte aligned (else it is read at its phase)."""
    if layout != "rows":  # (tile-major Q6_K: rows of Q6K_ROW bytes, 16-row halves of Q6K_HALF)
        return wtype == "Q6_K" or TILE_UNIT[wtype] % 16 == 0
    return chunk_bytes(wtype) % 16 == 0 and type_info(wtype).row_bytes(in_dim) % 16 == 0


def pieces(wtype: str, in_dim: int, layout: str) -> int:
    """16-byte pieces copied per row and chunk (an unaligned chunk: from its aligned start)."""
    nbytes = chunk_bytes(wtype)
    return -(-nbytes // 16) if aligned(wtype, in_dim, layout) else -(-(nbytes + 14) // 16)


def seg_bytes(wtype: str, in_dim: int, layout: str) -> int:
    """Shared bytes between two rows' segments: an odd number of 16-byte pieces (the 8 rows a load
    instruction reads then start in distinct bank groups), at least one more than are copied."""
    p = pieces(wtype, in_dim, layout) + 1  # (+1: realigning reads pass a segment's end by a word)
    return 16 * (p + 1 - p % 2)


def smem_bytes(wtype: str, in_dim: int, layout: str, mt: int, warps: int, kparts: int, stages: int) -> int:
    per_warp = stages * 16 * seg_bytes(wtype, in_dim, layout) + (TABLE if wtype in K_TABLE else 0)
    red = (kparts - 1) * warps * mt * 64
    return max(per_warp * warps * kparts, red)


def check_shape(wtype: str, in_dim: int, layout: str, mt: int, warps: int, kparts: int, stages: int) -> None:
    check_weight_layout(wtype, in_dim, layout)
    if mt not in MTS:
        raise ValueError(f"mt (tokens per launch tile) must be one of {MTS}, got {mt}")
    if warps not in (1, 2, 4, 8) or kparts not in (1, 2, 4, 8) or warps * kparts > 16:
        raise ValueError(f"warps and kparts must be 1, 2, 4 or 8 with at most 16 warps, got {warps} x {kparts}")
    if not 2 <= stages <= 8:
        raise ValueError(f"stages must be 2..8, got {stages}")
    nc = -(-in_dim // CHUNK)
    if kparts > nc:
        raise ValueError(f"{kparts} K parts for {nc} chunks of {CHUNK}: use fewer parts")
    smem = smem_bytes(wtype, in_dim, layout, mt, warps, kparts, stages)
    if smem > MAX_DYN_SMEM:
        raise ValueError(f"{wtype} mt={mt} warps={warps} kparts={kparts} stages={stages} needs {smem} bytes of "
                         f"shared memory, more than {MAX_DYN_SMEM}")


def _grid() -> list[dict]:
    g = []
    for wt in ("Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q4_0", "Q5_K"):
        lay = "tiles" if wt in MMA_TYPES else "rows"
        g.append({"wtype": wt, "in_dim": 4096, "layout": "rows", "mt": 8})
        g.append({"wtype": wt, "in_dim": 4096, "layout": lay, "mt": 64, "warps": 4, "kparts": 2, "residual": True})
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "mt": 32, "glu": True, "out_f16": True})
        g.append({"wtype": wt, "in_dim": 14336, "layout": lay, "mt": 128, "warps": 2, "kparts": 1, "stages": 3})
    for wt in ("F32", "F16", "BF16", "Q5_0", "Q5_1"):  # (F32's 4-stage ring of 4 warps needs 260 KB)
        g.append({"wtype": wt, "in_dim": 576, "mt": 16, "bias": True, **({"stages": 2} if wt == "F32" else {})})
    return g


@kernel("gemm_q", grid=_grid())
def gemm_q(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, layout: str = "rows", mt: int = 8, warps: int = 4,
           kparts: int = 1, stages: int = 4, bias: bool = False, residual: bool = False, out_f16: bool = False,
           glu: bool = False) -> KernelBuilder:
    """Y[:m] = X[:m] W^T (+ bias) (+ residual), or with ``glu`` silu(X G^T) * (X U^T) for W = [gate; up];
    W of ``wtype`` in ``layout``, X f16, f32 accumulation. Params: w, x, y, [bias], [residual], m, n, lda,
    ldy. Launch: grid ceil(rows_out / meta["rows_per_cta"]), block meta["block"], dyn_smem meta["dyn_smem"]."""
    check_shape(wtype, in_dim, layout, mt, warps, kparts, stages)
    if glu and (bias or residual):
        raise ValueError("the SwiGLU epilogue takes no bias or residual")
    if layout == "glu-tiles" and not glu:
        raise ValueError("a glu-tiles weight is [gate; up]: only the glu GEMM reads it")
    info = type_info(wtype)
    flags = "".join(f"_{n}" for n, on in (("bias", bias), ("res", residual), ("h", out_f16), ("glu", glu)) if on)
    name = f"gemm_q_{wtype.lower()}_k{in_dim}_{layout.replace('-', '_')}_m{mt}_w{warps}x{kparts}_s{stages}{flags}"
    params = [("w", "u64"), ("x", "u64"), ("y", "u64")]
    params += [("bias", "u64")] * bias + [("residual", "u64")] * residual
    params += [("m", "u32"), ("n", "u32"), ("lda", "u32"), ("ldy", "u32")]
    threads = 32 * warps * kparts
    k = m.kernel(name, params, max_threads=threads)
    seg = seg_bytes(wtype, in_dim, layout)
    slot_bytes = 16 * seg
    warp_bytes = stages * slot_bytes + (TABLE if wtype in K_TABLE else 0)
    smem = smem_bytes(wtype, in_dim, layout, mt, warps, kparts, stages)
    per_warp_rows = 8 if glu else 16
    k.meta.update(block=threads, dyn_smem=smem, rows_per_cta=per_warp_rows * warps, mt=mt)

    nc = -(-in_dim // CHUNK)
    tail = in_dim - (nc - 1) * CHUNK  # values of the last chunk
    cb = chunk_bytes(wtype)
    tail_bytes = info.row_bytes(tail) if tail < CHUNK else cb
    is_aligned = aligned(wtype, in_dim, layout)
    npieces = pieces(wtype, in_dim, layout)

    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    mw, kp = (k.and_(warp, warps - 1), k.shr(warp, warps.bit_length() - 1)) if kparts > 1 else (warp, None)
    r, q = k.shr(lane, 2), k.and_(lane, 3)
    n_rows = k.param("n")
    m_tok = k.param("m")
    strip = k.mad(k.ctaid(), warps, mw)
    smem0 = k.dynamic_shared()
    wbase = k.add(smem0, k.mul(warp, warp_bytes))
    units = in_dim // ROUND

    # ---- where MMA row s (0..15) of this warp lives: byte offset of its chunk 0, chunk step, valid ----
    if glu:
        ffn = k.shr(n_rows, 1)
        j0 = k.shl(strip, 3)
    else:
        n0 = k.shl(strip, 4)
    if layout == "rows":
        step = cb
    else:
        step = TILE_ROWS * TILE_UNIT[wtype]

    def tile_row_offset(pos: Reg) -> Reg:
        """Byte offset of row ``pos`` (0..31) of a tile's unit (Q6_K: in its 16-row half, Q6K_HALF)."""
        if wtype == "Q6_K":
            return k.mad(k.shr(pos, 4), Q6K_HALF, k.mul(k.and_(pos, 15), Q6K_ROW))
        return k.mul(pos, TILE_UNIT[wtype])

    def row_place(s: Reg) -> tuple[Reg, Reg]:
        """(byte offset of chunk 0 of MMA row ``s``, row valid) for a register ``s`` in 0..15."""
        if glu:  # rows 0-7: gate rows j0.., rows 8-15: the up rows of the same outputs
            up = k.shr(s, 3)
            j = k.add(j0, k.and_(s, 7))
            ok = k.setp("lt", j, ffn)
            if layout == "glu-tiles":  # tile j / 16 holds gate rows 16 T.. then their up rows
                pos = k.add(k.and_(j, 15), k.shl(up, 4))
                return k.add(k.mul(k.shr(j, 4), units * step), tile_row_offset(pos)), ok
            row = k.mad(up, ffn, j)
        else:
            row = k.add(n0, s)
            ok = k.setp("lt", row, n_rows)
        if layout == "rows":
            return k.mul(row, info.row_bytes(in_dim)), ok
        return k.add(k.mul(k.shr(row, 5), units * step), tile_row_offset(k.and_(row, 31))), ok

    # copy plan: lanes 2s, 2s + 1 copy segment s, pieces (lane % 2) + 2 t
    cseg = k.shr(lane, 1)
    codd = k.and_(lane, 1)
    c_off, c_ok = row_place(cseg)
    c_dst = k.add(k.mul(cseg, seg), k.shl(codd, 4))
    q6k_tiles = wtype == "Q6_K" and layout != "rows"
    if q6k_tiles:
        # tile-major Q6_K: the odd lane's last piece (13, bytes 208..223 of the segment) is the 16 bytes of
        # its half holding the d of the segment's row and the 7 rows beside it, Q6K_D + 16 (pos / 8) past the
        # half (pos: the row in its half; the MMA rows 8 apart share pos % 8), instead of bytes 208.. of the row
        if not glu:
            seg_row = k.add(n0, cseg)
        elif layout == "glu-tiles":  # (the half is the gate or the up half of the row's tile)
            seg_row = k.add(j0, k.and_(cseg, 7))
        else:  # plain tiles of [gate; up]: segments 8-15 are the up rows ffn + j
            seg_row = k.mad(k.shr(cseg, 3), ffn, k.add(j0, k.and_(cseg, 7)))
        pos = k.and_(seg_row, 15)
        d_fix = k.mul(codd, k.sub(k.add(k.shl(k.shr(pos, 3), 4), Q6K_D - Q6K_ROW), k.mul(pos, Q6K_ROW)))
    w_ptr = k.global_ptr("w")
    n_t = -(-npieces // 2)

    # the warp's chunk range
    if kparts > 1 and nc % kparts == 0:
        c_first = k.mul(kp, nc // kparts)
        n_my = k.mov(nc // kparts, "u32")
    elif kparts > 1:
        c_first = k.div(k.mul(kp, nc), kparts)
        c_end = k.div(k.mul(k.add(kp, 1), nc), kparts)
        n_my = k.sub(c_end, c_first)
    else:
        c_first = k.mov(0, "u32")
        n_my = k.mov(nc, "u32")

    def issue(i: Reg, slot: Reg) -> None:
        """cp.async the warp's bytes of its chunk ``c_first + i`` (if ``i < n_my``) into ``slot``."""
        c = k.add(c_first, i)
        ok = k.both(c_ok, k.setp("lt", i, n_my))
        a = k.mad(c, step, c_off)
        if is_aligned:
            ph = None
            a16 = a
        else:
            ph = k.and_(a, 15)
            a16 = k.sub(a, ph)
        src = k.add(w_ptr, k.cvt(k.add(a16, k.shl(codd, 4)), "u64"))
        dst = k.add(slot, c_dst)
        limit = None  # bytes of the segment to fill with data (past them: zeros)
        if tail < CHUNK:
            nbytes = k.selp(tail_bytes, cb, k.setp("eq", c, nc - 1), "u32")
            limit = k.add(nbytes, ph) if ph is not None else nbytes
        elif ph is not None:
            limit = k.add(ph, cb)
        for t in range(n_t):
            p_ok = ok
            if 2 * t + 1 >= npieces:  # (the odd lane's piece of the last pair is past the segment)
                p_ok = k.both(ok, k.setp("lt", k.add(codd, 2 * t), npieces))
            size = None
            if limit is not None:
                size = k.selp(16, 0, k.setp("lt", k.add(k.shl(codd, 4), 32 * t), limit), "u32")
            if q6k_tiles and t == n_t - 1:
                k.cp_async(dst, k.add(src, k.cvt(d_fix, "u64")), pred=p_ok, dst_offset=32 * t, src_offset=32 * t)
                continue
            k.cp_async(dst, src, pred=p_ok, dst_offset=32 * t, src_offset=32 * t, src_size=size)

    # ---- decode constants ----
    lc = ql.lane_constants(k, wtype, lane, tiled=layout != "rows") if info.block_values == 32 else {}
    if lc.get("tiled"):  # the chunk permutation of each of the lane's rows r, r + 8 (by its row in its tile)
        def tile_row(s: Reg) -> Reg:
            if not glu:
                return k.add(n0, s)
            j = k.add(j0, k.and_(s, 7))
            return k.add(k.and_(j, 15), k.shl(k.shr(s, 3), 4)) if layout == "glu-tiles" else k.mad(k.shr(s, 3), ffn, j)
        lc["key16"] = [ql.swizzle_key16(k, wtype, tile_row(s)) if wtype in ql.SWIZZLE else 0
                       for s in (r, k.add(r, 8))]
    if q6k_tiles and glu and layout == "tiles":
        # the up row ffn + j of a lane's segment r + 8 sits at (ffn + r) % 8 of its 8-row group, not r: its d
        # is that entry of the 16 bytes the copy put at 208 of the segment
        lc = {**lc, "q6k_up_d": k.add(k.shl(k.and_(k.add(ffn, r), 7), 1), Q6K_ROW)}
    q8 = k.shl(q, 3)
    if wtype in K_TABLE:
        kpair_sel = ql.k_pair_selectors(k, q)
    rows_dec = [r, k.add(r, 8)]
    if not is_aligned:
        dec_off = [row_place(s)[0] for s in rows_dec]
    dec_seg = [k.mul(s, seg) for s in rows_dec]

    # ---- X: lane's 8 k of token 8 t + r (clamped to m - 1) ----
    x_ptr = k.add(k.global_ptr("x"), k.cvt(k.shl(q, 4), "u64"))
    lda2 = k.shl(k.param("lda"), 1)
    m1 = k.sub(m_tok, 1)
    x_rows = [k.mul(k.min(k.add(r, 8 * t), m1), lda2) for t in range(mt // 8)]  # (byte offsets below 2**32)

    acc = [[k.var("f32", 0.0) for _ in range(4)] for _ in range(mt // 8)]
    ring = stages * slot_bytes
    for s in range(stages - 1):
        issue(k.mov(s, "u32"), k.add(wbase, s * slot_bytes) if s else wbase)
        k.cp_async_commit()
    k.grid_dependency_wait()  # X (and the residual) come from the kernels before
    rd = k.var("u32", 0)
    wr = k.var("u32", (stages - 1) * slot_bytes)
    with k.loop(0, n_my) as i:
        k.cp_async_wait_group(stages - 2)
        k.bar_warp_sync()
        issue(k.add(i, stages - 1), k.add(wbase, wr))
        k.cp_async_commit()
        slot = k.add(wbase, rd)
        c = k.add(c_first, i)
        _chunk(k, wtype, slot, c, rows_dec, dec_seg, None if is_aligned else [k.mad(c, step, o) for o in dec_off],
               lc, q, q8, kpair_sel if wtype in K_TABLE else None, k.add(wbase, stages * slot_bytes),
               x_ptr, x_rows, acc, in_dim, nc, tail)
        for v in (rd, wr):
            nxt = k.add(v, slot_bytes)
            k.assign(v, k.selp(0, nxt, k.setp("eq", nxt, ring), "u32"))
    k.cp_async_wait_all()

    if kparts > 1:  # sum the K parts through shared memory (over the ring, now unused)
        k.bar_sync()
        red = k.add(smem0, k.shl(lane, 2))
        part_bytes = mt * 64
        part = k.mad(k.sub(kp, 1), warps, mw)  # (kp = 0: wraps, unused)
        with k.if_(k.setp("ne", kp, 0)):
            base = k.add(red, k.mul(part, part_bytes))
            for t, a4 in enumerate(acc):
                for e, v in enumerate(a4):
                    k.store("shared", "f32", base, v, (4 * t + e) * 128)
        k.bar_sync()
        done = k.new_label("done")
        k.bra(done, k.setp("ne", kp, 0))  # (a fresh predicate: none stays live across the barrier)
        for p in range(1, kparts):
            base = k.add(red, k.mul(k.add(mw, (p - 1) * warps), part_bytes))
            for t, a4 in enumerate(acc):
                for e, v in enumerate(a4):
                    k.assign(v, k.add(v, k.load("shared", "f32", base, (4 * t + e) * 128)))
    _epilogue(k, acc, r, q, m_tok, n_rows, j0 if glu else n0, ffn if glu else None, bias, residual, out_f16, glu)
    if kparts > 1:
        k.label(done)
    k.ret()
    return k


def _f16x2(k: KernelBuilder, lo: Reg, hi: Reg) -> Reg:
    """Two f32 as packed f16 (round to nearest even), ``lo`` in the low half."""
    return k.pack_b32(k.cvt(lo, "f16"), k.cvt(hi, "f16"))


def _pack(k: KernelBuilder, vals: list) -> list[Reg]:
    return [_f16x2(k, vals[2 * i], vals[2 * i + 1]) for i in range(4)]


def _chunk(k: KernelBuilder, wtype: str, slot: Reg, c: Reg, rows_dec: list, dec_seg: list, dec_abs: list | None,
           lc: dict, q: Reg, q8: Reg, kpair_sel: dict | None, table: Reg, x_ptr: Reg, x_rows: list, acc: list,
           in_dim: int, nc: int, tail: int) -> None:
    """Decode the staged chunk ``c`` (rows r and r + 8 of the lane), load X and run its 16 MMA k steps
    for every column tile."""
    info = type_info(wtype)
    if dec_abs is None:
        bases = [k.add(slot, s) for s in dec_seg]
    else:  # read each segment at its phase
        bases = [k.add(k.add(slot, s), k.and_(a, 15)) for s, a in zip(dec_seg, dec_abs)]
    if wtype in K_TABLE:  # (A, C) of every sub-block of the 16 rows: lane (r, q) fills rows r, r + 8, pair q
        for s, bb in enumerate(bases):
            vals = ql.k_scale_pair(k, wtype, bb, kpair_sel)
            k.store("shared", "f32", k.add(table, k.add(k.shl(rows_dec[0], 6), k.shl(q, 4))), vals, 512 * s)
        k.bar_warp_sync()
    if wtype == "Q6_K" and dec_abs is not None:
        sels = [ql.realign_selector(k, bb) for bb in bases]
    elif wtype == "Q6_K":  # (tile-major: aligned rows, each row's d 208 + 2 r into its segment, see issue)
        sels = [None] * len(bases)
        d_row = k.add(k.shl(rows_dec[0], 1), Q6K_ROW)
        lc = {**lc, "q6k_d": [d_row, lc.get("q6k_up_d", d_row)]}
    xc = k.add(x_ptr, k.mul_wide(c, 2 * CHUNK))
    tail_blocks = tail // 32  # whole 32-value blocks of the last chunk (tail < CHUNK only)
    for b in range(CHUNK // 32):
        # X: 8 k of every column tile (zeros past in_dim)
        x_ok = None
        if tail < CHUNK and 32 * b + 32 > tail:
            x_ok = k.setp("lt", k.add(k.mad(c, CHUNK, q8), 32 * b), in_dim)
        def x_load(t: int) -> tuple:
            addr = k.add(xc, k.cvt(x_rows[t], "u64"))
            if x_ok is None:
                return k.load("global", "u32", addr, 64 * b, vec=4)
            return k.load("global", "u32", addr, 64 * b, vec=4, pred=x_ok, other=0)

        words = []
        for s, bb in enumerate(bases):
            w4 = _decode(k, wtype, info, bb, b, lc, q, q8, table, rows_dec[0], s,
                         sels[s] if wtype == "Q6_K" else None)
            if tail < CHUNK and wtype not in DENSE and b >= tail_blocks:  # blocks past the row's end
                live = k.setp("lt", k.mad(c, CHUNK // 32, b), in_dim // 32)
                w4 = [k.selp(w, 0, live, "b32") for w in w4]
            words.append(w4)
        (a0, a1, a2, a3), (b0, b1, b2, b3) = words
        for g in range(0, len(x_rows), X_GROUP):  # (X of a few column tiles at a time: fewer live registers)
            xs = [x_load(t) for t in range(g, min(g + X_GROUP, len(x_rows)))]
            for half in range(2):
                afr = [a0, b0, a1, b1] if half == 0 else [a2, b2, a3, b3]
                for t, x4 in enumerate(xs, g):
                    bfr = (x4[0], x4[1]) if half == 0 else (x4[2], x4[3])
                    k.mma_f16(afr, bfr, acc[t], into=acc[t])


def _decode(k: KernelBuilder, wtype: str, info, bb: Reg, b: int, lc: dict, q: Reg, q8: Reg, table: Reg, r: Reg,
            s: int, sel: Reg | None) -> list[Reg]:
    """The lane's 8 values (k ``32 b + 8 q ..``) of the row whose chunk is at shared ``bb``, as 4 packed
    f16 words."""
    if wtype == "F16":
        return list(k.load("shared", "u32", k.add(bb, k.shl(q, 4)), 64 * b, vec=4))  # (f16 as they are)
    if wtype == "BF16":
        ws = k.load("shared", "u32", k.add(bb, k.shl(q, 4)), 64 * b, vec=4)
        vals = [f for w in ws for f in (k.bitcast(k.shl(w, 16), "f32"), k.bitcast(k.and_(w, 0xFFFF0000), "f32"))]
        return _pack(k, vals)
    if wtype == "F32":
        a = k.add(bb, k.shl(q, 5))
        vals = list(k.load("shared", "f32", a, 128 * b, vec=4)) + list(k.load("shared", "f32", a, 128 * b + 16, vec=4))
        return _pack(k, vals)
    if info.block_values == 32:
        if lc["tiled"]:  # (a re-encoded unit: every field aligned)
            dec = ql.decode_q32(k, wtype, None, lc, None, None, None, None, ql.tiled_fields(k, wtype, bb, b, lc["key16"][s]))
        else:
            blk = k.add(bb, b * info.block_bytes) if b else bb
            sel_b = align = None
            if info.block_bytes % 4 == 0:
                align = 8 if info.block_bytes % 8 == 0 else 4
            else:
                sel_b = ql.realign_selector(k, blk, ql.field_offset(wtype, "qs"))
            dec = ql.decode_q32(k, wtype, blk, lc, sel_b, sel_b, align, align)
        a, cc = ql.affine(k, dec)
        return _pack(k, [k.fma(f, a, cc) if cc is not None else k.mul(f, a) for f in dec.fs])
    if wtype in K_TABLE:
        hi = b & 1
        lcb = {"qs_off": k.add(q8, 32 * (b >> 1)) if b >> 1 else q8, "q": q8,
               "rot": ((3 if wtype == "Q4_K" else 2) - 4 * hi) % 32, "hrot": (6 - b) % 32}
        fs = ql.decode_kq(k, wtype, bb, lcb)
        a, cc = k.load("shared", "f32", k.add(table, k.shl(r, 6)), 512 * s + 8 * b, vec=2)
        return _pack(k, [k.fma(f, a, cc) for f in fs])
    # Q6_K: the 32 values of k block b are sub-block pair (h, qq) = (b // 4, b % 4) of the block
    h, qq = b >> 2, b & 3
    rot_l = (1 - 4 * (qq >> 1)) % 32
    rot_h = (5 - 2 * qq) % 32
    lcb = {"ql_off": k.add(q8, 64 * h + 32 * (qq & 1)) if (h or qq & 1) else q8, "qh_off": k.add(q8, 128 + 32 * h),
           "sc_off": k.add(k.shr(q, 1), 192 + 8 * h + 2 * qq), "rot_l": rot_l, "rot_h": rot_h}
    dec = ql.decode_q6k(k, bb, lcb, None if sel is not None else (8, 0), sel,
                        d_at=k.add(bb, lc["q6k_d"][s]) if "q6k_d" in lc else None)
    a, cc = ql.affine(k, dec)
    return _pack(k, [k.fma(f, a, cc) for f in dec.fs])


def _epilogue(k: KernelBuilder, acc: list, r: Reg, q: Reg, m_tok: Reg, n_rows: Reg, first: Reg, ffn: Reg | None,
              bias: bool, residual: bool, out_f16: bool, glu: bool) -> None:
    """acc[t] = (Y[8t + 2q, c_a], Y[8t + 2q + 1, c_a], Y[8t + 2q, c_b], Y[8t + 2q + 1, c_b]) with c_a, c_b the
    MMA rows r, r + 8 (with glu: the gate and up of output first + r)."""
    ldy = k.param("ldy")
    y = k.global_ptr("y")
    osize = 2 if out_f16 else 4
    tok0 = k.shl(q, 1)

    def put(tok: Reg, col: Reg, v: Reg, ok: Reg) -> None:
        idx = k.mad(tok, ldy, col)
        if residual:
            v = k.add(v, k.load("global", "f32", k.add(k.global_ptr("residual"), k.mul_wide(idx, 4)), pred=ok,
                                other=0.0))
        addr = k.add(y, k.mul_wide(idx, osize))
        if out_f16:
            k.store("global", "b16", addr, k.bitcast(k.cvt(v, "f16"), "b16"), pred=ok)
        else:
            k.store("global", "f32", addr, v, pred=ok)

    if glu:
        col = k.add(first, r)
        c_ok = k.setp("lt", col, ffn)
        for t, (g0, g1, u0, u1) in enumerate(acc):
            for e, (g, u) in enumerate(((g0, u0), (g1, u1))):
                tok = k.add(tok0, 8 * t + e)
                put(tok, col, k.mul(silu(k, g), u), k.both(c_ok, k.setp("lt", tok, m_tok)))
        return
    cols = [k.add(first, r), k.add(first, k.add(r, 8))]
    oks = [k.setp("lt", c, n_rows) for c in cols]
    bs = []
    if bias:
        bp = k.global_ptr("bias")
        bs = [k.load("global", "f32", k.add(bp, k.mul_wide(c, 4)), pred=ok, other=0.0) for c, ok in zip(cols, oks)]
    for t, a4 in enumerate(acc):
        for e, v in enumerate(a4):
            ci, dt = e >> 1, e & 1
            tok = k.add(tok0, 8 * t + dt)
            if bias:
                v = k.add(v, bs[ci])
            put(tok, cols[ci], v, k.both(oks[ci], k.setp("lt", tok, m_tok)))
