"""GGUF weight -> f16 matrix: ``out[r, c]`` (row-major ``[out_dim, in_dim]``) for the tensor-core GEMM of
prefill, from the one weight copy the decode GEMV reads (GGUF rows, or tile-major, see
:func:`ptx_gen.kernels.gemv.gemv_mma_layout.tile_major`).

**Values.** ``out[r, c]`` is the float32 value of GGUF's reference dequantization
(``gguf.quants.dequantize``: ``d * q``, ``d * q + m``, ``(d * sc) * q - dmin * mn``, ...; the kernel does
the same float32 operations on the same numbers, so even the signs of zeros agree) rounded to the
nearest f16, ties to even (``cvt.rn.f16.f32``). For F32, F16, BF16, Q8_0, Q4_0, Q5_0 and Q6_K that
float32 value is exact, so ``out`` is the exact value correctly rounded. For Q4_1, Q5_1, Q4_K and Q5_K
it is the exact value ``P + M`` (the scaled code and the min, each exact in float32) rounded once, so
the result can differ by one f16 step from rounding ``P + M`` directly (double rounding): only where
``P + M`` is not a float32 number (its two terms then differ in magnitude by more than a factor of
2) and its float32 rounding is exactly an f16 tie. Magnitudes of 65520 and above become infinities of
their sign (IEEE overflow, no saturation); f16 subnormals are kept; a NaN in F32/BF16 weights stays
a NaN (not its payload); F16 weights are copied bit for bit.

**Walk.** The weight's bytes are a stream of *rounds* (256 values of one row; for GGUF rows of a
length that is not a multiple of 256, 256 consecutive values of the flattened matrix) at a fixed
stride: the round's bytes (GGUF rows) or ``TILE_UNIT`` (tile-major; Q6_K's 16-row halves hold rows of 208
bytes and then their d, see ``Q6K_HALF``). Each warp takes ``rounds`` consecutive rounds, a 16-byte aligned
run of bytes (tile-major Q6_K: its rows' 208 bytes each, then the 16-byte pieces holding their d): its
lanes copy them to the warp's shared-memory stage with ``cp.async`` (16-byte pieces, coalesced), then decode the rounds from there
with the GEMV's block decoders (lane ``l`` holds values ``8l .. 8l + 7`` of a round), and each lane
stores its 8 values as one 16-byte ``st.global.v4`` (a warp writes 512 contiguous bytes per round).
F32, F16 and BF16 need no stage: lanes load their 8 values with 16-byte loads. Rounds past the end,
and tile-major padding rows, are not stored.

**Rows.** With ``interleave`` the weight is [gate; up] (``out_dim = 2 ffn`` rows) and output row
``2 j`` is gate row ``j``, row ``2 j + 1`` up row ``j``; ``glu-tiles`` (:func:`tile_major` with
``glu``) is always such a weight, and without ``interleave`` its rows come out as [gate; up].

Launch: grid ``ceil(total_rounds(...) / meta["rounds_per_cta"])``, block ``meta["block"]``; params
``w`` (16-byte aligned, allocation rounded up to 16 bytes), ``out`` (16-byte aligned),
``out_dim`` (rows of the weight; ``out_dim * in_dim < 2**32``).
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv_mma_layout import MMA_TYPES, Q6K_D, Q6K_HALF, Q6K_ROW, SWIZZLE, TILE_ROWS, TILE_UNIT
from ptx_gen.kernels.gemv.gemv_plan import MAX_STATIC_SMEM
from ptx_gen.kernels.gemv.gemv_tiles import k_table_constants
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_TABLE, ROUND, type_info

LAYOUTS = ("rows", "tiles", "glu-tiles")
# rounds per warp: about 1-2 KB of weight bytes (several 16-byte copies per lane in flight)
DEFAULT_ROUNDS = {"F32": 2, "F16": 4, "BF16": 4, "Q8_0": 8, "Q4_0": 8, "Q4_1": 8, "Q5_0": 8, "Q5_1": 8,
                  "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}
MAX_DENSE_BYTES = 4096  # F32/F16/BF16: the bytes a warp loads into registers at once (32 per lane)
TABLE_BYTES = 64  # per K-quant block: 8 sub-blocks x (d sc, dmin mn) f32
HALF = TILE_ROWS // 2  # gate (or up) rows of a glu tile


def round_stride(wtype: str, layout: str) -> int:
    """Bytes from one round to the next in a warp's stage (and, but for tile-major Q6_K's d, in the stream)."""
    if layout != "rows":
        return Q6K_ROW if wtype == "Q6_K" else TILE_UNIT[wtype]
    return type_info(wtype).round_bytes


def check_weight_layout(wtype: str, in_dim: int, layout: str) -> None:
    """ValueError unless a ``wtype`` weight of rows of ``in_dim`` values can be streamed in ``layout``
    (GGUF rows, or tile-major: only the MMA types, in_dim whole rounds)."""
    ql.check_in_dim(wtype, in_dim)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "rows" and (wtype not in MMA_TYPES or in_dim % ROUND):
        raise ValueError(f"only {', '.join(MMA_TYPES)} weights with in_dim a multiple of {ROUND} are stored "
                         f"tile-major, got {wtype} with in_dim {in_dim}")


def check_shape(wtype: str, in_dim: int, layout: str, rounds: int) -> int:
    """The rounds per warp (``rounds``, or the type's default for 0); ValueError for shapes the
    kernel cannot emit."""
    check_weight_layout(wtype, in_dim, layout)
    g = rounds or DEFAULT_ROUNDS[wtype]
    if g < 1 or g > 16:
        raise ValueError(f"rounds must be 0 (the type's default) or 1..16, got {rounds}")
    stride = round_stride(wtype, layout)
    if wtype in DENSE and g * stride > MAX_DENSE_BYTES:
        raise ValueError(f"{wtype}: a warp holds its rounds in registers, at most {MAX_DENSE_BYTES // stride} rounds, "
                         f"got {g}")
    if wtype not in DENSE and g * stride % 16:
        raise ValueError(f"{g} rounds of {stride} bytes are not whole 16-byte pieces: pick rounds a multiple of "
                         f"{16 // (stride & -stride) if stride % 16 else 1}")
    if layout != "rows" and HALF % g:
        raise ValueError(f"tile-major weights take rounds dividing {HALF}, got {g}")
    return g


def total_rounds(wtype: str, in_dim: int, layout: str, out_dim: int) -> int:
    """Rounds in the stream of an ``out_dim`` x ``in_dim`` weight (tile-major: padding rows included)."""
    if layout == "rows":
        return -(-out_dim * in_dim // ROUND)
    tiles = -(-(out_dim // 2) // HALF) if layout == "glu-tiles" else -(-out_dim // TILE_ROWS)
    return tiles * (in_dim // ROUND) * TILE_ROWS


def _grid() -> list[dict]:
    shapes = []
    for wt in ql.WEIGHT_TYPES:
        for d in ((256, 14336) if wt in ql.K_QUANTS else (576, 4096)):
            shapes.append({"wtype": wt, "in_dim": d})
    shapes += [{"wtype": "F16", "in_dim": 4104, "interleave": True},
               {"wtype": "Q4_0", "in_dim": 4096, "interleave": True},
               {"wtype": "Q8_0", "in_dim": 1536, "warps": 1, "rounds": 4},
               {"wtype": "Q4_K", "in_dim": 4096, "warps": 1}]
    for wt in MMA_TYPES:
        shapes += [{"wtype": wt, "in_dim": 4096, "layout": "tiles"},
                   {"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "interleave": True},
                   {"wtype": wt, "in_dim": 14336, "layout": "tiles", "interleave": True}]
    return shapes


@kernel("dequant_f16", grid=_grid())
def dequant_f16(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, layout: str = "rows", interleave: bool = False,
                warps: int = 4, rounds: int = 0) -> KernelBuilder:
    """out[r, c] = f16(W[r, c]) row-major [out_dim, in_dim] for W of ``wtype`` stored ``layout`` ("rows",
    "tiles" or "glu-tiles"), rounded to nearest even from GGUF's float32 value (see the module); with
    ``interleave`` (W = [gate; up]) output row 2j is gate row j and 2j + 1 up row j. ``rounds``: rounds of
    256 values per warp (0: the type's default). Params: w, out, out_dim (weight rows).
    Launch: grid ceil(total_rounds / meta["rounds_per_cta"]), block meta["block"]."""
    g = check_shape(wtype, in_dim, layout, rounds)
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {warps}")
    name = (f"dequant_f16_{wtype.lower()}_k{in_dim}_{layout.replace('-', '_')}_g{g}_w{warps}"
            + ("_il" if interleave else ""))
    stride = round_stride(wtype, layout)
    stage = 0 if wtype in DENSE else g * stride + 16 * _q6k_d_pieces(wtype, layout, g) + 16  # (+16: a
    # realigning read may pass the last block)
    table = g * TABLE_BYTES if wtype in K_TABLE else 0
    if (stage + table) * warps > MAX_STATIC_SMEM:
        raise ValueError(f"{wtype}: {warps} warps of {g} rounds need {(stage + table) * warps} bytes of shared memory, "
                         f"more than {MAX_STATIC_SMEM}: use fewer warps or rounds")
    k = m.kernel(name, [("w", "u64"), ("out", "u64"), ("out_dim", "u32")], max_threads=32 * warps)
    k.meta.update(block=32 * warps, smem=(stage + table) * warps, rounds_per_warp=g, rounds_per_cta=g * warps,
                  stride=stride)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    out_dim = k.param("out_dim")
    seg = k.mad(k.ctaid(), warps, warp)
    g0 = k.mul(seg, g)  # the warp's first round
    n_rounds = _n_rounds(k, layout, in_dim, out_dim)
    done = k.new_label("done")
    k.bra(done, k.setp("ge", g0, n_rounds), uniform=True)
    dest = _Dest(k, layout, in_dim, interleave, out_dim, g0, lane)
    if wtype in DENSE:
        _dense(k, wtype, g, g0, lane, dest)
    else:
        sbuf = k.add(k.shared_array(f"{name}_stage", "u8", (stage + table) * warps), k.mul(warp, stage + table))
        _stage(k, layout, wtype, in_dim, g, stride, seg, lane, out_dim, sbuf)
        _quant(k, wtype, g, stride, sbuf, k.add(sbuf, stage) if table else None, g0, n_rounds, lane, dest,
               layout != "rows")
    k.label(done)
    k.ret()
    return k


def _n_rounds(k: KernelBuilder, layout: str, in_dim: int, out_dim: Reg) -> Reg:
    """The stream's rounds (:func:`total_rounds`), without overflow for any ``out_dim * in_dim < 2**32``."""
    if layout == "rows" and in_dim % ROUND:
        total = k.mul(out_dim, in_dim)
        return k.add(k.shr(total, 8), k.min(k.and_(total, ROUND - 1), 1))
    if layout == "rows":
        return k.mul(out_dim, in_dim // ROUND)
    if layout == "glu-tiles":
        tiles = k.shr(k.add(k.shr(out_dim, 1), HALF - 1), 4)
    else:
        tiles = k.shr(k.add(out_dim, TILE_ROWS - 1), 5)
    return k.mul(tiles, in_dim // ROUND * TILE_ROWS)


class _Dest:
    """Where round ``g0 + i`` of the stream goes: :meth:`at` gives the lane's (store guard, output index
    of its first value). GGUF rows: value ``v = 256 (g0 + i) + 8 lane`` of the flattened matrix. Tile-major:
    tile ``T``, unit ``u`` and tile row ``p0 + i`` (a warp's rounds share T and u, see check_shape)."""

    def __init__(self, k: KernelBuilder, layout: str, in_dim: int, interleave: bool, out_dim: Reg, g0: Reg, lane: Reg):
        self.k, self.layout, self.in_dim, self.interleave = k, layout, in_dim, interleave
        self.ffn = k.shr(out_dim, 1)
        self.up_shift = k.sub(k.shl(self.ffn, 1), 1) if interleave else None  # 2 ffn - 1
        lane8 = k.shl(lane, 3)
        if layout == "rows":
            self.total = k.mul(out_dim, in_dim)
            self.v0 = k.add(k.shl(g0, 8), lane8)
            return
        units = in_dim // ROUND
        tu = k.shr(g0, 5)
        t = k.div(tu, units)
        p0 = k.and_(g0, TILE_ROWS - 1)
        self.col = k.add(k.shl(k.sub(tu, k.mul(t, units)), 8), lane8)
        if layout == "tiles":
            self.row0, self.limit = k.add(k.shl(t, 5), p0), out_dim
        else:  # gate (p0 < 16) or up rows of the tile: j = 16 T + p0 % 16
            self.row0, self.limit = k.add(k.shl(t, 4), k.and_(p0, HALF - 1)), self.ffn
            self.up = k.shr(p0, 4)

    def _up_shift(self, r: Reg) -> Reg:
        """What interleaving takes off ``2 r`` for weight row ``r`` of [gate; up]: 0 for gate rows,
        2 ffn - 1 for up rows (up row ``r - ffn`` goes to ``2 (r - ffn) + 1``)."""
        k = self.k
        return k.selp(self.up_shift, 0, k.setp("ge", r, self.ffn))

    def at(self, i: int) -> tuple[Reg, Reg]:
        k = self.k
        if self.layout == "rows":
            v = k.add(self.v0, i * ROUND) if i else self.v0
            ok = k.setp("lt", v, self.total)
            if not self.interleave:
                return ok, v
            r = k.div(v, self.in_dim)  # (u32 arithmetic wraps: v + in_dim (r - shift) is the output index)
            return ok, k.mad(k.sub(r, self._up_shift(r)), self.in_dim, v)
        row = k.add(self.row0, i) if i else self.row0
        ok = k.setp("lt", row, self.limit)
        if self.layout == "tiles":
            orow = k.sub(k.shl(row, 1), self._up_shift(row)) if self.interleave else row
        elif self.interleave:
            orow = k.add(k.shl(row, 1), self.up)
        else:
            orow = k.mad(self.up, self.ffn, row)
        return ok, k.mad(orow, self.in_dim, self.col)


def _store(k: KernelBuilder, idx: Reg, vals: list) -> None:
    """The lane's 8 values (f32, or 4 words of packed f16) as f16 at ``out[idx ..]``: one 16-byte store."""
    if len(vals) == 8:
        halves = [k.cvt(v, "f16") for v in vals]
        vals = [k.pack_b32(halves[2 * j], halves[2 * j + 1]) for j in range(4)]
    k.store("global", "b32", k.add(k.global_ptr("out"), k.mul_wide(idx, 2)), vals)


def _dense(k: KernelBuilder, wtype: str, g: int, g0: Reg, lane: Reg, dest: _Dest) -> None:
    """F32/F16/BF16: each lane loads its 8 values of every round (16-byte loads, all in flight), then
    converts and stores them."""
    es = type_info(wtype).block_bytes
    base = k.add(k.global_ptr("w"), k.mul_wide(k.add(k.shl(g0, 8), k.shl(lane, 3)), es))
    loads = []
    for i in range(g):
        ok, idx = dest.at(i)
        off = i * ROUND * es
        if wtype == "F32":
            words = [*k.load("global", "f32", base, off, vec=4, nc=True, pred=ok, other=0.0),
                     *k.load("global", "f32", base, off + 16, vec=4, nc=True, pred=ok, other=0.0)]
        else:
            words = list(k.load("global", "u32", base, off, vec=4, nc=True, pred=ok, other=0))
        loads.append((ok, idx, words))
    k.grid_dependency_wait()  # the weights are in flight: now wait for the kernels before (out may be read there)
    for ok, idx, words in loads:
        with k.if_(ok):
            if wtype == "BF16":
                words = [f for w in words for f in (k.bitcast(k.shl(w, 16), "f32"),
                                                    k.bitcast(k.and_(w, 0xFFFF0000), "f32"))]
            _store(k, idx, words)


def _stage(k: KernelBuilder, layout: str, wtype: str, in_dim: int, g: int, stride: int, seg: Reg, lane: Reg,
           out_dim: Reg, sbuf: Reg) -> None:
    """Copy the warp's ``g`` rounds (``g * stride`` bytes from ``w + seg * g * stride``) to its stage
    ``sbuf`` with cp.async, stopping at the end of the weight's bytes (GGUF rows; a tile-major stream
    holds whole segments); wait for the kernels before (``out`` may still be read there), then for
    this lane's copies, and synchronise the warp."""
    nbytes = g * stride
    npieces = nbytes // 16
    w = k.global_ptr("w")
    lane16 = k.shl(lane, 4)
    dpieces = _q6k_d_pieces(wtype, layout, g)
    if dpieces:  # tile-major Q6_K: round g0 is row g0 % 16 of half g0 / 16; then the pieces of its rows' d
        g0 = k.mul(seg, g)
        half = k.add(w, k.mul_wide(k.shr(g0, 4), Q6K_HALF))
        src = k.add(k.add(half, k.cvt(k.mul(k.and_(g0, 15), Q6K_ROW), "u64")), k.cvt(lane16, "u64"))
        dsrc = k.add(half, k.cvt(k.add(k.shl(k.and_(g0, 8), 1), Q6K_D), "u64"))  # (16 bytes: 8 rows' d)
        for q in range(dpieces):
            k.cp_async(k.add(sbuf, nbytes + 16 * q), dsrc, pred=k.setp("eq", lane, q), src_offset=16 * q)
    else:
        src = k.add(k.add(w, k.mul_wide(seg, nbytes)), k.cvt(lane16, "u64"))
    dst = k.add(sbuf, lane16)
    end = k.add(w, k.mul_wide(out_dim, type_info(wtype).row_bytes(in_dim))) if layout == "rows" else None
    for q in range(-(-npieces // 32)):
        ok = k.setp("lt", lane, npieces - 32 * q) if (q + 1) * 32 > npieces else None
        if end is not None:
            ok = k.both(ok, k.setp("lt", k.add(src, 512 * q) if q else src, end))
        k.cp_async(dst, src, pred=ok, dst_offset=512 * q, src_offset=512 * q)
    k.grid_dependency_wait()
    k.cp_async_wait_all()
    k.bar_warp_sync()


def _q6k_d_pieces(wtype: str, layout: str, g: int) -> int:
    """16-byte pieces of d a warp of ``g`` rounds stages after its rows (tile-major Q6_K: a piece holds
    8 rows' d), else 0."""
    return -(-g // 8) if wtype == "Q6_K" and layout != "rows" else 0


def _quant(k: KernelBuilder, wtype: str, g: int, stride: int, sbuf: Reg, table: Reg | None, g0: Reg, n_rounds: Reg,
           lane: Reg, dest: _Dest, tiled: bool) -> None:
    """Decode the staged rounds and store them (a round past the stream's end or a padding row: not stored);
    ``tiled``: tile-major weights (the 32-value block types re-encoded, see ``TILED_B32``)."""
    info = type_info(wtype)
    lc = ql.lane_constants(k, wtype, lane, tiled=tiled)
    sel = align = fields = None
    if info.block_values == 32 and lc["tiled"]:
        fields = ql.tiled_fields(k, wtype, sbuf, lc["blk"])  # the lane's block of round 0
        # (a tile-major round is a tile row, round g0 + i row (g0 + i) % 32: with chunks permuted, its key)
        keys = [ql.swizzle_key16(k, wtype, i if g % 8 == 0 else k.add(g0, i)) if wtype in SWIZZLE else 0
                for i in range(g)]
    elif info.block_values == 32:
        lane_bb = k.add(sbuf, k.mul(lc["blk"], info.block_bytes))
        if info.block_bytes % 4 == 0:
            align = 8 if info.block_bytes % 8 == 0 else 4
        else:
            sel = ql.realign_selector(k, lane_bb, ql.field_offset(wtype, "qs"))
    d_base = None  # tile-major Q6_K: round i's d at d_base + 2 i (the staged pieces start at row g0 & ~7)
    if wtype == "Q6_K" and tiled:
        d_base = k.add(sbuf, k.add(k.shl(k.and_(g0, 7), 1), g * stride))
    if table is not None:
        lc.update(k_table_constants(k, lane))
        _k_table(k, g, stride, sbuf, table, lc, g0, n_rounds)
    for i in range(g):
        ok, idx = dest.at(i)
        with k.if_(ok):
            if fields is not None:  # (round 0's fields moved, or where the round's chunks are permuted its own)
                at = (ql.tiled_fields(k, wtype, _off(k, sbuf, i * stride), lc["blk"], keys[i])
                      if isinstance(keys[i], Reg) or keys[i] else
                      tuple(None if f is None else _off(k, f, i * stride) for f in fields))
                vals = _exact(k, ql.decode_q32(k, wtype, None, lc, None, None, None, None, at))
            elif info.block_values == 32:
                vals = _exact(k, ql.decode_q32(k, wtype, _off(k, lane_bb, i * stride), lc, sel, sel, align, align))
            elif wtype in K_TABLE:
                fs = ql.decode_kq(k, wtype, _off(k, sbuf, i * stride), lc)
                dsc, dm = k.load("shared", "f32", k.add(table, lc["tentry"]), i * TABLE_BYTES, vec=2)
                alpha = 32.0 if wtype == "Q4_K" else 64.0  # f = 0.5 + q / alpha
                vals = [k.sub(k.mul(dsc, k.fma(f, alpha, -alpha / 2)), dm) for f in fs]  # (d sc) q - dmin mn
            else:  # Q6_K: every round's phase is known (the stage is 16-byte aligned)
                vals = _exact(k, ql.decode_q6k(k, _off(k, sbuf, i * stride), lc, (8, i * stride % 8),
                                               d_at=None if d_base is None else _off(k, d_base, 2 * i)))
            _store(k, idx, vals)


def _off(k: KernelBuilder, base: Reg, off: int) -> Reg:
    return k.add(base, off) if off else base


def _exact(k: KernelBuilder, dec: ql.Decoded) -> list[Reg]:
    """GGUF's float32 values of a decoded lane, by its operations: the code ``n = alpha f + beta`` (one
    exact FMA: ``q - 8``, ``q``, ``q - 32``, ...), then ``s * n`` (exact: few significant bits), then
    ``+ m`` (rounded once). The same operations on the same numbers give the same zero signs too."""
    ns = dec.fs if dec.alpha == 1.0 and dec.beta == 0.0 else [k.fma(f, dec.alpha, dec.beta) for f in dec.fs]
    vals = [k.mul(dec.s, n) for n in ns]
    return vals if dec.m is None else [k.add(v, dec.m) for v in vals]


def _k_pair(k: KernelBuilder, bb: Reg, sel: dict) -> list[Reg]:
    """(D_j, M_j, D_j+1, M_j+1) = (d sc, dmin mn) of sub-blocks j = 2u, 2u + 1 of the Q4_K/Q5_K block at
    ``bb``, each an f32 product of d (or dmin) and the 6-bit code as a float (exact, as GGUF forms them)."""
    sc, mn, d, dmin = ql.k_scale_codes(k, bb, sel)
    out = []
    for byte in ("b0", "b1"):
        for codes, scale in ((sc, d), (mn, dmin)):
            code = k.add(k.bitcast(k.prmt(codes, 0x4B000000, sel[byte]), "f32"), -8388608.0)  # 2**23 + c - 2**23
            out.append(k.mul(scale, code))
    return out


def _k_table(k: KernelBuilder, g: int, stride: int, sbuf: Reg, table: Reg, lc: dict, g0: Reg,
             n_rounds: Reg) -> None:
    """(d sc, dmin mn) of every sub-block of the staged Q4_K/Q5_K blocks: lane l takes sub-blocks
    2 (l % 4), 2 (l % 4) + 1 of block l / 4 (+ 8 per pass), entry ``table[8 block + j]``."""
    for e in range(-(-g // 8)):
        blk = k.add(lc["kblk"], 8 * e) if e else lc["kblk"]
        ok = k.setp("lt", k.add(g0, blk), n_rounds)
        if 8 * (e + 1) > g:
            ok = k.and_(ok, k.setp("lt", blk, g))
        with k.if_(ok):
            pair = _k_pair(k, k.add(sbuf, k.mul(blk, stride)), lc["kpair"])
            k.store("shared", "f32", k.add(table, lc["kentry"]), pair, 512 * e)
    k.bar_warp_sync()
