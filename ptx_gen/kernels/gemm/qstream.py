"""A warp's stream of quantized weight rows for the tensor-core GEMMs that decode GGUF blocks into MMA A
fragments (``gemm_q`` with ``mma.sync``, ``gemm_wg`` with ``wgmma``): where each of its 16 MMA rows lives,
the ``cp.async`` copy of a chunk of 256 values of those rows into a shared-memory ring slot, and the decoding
of a staged chunk's 32-value block ``b`` into the lane's A words.

Lane ``l`` (``r = l / 4``, ``q = l % 4``) takes, for each 32-value block ``b``, values ``32 b + 8 q .. + 7``
of MMA rows ``r`` and ``r + 8``, formed in f32 as ``A f + C`` from the decoded codes and rounded to f16
(nearest even), packed two per word: words 0-1 are the k pairs ``2q``, ``2q + 8`` of the block's first
m16n8k16 step, words 2-3 those of its second. See :mod:`ptx_gen.kernels.gemm.gemm_q` for the copy plan,
the layouts and the edges.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv_mma_layout import MMA_TYPES, Q6K_D, Q6K_HALF, Q6K_ROW, TILE_ROWS, TILE_UNIT
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_TABLE, ROUND, type_info

__all__ = ["CHUNK", "TABLE", "WeightStream", "aligned", "chunk_bytes", "pieces", "seg_bytes", "MMA_TYPES"]

CHUNK = ROUND  # K values per chunk
TABLE_ROW = 80  # K_TABLE types: a row's 8 sub-blocks x (A, C) f32 (64 bytes) and 16 of padding, so that the 8 rows
# a load instruction reads start in distinct bank pairs
TABLE = 16 * TABLE_ROW  # per warp, 16 rows
F16DEC_TYPES = ("Q4_K",)  # types with a decoder in f16x2 arithmetic (WeightStream's f16dec)


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


def warp_bytes(wtype: str, in_dim: int, layout: str, stages: int) -> int:
    """Shared bytes of one warp's stream: its ring of ``stages`` slots and, for K_TABLE types, its table."""
    return stages * 16 * seg_bytes(wtype, in_dim, layout) + (TABLE if wtype in K_TABLE else 0)


class WeightStream:
    """The weight side of one warp: 16 MMA rows (``glu``: gate rows ``8 strip ..`` and their up rows, else
    rows ``16 strip ..``) of a ``wtype`` weight in ``layout`` with rows of ``in_dim`` values.

    Construction emits the copy plan; :meth:`decode_setup` the lane constants (call it once the chunk range
    is known); per chunk :meth:`issue` copies, :meth:`prep` readies a staged slot and :meth:`words`
    decodes its blocks."""

    def __init__(self, k: KernelBuilder, wtype: str, in_dim: int, layout: str, glu: bool, lane: Reg, r: Reg,
                 strip: Reg, n_rows: Reg, f16dec: bool = False):
        if f16dec and wtype not in F16DEC_TYPES:
            raise ValueError(f"f16dec (decoding in f16x2 arithmetic) takes {F16DEC_TYPES} weights, got {wtype}")
        self.k, self.wtype, self.in_dim, self.layout, self.glu = k, wtype, in_dim, layout, glu
        self.f16dec = f16dec
        self.info = info = type_info(wtype)
        self.r = r
        self.nc = nc = -(-in_dim // CHUNK)
        self.tail = tail = in_dim - (nc - 1) * CHUNK  # values of the last chunk
        self.cb = cb = chunk_bytes(wtype)
        self.tail_bytes = info.row_bytes(tail) if tail < CHUNK else cb
        self.is_aligned = aligned(wtype, in_dim, layout)
        self.npieces = pieces(wtype, in_dim, layout)
        self.seg = seg_bytes(wtype, in_dim, layout)
        self.units = in_dim // ROUND
        self.n_rows = n_rows
        self.q6k_tiles = wtype == "Q6_K" and layout != "rows"
        if glu:
            self.ffn = k.shr(n_rows, 1)
            self.first = self.j0 = k.shl(strip, 3)
        else:
            self.ffn = None
            self.first = self.n0 = k.shl(strip, 4)
        self.step = cb if layout == "rows" else TILE_ROWS * TILE_UNIT[wtype]

        # copy plan: lanes 2s, 2s + 1 copy segment s, pieces (lane % 2) + 2 t
        self.cseg = cseg = k.shr(lane, 1)
        self.codd = codd = k.and_(lane, 1)
        self.c_off, self.c_ok = self.row_place(cseg)
        self.c_dst = k.add(k.mul(cseg, self.seg), k.shl(codd, 4))
        if self.q6k_tiles:
            # tile-major Q6_K: the odd lane's last piece (13, bytes 208..223 of the segment) is the 16 bytes of
            # its half holding the d of the segment's row and the 7 rows beside it, Q6K_D + 16 (pos / 8) past the
            # half (pos: the row in its half; the MMA rows 8 apart share pos % 8), instead of bytes 208.. of the row
            if not glu:
                seg_row = k.add(self.n0, cseg)
            elif layout == "glu-tiles":  # (the half is the gate or the up half of the row's tile)
                seg_row = k.add(self.j0, k.and_(cseg, 7))
            else:  # plain tiles of [gate; up]: segments 8-15 are the up rows ffn + j
                seg_row = k.mad(k.shr(cseg, 3), self.ffn, k.add(self.j0, k.and_(cseg, 7)))
            pos = k.and_(seg_row, 15)
            self.d_fix = k.mul(codd, k.sub(k.add(k.shl(k.shr(pos, 3), 4), Q6K_D - Q6K_ROW), k.mul(pos, Q6K_ROW)))
        self.w_ptr = k.global_ptr("w")

    def _tile_row_offset(self, pos: Reg) -> Reg:
        """Byte offset of row ``pos`` (0..31) of a tile's unit (Q6_K: in its 16-row half, Q6K_HALF)."""
        k = self.k
        if self.wtype == "Q6_K":
            return k.mad(k.shr(pos, 4), Q6K_HALF, k.mul(k.and_(pos, 15), Q6K_ROW))
        return k.mul(pos, TILE_UNIT[self.wtype])

    def row_place(self, s: Reg) -> tuple[Reg, Reg]:
        """(byte offset of chunk 0 of MMA row ``s``, row valid) for a register ``s`` in 0..15."""
        k, layout = self.k, self.layout
        if self.glu:  # rows 0-7: gate rows j0.., rows 8-15: the up rows of the same outputs
            up = k.shr(s, 3)
            j = k.add(self.j0, k.and_(s, 7))
            ok = k.setp("lt", j, self.ffn)
            if layout == "glu-tiles":  # tile j / 16 holds gate rows 16 T.. then their up rows
                pos = k.add(k.and_(j, 15), k.shl(up, 4))
                return k.add(k.mul(k.shr(j, 4), self.units * self.step), self._tile_row_offset(pos)), ok
            row = k.mad(up, self.ffn, j)
        else:
            row = k.add(self.n0, s)
            ok = k.setp("lt", row, self.n_rows)
        if layout == "rows":
            return k.mul(row, self.info.row_bytes(self.in_dim)), ok
        return k.add(k.mul(k.shr(row, 5), self.units * self.step), self._tile_row_offset(k.and_(row, 31))), ok

    def issue(self, c_first: Reg, n_my: Reg, i: Reg, slot: Reg) -> None:
        """cp.async the warp's bytes of its chunk ``c_first + i`` (if ``i < n_my``) into ``slot``."""
        k, nc = self.k, self.nc
        codd = self.codd
        c = k.add(c_first, i)
        ok = k.both(self.c_ok, k.setp("lt", i, n_my))
        a = k.mad(c, self.step, self.c_off)
        if self.is_aligned:
            ph = None
            a16 = a
        else:
            ph = k.and_(a, 15)
            a16 = k.sub(a, ph)
        src = k.add(self.w_ptr, k.cvt(k.add(a16, k.shl(codd, 4)), "u64"))
        dst = k.add(slot, self.c_dst)
        limit = None  # bytes of the segment to fill with data (past them: zeros)
        if self.tail < CHUNK:
            nbytes = k.selp(self.tail_bytes, self.cb, k.setp("eq", c, nc - 1), "u32")
            limit = k.add(nbytes, ph) if ph is not None else nbytes
        elif ph is not None:
            limit = k.add(ph, self.cb)
        n_t = -(-self.npieces // 2)
        for t in range(n_t):
            p_ok = ok
            if 2 * t + 1 >= self.npieces:  # (the odd lane's piece of the last pair is past the segment)
                p_ok = k.both(ok, k.setp("lt", k.add(codd, 2 * t), self.npieces))
            size = None
            if limit is not None:
                size = k.selp(16, 0, k.setp("lt", k.add(k.shl(codd, 4), 32 * t), limit), "u32")
            if self.q6k_tiles and t == n_t - 1:
                k.cp_async(dst, k.add(src, k.cvt(self.d_fix, "u64")), pred=p_ok, dst_offset=32 * t, src_offset=32 * t)
                continue
            k.cp_async(dst, src, pred=p_ok, dst_offset=32 * t, src_offset=32 * t, src_size=size)

    def decode_setup(self, lane: Reg, q: Reg) -> None:
        """The lane's decode constants (emitted once, after the chunk range)."""
        k, wtype, layout, glu, r = self.k, self.wtype, self.layout, self.glu, self.r
        lc = ql.lane_constants(k, wtype, lane, tiled=layout != "rows") if self.info.block_values == 32 else {}
        if lc.get("tiled"):  # the chunk permutation of each of the lane's rows r, r + 8 (by its row in its tile)
            def tile_row(s: Reg) -> Reg:
                if not glu:
                    return k.add(self.n0, s)
                j = k.add(self.j0, k.and_(s, 7))
                return (k.add(k.and_(j, 15), k.shl(k.shr(s, 3), 4)) if layout == "glu-tiles"
                        else k.mad(k.shr(s, 3), self.ffn, j))
            lc["key16"] = [ql.swizzle_key16(k, wtype, tile_row(s)) if wtype in ql.SWIZZLE else 0
                           for s in (r, k.add(r, 8))]
        if self.q6k_tiles and glu and layout == "tiles":
            # the up row ffn + j of a lane's segment r + 8 sits at (ffn + r) % 8 of its 8-row group, not r: its d
            # is that entry of the 16 bytes the copy put at 208 of the segment
            lc = {**lc, "q6k_up_d": k.add(k.shl(k.and_(k.add(self.ffn, r), 7), 1), Q6K_ROW)}
        self.lc = lc
        self.q = q
        self.q8 = k.shl(q, 3)
        if wtype in K_TABLE:
            self.kpair_sel = ql.k_pair_selectors(k, q)
        self.rows_dec = [r, k.add(r, 8)]
        if not self.is_aligned:
            self.dec_off = [self.row_place(s)[0] for s in self.rows_dec]
        self.dec_seg = [k.mul(s, self.seg) for s in self.rows_dec]

    def prep(self, slot: Reg, c: Reg, table_at: tuple[Reg, int]) -> dict:
        """Ready the staged chunk ``c`` in ``slot``: the segments' bases and, for K_TABLE types, the (A, C)
        table of the 16 rows' sub-blocks at shared ``table_at[0] + table_at[1]`` (warp-synchronised)."""
        k, wtype = self.k, self.wtype
        dec_abs = None if self.is_aligned else [k.mad(c, self.step, o) for o in self.dec_off]
        table = k.add(*table_at)
        if dec_abs is None:
            bases = [k.add(slot, s) for s in self.dec_seg]
        else:  # read each segment at its phase
            bases = [k.add(k.add(slot, s), k.and_(a, 15)) for s, a in zip(self.dec_seg, dec_abs)]
        lc = self.lc
        if wtype in K_TABLE:  # (A, C) of every sub-block of the 16 rows: lane (r, q) fills rows r, r + 8, pair q
            for s, bb in enumerate(bases):
                vals = ql.k_scale_pair(k, wtype, bb, self.kpair_sel)
                at = k.add(table, k.add(k.mul(self.rows_dec[0], TABLE_ROW), k.shl(self.q, 4)))
                if self.f16dec:  # (the f16x2 decoder's d sc and -dmin mn, each in both halves, once a chunk)
                    k.store("shared", "b32", at, [w for a, cc in (vals[:2], vals[2:]) for w in _f16x2_scales(k, a, cc)],
                            8 * TABLE_ROW * s)
                else:
                    k.store("shared", "f32", at, vals, 8 * TABLE_ROW * s)
            k.bar_warp_sync()
        sels = [None] * len(bases)
        if wtype == "Q6_K" and dec_abs is not None:
            sels = [ql.realign_selector(k, bb) for bb in bases]
        elif wtype == "Q6_K":  # (tile-major: aligned rows, each row's d 208 + 2 r into its segment, see issue)
            d_row = k.add(k.shl(self.rows_dec[0], 1), Q6K_ROW)
            lc = {**lc, "q6k_d": [d_row, lc.get("q6k_up_d", d_row)]}
        return {"bases": bases, "sels": sels, "lc": lc, "c": c, "table": table}

    def words(self, ch: dict, b: int) -> list[list[Reg]]:
        """The lane's A words of block ``b`` of the prepared chunk: [rows r, rows r + 8], 4 words each."""
        k, wtype = self.k, self.wtype
        tail_blocks = self.tail // 32  # whole 32-value blocks of the last chunk (tail < CHUNK only)
        out = []
        for s, bb in enumerate(ch["bases"]):
            if self.f16dec:
                w4 = _decode_q4k_f16x2(k, bb, b, self.q8, ch["table"], self.rows_dec[0], s)
            else:
                w4 = _decode(k, wtype, self.info, bb, b, ch["lc"], self.q, self.q8, ch["table"], self.rows_dec[0], s,
                             ch["sels"][s])
            if self.tail < CHUNK and wtype not in DENSE and b >= tail_blocks:  # blocks past the row's end
                live = k.setp("lt", k.mad(ch["c"], CHUNK // 32, b), self.in_dim // 32)
                w4 = [k.selp(w, 0, live, "b32") for w in w4]
            out.append(w4)
        return out


def _f16x2(k: KernelBuilder, lo: Reg, hi: Reg) -> Reg:
    """Two f32 as packed f16 (round to nearest even), ``lo`` in the low half."""
    return k.cvt_f16x2(lo, hi)


def _pack(k: KernelBuilder, vals: list) -> list[Reg]:
    return [_f16x2(k, vals[2 * i], vals[2 * i + 1]) for i in range(4)]


def _f16x2_scales(k: KernelBuilder, a: Reg, cc: Reg) -> list[Reg]:
    """A sub-block's (A, C) table entry (A = 32 d sc, C = -(A / 2 + dmin mn)) as the f16x2 decoder takes it: d sc and
    -dmin mn, each rounded to f16 in both halves."""
    scale, offset = k.mul(a, 1.0 / 32), k.fma(a, 0.5, cc)
    return [k.cvt_f16x2(scale, scale), k.cvt_f16x2(offset, offset)]


def _decode_q4k_f16x2(k: KernelBuilder, bb: Reg, b: int, q8: Reg, table: Reg, r: Reg, s: int) -> list[Reg]:
    """:func:`_decode`'s 4 words for a Q4_K block in f16x2 arithmetic (``f16dec``; the chunk's table holds each
    sub-block's f16x2 ``d sc`` and ``-dmin mn``, :func:`_f16x2_scales`): each pair of codes becomes
    ``1024 + n`` by one ``prmt`` into f16 halves, ``- 1024`` (exact), then ``n (d sc) - dmin mn`` by one f16x2 FMA with
    ``d sc`` and ``-dmin mn`` rounded to f16 first: two values in three instructions instead of five, each value within
    about an f16 rounding of ``(|n d sc| + |dmin mn|)`` of the exact decode (which rounds the f32 result once)."""
    words = k.load("shared", "u32", k.add(bb, k.add(q8, 32 * (b >> 1)) if b >> 1 else q8),
                   ql.field_offset("Q4_K", "qs"), vec=2)
    s2, c2 = k.load("shared", "b32", k.add(table, k.mul(r, TABLE_ROW)), 8 * TABLE_ROW * s + 8 * b, vec=2)
    magic = k.mov(0x64006400, "b32")  # (f16 1024 in both halves)
    out = []
    for w in words:
        nib = k.and_(k.shr(w, 4) if b & 1 else w, 0x0F0F0F0F)  # (block b's codes: the low nibbles, odd b the high)
        for sel in (0x4140, 0x4342):  # bytes (0, 1), then (2, 3), each under 0x64: f16 1024 + n
            out.append(k.fma_f16x2(k.sub_f16x2(k.prmt(nib, 0x64646464, sel), magic), s2, c2))
    return out


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
        a, cc = k.load("shared", "f32", k.add(table, k.mul(r, TABLE_ROW)), 8 * TABLE_ROW * s + 8 * b, vec=2)
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
