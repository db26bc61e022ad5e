"""Tensor-core GEMV ``y = W x (+ bias) (+ residual)`` for decode, W in Q4_K, Q8_0 or Q6_K blocks: the
weights' integer codes go into exact int8 MMAs (``mma.m16n8k32.s32.s8.s8``), so decoding a weight
costs a fraction of an instruction instead of a float conversion and an FMA each.

x as integers, exactly enough: each 256 values of x (a *unit*) are scaled by a power of two ``f`` (from
their max |x|, so that ``|x f| < 2**30``), rounded to ``X`` and written as four signed base-256 digits
``X = c0 + 256 c1 + 2**16 c2 + 2**24 c3`` (each in [-128, 127]) into shared memory, a few
instructions a value (see :func:`_digits`). The digits are four columns of the MMA's B operand (the
other four are zero), so one MMA gives, for 16 weight rows at once, the exact integer dot products of
a block's codes with each digit; rounding x to 31 bits of its unit's max is the only approximation
(finer than float32 for all but a unit's largest values); ``1 / f`` goes into the unit's scale.

Work split: a CTA has ``mtiles`` x ``kparts`` warps; warp (mt, kp) owns the 16 rows of tile ``mt``
and every ``kparts``-th unit of K from unit ``kp`` on (so the parts read neighbouring bytes at the
same time). K is walked in *units* of 256 values (one Q4_K super-block, or 8
Q8_0 blocks): a unit of 16 rows is 16 x 144 (or 272) bytes, copied with ``cp.async`` into a ring of
``stages`` per-warp buffers. The first ``stages`` units are requested before ``griddepcontrol.wait``
(they are weights: no kernel writes them), so under programmatic dependent launch they stream in
while the previous kernel ends. Each warp turns the x units it needs into digits itself, one unit
ahead of its use (loaded two ahead), into two slots of its own: no CTA-wide step before the first
MMA, and x arrives alongside the weights.

Weight layout: GGUF rows, or (``tiled``) tile-major (:func:`tile_major`): tiles of 32 rows, each unit's
32 rows back to back, so that a warp's stage is one contiguous run of bytes (one bulk copy on sm_90)
and a launch reads whole tiles side by side. On GGUF rows a stage is 16-32 pieces of a unit's bytes,
one per row, a row apart, and the DRAM streams them more slowly: on an H200, 4096 x 14336 Q4_K 10.5 us on
rows, 9.75 tile-major (81% of the copy bandwidth); Q6_K 15.2 and 14.05; Q8_0 16.6 and 15.6.

Per unit (Q4_K): each row's 6-bit scales and mins are unpacked into a table by one lane; each of
the 4 sub-block pairs is one ``ldmatrix.x4`` (lane (g, t) gets 4 code bytes of rows g and g + 8 in
each half of the pair) feeding two MMAs that each take the low nibbles of sub-block 2i (class 0) as
k 0..15 and the high nibbles of 2i + 1 (class 1, masked in place) as k 16..31, against x digits in B's
columns 0..3 and 4..7 (see :func:`_unit_q4k`); their int32 results are weighted by the integer
sub-block scales (``mad``), and once per unit converted to float and multiplied by the row's ``d``.
The mins contribute ``-dmin m_j sum(x over sub-block j)`` with the sums of x kept per 32 values in
shared memory.
Q8_0: the block's 32 signed codes are A directly (two-byte aligned, realigned with ``prmt``); one MMA
per block, scaled by the block's ``d`` in float. Q6_K (210-byte blocks, so a unit starts at any even
byte of a 16-byte chunk: the 14 chunks covering it are staged, words realigned with funnel shifts):
the 6-bit codes are assembled from their ql/qh bits as unsigned bytes; each MMA pairs two 16-value
sub-blocks, one per half of B's 8 columns, so every lane's sums carry one integer scale; the codes'
offset of 32 enters exactly, as the MMA's accumulator input (:func:`_unit_q6k`).

End: each row's sum is spread over the 4 lanes of its group (digit columns) and weighted by
1, 256, 65536 and 2**24; with ``kparts > 1`` the parts meet in shared memory (one
``bar.sync``) and are added in order (deterministic).

Launch: grid ``ceil(out_dim / (16 tiles mtiles))``, block ``32 mtiles kparts``, dynamic shared memory
``meta["dyn_smem"]`` bytes (above 48 KiB: the launcher raises the limit). ``in_dim`` must be a
multiple of ``256 kparts`` (Q6_K on GGUF rows: also of 2048); W starts 16-byte aligned.
"""

from __future__ import annotations

import contextlib

import numpy as np

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels import quant_layout as ql
from ptx_gen.kernels.gemv import _silu_mul, gemv_params

UNIT_BYTES = {"Q4_K": 144, "Q8_0": 272, "Q6_K": 210}  # bytes of 256 values of one row
MMA_TYPES = tuple(UNIT_BYTES)
# bytes between two rows of a staged unit: Q6_K copies the 14 aligned 16-byte chunks that cover a
# block at any 2-byte phase into rows of 15 chunks (240 bytes: 60 words, so that the 8 rows of an MMA
# tile read distinct banks)
STRIDE = {"Q4_K": 144, "Q8_0": 272, "Q6_K": 240}
Q6K_CHUNKS = 14
PARTS = 4  # base-256 digits of x
MAX_DYN_SMEM = 227 * 1024
# per warp, two x slots (units j and j + 1). Q8_0: 4 digit planes of 256 bytes, 272 apart (16 mod 128:
# the four planes' B loads hit distinct banks), then 1 / f. Q4_K: its B words in the order the lanes
# load them (1 KiB, see _x_lane_constants), the sums of x per 32 values and 1 / f. Q6_K: the B
# fragments of its 8 MMAs as the lanes load them (see _unit_q6k), half of them zeros, then 1 / f
PLANE = 272
XSUM = {"Q4_K": 1024, "Q8_0": 4 * 272}
INVF = {"Q4_K": XSUM["Q4_K"] + 32, "Q8_0": XSUM["Q8_0"] + 32, "Q6_K": 2048}
XSLOT = {wt: INVF[wt] + 16 for wt in INVF}
# per warp and row, per unit: 8 int32 sub-block scales and d / f (Q4_K), 8 block scales d / f (Q8_0),
# or 16 int32 sub-block scales (as the two lane classes use them) and d / f (Q6_K)
TABLE_ROW = {"Q4_K": 48, "Q8_0": 48, "Q6_K": 80}
TILE_ROWS = 32  # rows of a tile of tile-major weights (tile_major)
# bytes of a row's unit in a tile: Q6_K's 210 padded to 212, so that every row starts on a word (its
# words then load as they are, with no second load and funnel shift: 4096 x 14336 Q6_K measured
# faster with the 1% more bytes)
TILE_UNIT = {"Q4_K": 144, "Q8_0": 272, "Q6_K": 212}
# shared memory a ``solo`` CTA asks for, so that no second CTA fits its SM (two need 2 x (this + 1 KiB)
# > 228 KiB). Found on an H200: where two CTAs of one long-K launch (or of two launches under
# programmatic dependent launch) share SMs while others idle, 4096 x 14336 Q4_K takes 12.0 us, not 9.7
SOLO_SMEM = 120 * 1024


def q6k_glu_offsets_fit(ffn: int, in_dim: int) -> bool:
    """Whether the Q6_K kernel's 32-bit copy offsets, from a warp's first gate row to the end of the
    last chunk of its last up row (ffn + 16 rows on), stay below 2**31 in a fused gate/up GEMV."""
    return (ffn + 16) * (in_dim // 256 * UNIT_BYTES["Q6_K"]) + 16 * Q6K_CHUNKS < 2**31


def layout(wtype: str, in_dim: int, mtiles: int, kparts: int, stages: int, tiles: int = 1, tiled: bool = False,
           solo: bool = False) -> dict:
    """Validated shape and the dynamic shared-memory layout (byte offsets) of a variant (``tiles``:
    16-row MMA tiles per warp; ``tiled``: W tile-major, see :func:`tile_major`; ``solo``: at least
    ``SOLO_SMEM`` bytes, so that one CTA holds an SM)."""
    if wtype not in UNIT_BYTES:
        raise ValueError(f"the tensor-core GEMV handles {MMA_TYPES}, not {wtype}")
    if mtiles not in range(1, 9) or kparts not in (1, 2, 4, 8) or tiles not in (1, 2) or mtiles * kparts > 8:
        # (16-warp CTAs measured no faster, and leave 128 registers a thread: some variants spill)
        raise ValueError(f"mtiles must be 1..8, kparts 1, 2, 4 or 8 and tiles 1 or 2, with at most 8 warps; got "
                         f"mtiles={mtiles}, kparts={kparts}, tiles={tiles}")
    if stages not in (2, 3, 4, 8):
        raise ValueError(f"stages must be 2, 3, 4 or 8, got {stages}")
    if in_dim <= 0 or in_dim % (256 * kparts):
        raise ValueError(f"in_dim must be a positive multiple of 256 * kparts = {256 * kparts}, got {in_dim}")
    if wtype == "Q6_K" and in_dim % 2048 and not tiled:
        # 8 blocks = 1680 bytes = 105 16-byte chunks: then every row starts 16-byte aligned and all rows
        # of a unit share its phase
        raise ValueError(f"the tensor-core Q6_K GEMV needs in_dim a multiple of 2048, got {in_dim}")
    warps = mtiles * kparts
    unit = TILE_UNIT[wtype] if tiled else STRIDE[wtype]  # (tile-major: a stage is its tile's bytes as they are)
    rows = 16 * tiles
    off = {}
    pos = 0

    def take(name: str, nbytes: int) -> None:
        nonlocal pos
        off[name] = pos
        pos += -(-nbytes // 16) * 16

    take("ring", warps * stages * rows * unit)
    take("xbuf", warps * 2 * XSLOT[wtype])
    take("table", warps * rows * TABLE_ROW[wtype])
    take("red", warps * rows * 4 if kparts > 1 else 0)
    take("mbar", warps * stages * 8)  # sm_90: one mbarrier per ring slot
    if pos > MAX_DYN_SMEM:
        raise ValueError(f"{wtype} rows of {in_dim} with mtiles={mtiles}, kparts={kparts}, stages={stages}, "
                         f"tiles={tiles} need {pos} bytes of shared memory, more than {MAX_DYN_SMEM}: fewer warps or "
                         f"stages")
    return dict(stride=unit, units=in_dim // 256, per_warp=in_dim // 256 // kparts, warps=warps, smem=pos, off=off,
                row_bytes=in_dim // 256 * UNIT_BYTES[wtype], rows=rows, launch_smem=max(pos, SOLO_SMEM) if solo else pos)


def tile_major(raw: np.ndarray, wtype: str, out_dim: int, in_dim: int, glu: bool = False) -> np.ndarray:
    """W's bytes (GGUF rows, ``out_dim`` x ``in_dim``) as the ``tiled`` kernels read them: tiles of
    ``TILE_ROWS`` rows, and within a tile unit by unit, each unit's ``TILE_ROWS`` rows of 256 values back
    to back, ``TILE_UNIT`` bytes apart (Q6_K: its 210 bytes and 2 zero bytes), i.e. ``TILE_ROWS *
    TILE_UNIT`` contiguous bytes, what one warp stages. Tile T, unit u starts at byte ``(T * units + u)
    * TILE_ROWS * TILE_UNIT``; the last tile is zero-filled past ``out_dim``.
    With ``glu`` W is [gate; up] (``out_dim`` = 2 ffn rows) and tile T holds gate rows 16 T .. 16 T + 15
    and then up rows 16 T .. 16 T + 15 (the rows a warp of the fused gate/up GEMV takes)."""
    ub, tu, units = UNIT_BYTES[wtype], TILE_UNIT[wtype], in_dim // 256
    rows = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if in_dim % 256 or rows.size != out_dim * units * ub:
        raise ValueError(f"tile_major: {wtype} {out_dim} x {in_dim} needs in_dim a multiple of 256 and "
                         f"{out_dim * units * ub} bytes, got in_dim {in_dim} and {rows.size} bytes")
    rows = rows.reshape(out_dim, units, ub)
    if tu != ub:
        rows = np.concatenate([rows, np.zeros((out_dim, units, tu - ub), np.uint8)], axis=2)
        ub = tu
    if glu:
        if out_dim % 2:
            raise ValueError(f"tile_major: a gate/up weight holds 2 ffn rows, got {out_dim}")
        half = TILE_ROWS // 2
        ffn = out_dim // 2
        n_t = -(-ffn // half)
        pad = np.zeros((2, n_t * half, units, ub), np.uint8)
        pad[0, :ffn], pad[1, :ffn] = rows[:ffn], rows[ffn:]
        tiles = pad.reshape(2, n_t, half, units, ub).transpose(1, 3, 0, 2, 4)  # (T, u, gate/up, row, bytes)
    else:
        n_t = -(-out_dim // TILE_ROWS)
        pad = np.zeros((n_t * TILE_ROWS, units, ub), np.uint8)
        pad[:out_dim] = rows
        tiles = pad.reshape(n_t, TILE_ROWS, units, ub).transpose(0, 2, 1, 3)  # (T, u, row, bytes)
    return np.ascontiguousarray(tiles).reshape(-1)


def _mod(k: KernelBuilder, j: Reg, n: int) -> Reg:
    return k.and_(j, n - 1) if n & (n - 1) == 0 else k.rem(j, n)


def _div(k: KernelBuilder, j: Reg, n: int) -> Reg:
    return k.shr(j, n.bit_length() - 1) if n & (n - 1) == 0 else k.div(j, n)


def _digits(k: KernelBuilder, v: Reg, f: Reg) -> Reg:
    """The four signed base-256 digits of X = round(v f) (|v f| < 2**30) as the bytes of a word.

    v f is exact (f is a power of two) and rounds to X exactly (``cvt.rni``). Balanced digits (each in
    [-128, 127]) are the bytes of X + 0x80808080, each minus 128: that word xor 0x80808080. Four
    instructions (a float-only rounding in two halves took eight; the conversion unit's quarter rate
    is far from a limit here)."""
    x = k.cvt(k.mul(v, f), "s32", rounding="rni")
    return k.xor(k.add(k.bitcast(x, "u32"), 0x80808080), 0x80808080)


def _x_lane_constants(k: KernelBuilder, wtype: str, lane: Reg) -> dict:
    """Where lane l's two quads of a unit's x (values 4l.. and 128 + 4l..) go in an x slot.

    Q8_0: chunk c = q / 8 (32 values), u = q % 8, word [pair c / 2][t = u % 4][c % 2][hi = u / 4] of
    each plane (the B fragments of lane (g, t) are then one 16-byte load per pair); the second quad is
    128 bytes on. Q4_K: see below. Q6_K: quad q = 32 n + 8 i + 4 lh + t (value 128 n + 32 i + 16 lh + 4 t.., i.e. sub-block
    8 n + 2 i + lh) feeds MMA m = 4 n + 2 (i % 2) + lh as column class i / 2, at word
    [m / 2][column 4 (i / 2) + digit][t][m % 2][i / 2] (see _unit_q6k)."""
    if wtype == "Q6_K":
        cls = k.shr(lane, 4)
        woff = k.add(k.add(k.shl(k.and_(k.shr(lane, 3), 1), 9), k.mul(cls, 260)),
                     k.add(k.shl(k.and_(lane, 3), 4), k.shl(k.and_(k.shr(lane, 2), 1), 3)))
        return {"woff": woff, "lane0": k.setp("eq", lane, 0), "plane": 64, "half": 1024}
    c, u = k.shr(lane, 3), k.and_(lane, 7)
    if wtype == "Q4_K":
        # quad q = 16 j + 8 c + 4 h + t (pair j, class c) feeds MMA 2 j + h, lane t, as column class c:
        # digit d at word [j][4 c + d][t][h] (no zero words: _unit_q4k masks them in), the 8 sums of x
        # per 32 values after the fragments
        woff = k.add(k.add(k.shl(k.shr(lane, 4), 8), k.shl(k.and_(c, 1), 7)),
                     k.add(k.shl(k.and_(lane, 3), 3), k.shl(k.and_(k.shr(lane, 2), 1), 2)))
        return {"woff": woff, "lane0": k.setp("eq", lane, 0), "plane": 32, "half": 512,
                "sum_off": k.add(k.shl(c, 2), XSUM[wtype]), "sum_lane": k.setp("eq", u, 0)}
    woff = k.add(k.add(k.shl(k.shr(c, 1), 6), k.shl(k.and_(u, 3), 4)),
                 k.add(k.shl(k.and_(c, 1), 3), k.shl(k.shr(u, 2), 2)))
    return {"woff": woff, "lane0": k.setp("eq", lane, 0), "plane": PLANE, "half": 128}


def _load_x(k: KernelBuilder, x: Reg, lane16: Reg, unit: Reg | int, valid: Reg | None, into: list | None = None) -> list:
    """Lane l's 8 values of x unit ``unit`` (256 values): quads l and 32 + l (``into``: into Vars)."""
    base = k.add(x, k.add(k.mul_wide(unit, 1024) if isinstance(unit, Reg) else unit * 1024, lane16))
    out = []
    for h in range(2):
        dst = into[4 * h:4 * h + 4] if into is not None else None
        v = k.load("global", "f32", base, 512 * h, vec=4, pred=valid, into=dst,
                   other=None if into is not None or valid is None else 0.0)
        out += list(v)
    return out


def _convert_x(k: KernelBuilder, wtype: str, vals: list, slot: Reg, xc: dict) -> None:
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
        if wtype == "Q4_K":
            sm = k.warp_reduce(k.add(k.add(v[0], v[1]), k.add(v[2], v[3])), "add", width=8)
            k.store("shared", "f32", k.add(slot, xc["sum_off"]), sm, 16 * h, pred=xc["sum_lane"])


def build(m: Module, wtype: str, in_dim: int, mtiles: int, kparts: int, stages: int, bias: bool,
          residual: bool, tiles: int = 1, bulk: bool = False, glu: bool = False, tiled: bool = False,
          solo: bool = False) -> KernelBuilder:
    lay = layout(wtype, in_dim, mtiles, kparts, stages, tiles, tiled, solo)
    if glu and (tiles != 2 or bias or residual):
        raise ValueError("glu needs tiles=2 (a warp's 16 gate rows and their 16 up rows) and no bias/residual")
    if bulk and m.target.compute_capability < (9, 0):
        raise ValueError(f"bulk copies need sm_90 or newer, the target is {m.target}")
    if bulk and wtype == "Q6_K" and not tiled:
        raise ValueError("Q6_K rows (210-byte blocks) are not 16-byte aligned: no bulk copies unless tile-major")
    U, n_units, warps, R = lay["stride"], lay["per_warp"], lay["warps"], lay["rows"]  # U: a staged row's bytes
    params = gemv_params(bias, residual)
    name = (f"gemv_mma_{wtype.lower()}_k{in_dim}_m{mtiles}_p{kparts}_s{stages}" + (f"_t{tiles}" if tiles > 1 else "")
            + ("_bulk" if bulk else "") + ("_tiled" if tiled else "") + ("_solo" if solo else "") + ("_glu" if glu else "")
            + ("_bias" if bias else "") + ("_res" if residual else ""))
    k = m.kernel(name, params)
    k.max_threads = 32 * warps  # .maxntid: ptxas keeps the registers within what the whole CTA can get
    k.meta.update(block=32 * warps, rows_per_cta=(16 if glu else R) * mtiles, dyn_smem=lay["launch_smem"],
                  row_bytes=lay["row_bytes"], tiled=tiled)
    out_dim = k.param("out_dim")
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    row_base = _first_output(k, warp, mtiles, 16 if glu else R)
    kp = k.div(warp, mtiles) if kparts > 1 else None
    last = k.sub(out_dim, 1)

    def weight_row(r: Reg) -> Reg:
        """The weight row of the warp's row ``r`` (rows past the end re-read the last one, not stored);
        with ``glu`` rows 0..15 are gate rows and 16..31 the up rows of the same outputs."""
        if not glu:
            return k.min(k.add(row_base, r), last)
        o = k.min(k.add(row_base, k.and_(r, 15)), last)
        return k.mad(k.shr(r, 4), out_dim, o)
    smem = k.dynamic_shared()
    stage_bytes = R * U
    ring = k.add(smem, k.add(k.mul(warp, stages * stage_bytes), lay["off"]["ring"]))
    w = k.global_ptr("w")
    # the weights' copies: each miss fetches the whole 128-byte line (a staged row of a unit is 144-240
    # bytes at any offset, and the K parts of a tile read the neighbouring units soon after), and the
    # bytes, read once, are evicted first. On an H200, 4096 x 14336: Q4_K 11.1 -> 10.5 us, Q6_K 16.3 ->
    # 15.2, Q8_0 17.4 -> 16.8; 4096 x 57344 Q4_K 39.1 -> 35.6 (64 or 256 bytes: no gain, or slower)
    # (tile-major bulk copies too: 4096 x 14336 Q4_K 9.9 -> 9.75 us, Q6_K 14.3 -> 14.05)
    wpol = k.create_policy("evict_first") if not bulk or tiled else None
    hints = dict(prefetch="128B", policy=wpol)
    k.global_ptr("y")
    # the warp's units of a row are kp, kp + kparts, kp + 2 kparts, ...: at any time the K parts of a
    # tile read neighbouring units, i.e. kparts * U contiguous bytes of each row
    wbase = w if kp is None or wtype == "Q6_K" else k.add(w, k.mul_wide(kp, U))
    kp0 = kp if kp is not None else 0

    def unit_of(j: Reg | int) -> Reg | int:  # the row's unit index of the warp's j-th unit
        if isinstance(j, int) and kp is None:
            return j * kparts
        return k.mad(j, kparts, kp0) if isinstance(j, Reg) else k.add(kp0, j * kparts)

    if tiled:
        # W tile-major (tile_major): the warp's R rows of unit u are R U contiguous bytes of tile T, the
        # tile of its first row (glu: of its first output, 16 a tile). Stored like that, each stage is one
        # stream of bytes, and the launch reads whole tiles side by side: 4096 x 14336 Q4_K 9.7 us against
        # 10.5 for the same kernel on GGUF rows, where a stage is R pieces of U bytes, 8 U apart... (H200)
        # (warps whose rows all lie past out_dim read the last rows instead, and store nothing)
        rt = 16 if glu else R
        first = k.min(row_base, k.and_(last, (0xFFFFFFFF // rt) * rt))
        tile0 = k.add(w, k.mul_wide(k.mul(k.shr(first, 4 if glu else 5), lay["units"]), TILE_ROWS * U))
        if not glu and R < TILE_ROWS:  # 16-row warps: the second half of a tile starts 16 U in
            tile0 = k.add(tile0, k.cvt(k.mul(k.and_(first, TILE_ROWS - 1), U), "u64"))

        def tile_src(j: Reg | int) -> Reg:
            u = unit_of(j)
            return k.add(tile0, k.mul_wide(u, TILE_ROWS * U) if isinstance(u, Reg) else u * TILE_ROWS * U)
    if bulk:
        # sm_90 ``bulk``: lane r < R copies row r's U bytes of a unit with one bulk copy (the tensor
        # memory accelerator: no per-16-byte instructions, no load-store queue); lane 0 announces the
        # stage's bytes to the slot's mbarrier, whose phase completes when they have all landed. Copies
        # of 144-272 bytes are small for it: measured faster when a warp has only a unit or two to
        # stream (4096 x 4096 Q4_K 4.5 us vs 5.4), slower on long rows (4096 x 14336 Q4_K 18.7 vs 11.5)
        mbar = k.add(smem, k.add(k.mul(warp, 8 * stages), lay["off"]["mbar"]))
        lane0 = k.setp("eq", lane, 0)
        for i in range(stages):
            k.mbarrier_init(k.add(mbar, 8 * i) if i else mbar, 1, pred=lane0)
        k.fence_mbarrier_init()
        k.bar_warp_sync()
        row_lane = k.setp("lt", lane, R)
        src_lane = k.add(wbase, k.mul_wide(weight_row(lane), lay["row_bytes"]))
        dst_lane = k.add(ring, k.mul(lane, U))

        def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
            slot = _mod(k, j, stages) if isinstance(j, Reg) else j % stages
            mb = k.add(mbar, k.shl(slot, 3)) if isinstance(slot, Reg) else k.add(mbar, 8 * slot)
            k.mbarrier_expect_tx(mb, R * U, pred=k.both(lane0, valid))
            if tiled:  # the whole stage, one copy
                k.cp_async_bulk(k.add(ring, slot_off) if isinstance(slot_off, Reg) or slot_off else ring, tile_src(j),
                                R * U, mb, pred=k.both(lane0, valid), policy=wpol)
                return
            src = k.add(src_lane, k.mul_wide(j, U * kparts) if isinstance(j, Reg) else j * U * kparts)
            dst = k.add(dst_lane, slot_off) if isinstance(slot_off, Reg) or slot_off else dst_lane
            k.cp_async_bulk(dst, src, U, mb, pred=k.both(row_lane, valid))

        def wait(j: Reg) -> None:
            slot = _mod(k, j, stages)
            k.mbarrier_wait(k.add(mbar, k.shl(slot, 3)), k.and_(_div(k, j, stages), 1))  # the slot's use count
            k.bar_warp_sync()  # (the x slot the warp's lanes wrote last step)
    elif tiled:
        # 16-byte chunk c = lane + 32 q of the stage, from the tile's bytes to the same offset in the ring
        nchunks = R * U // 16
        lane16w = k.cvt(k.shl(lane, 4), "u64")
        dst0 = k.add(ring, k.shl(lane, 4))
        oks = [k.setp("lt", k.add(lane, 32 * q), nchunks) if (q + 1) * 32 > nchunks else None
               for q in range(-(-nchunks // 32))]

        def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
            src = k.add(tile_src(j), lane16w)
            dst = k.add(dst0, slot_off) if isinstance(slot_off, Reg) or slot_off else dst0
            for q, ok in enumerate(oks):
                k.cp_async(dst, src, pred=k.both(ok, valid), dst_offset=512 * q, src_offset=512 * q, **hints)
            k.cp_async_commit()
    elif wtype == "Q6_K":
        # unit u of a row is 210 u.. (phase p = 210 u % 16 = 2 (u % 8), the same for all rows as rows are
        # 16-byte multiples): the 14 chunks from 210 u - p, chunk c = lane + 32 q of the unit being row
        # c / 14, col c % 14, at row * 240 + 16 col in the ring. The last unit of a row has p = 14, so its
        # chunks end exactly at the row's end: nothing past the tensor is read. (Lane pairs copying a row
        # each, 16 rows x 32 bytes per instruction with immediate offsets, were much slower: 23 us vs 17
        # at 4096 x 14336; each copy instruction is best kept to few, contiguous rows)
        # The chunks' offsets are kept as 32-bit offsets from the warp's first row (3 registers per
        # copy otherwise: 178 registers at 32 rows, spills on sm_80): < 32 row_bytes, or with glu up
        # to (out_dim + 16) row_bytes: see q6k_glu_offsets_fit.
        nchunks = R * Q6K_CHUNKS
        chunks = []
        for q in range(-(-nchunks // 32)):
            c = k.add(lane, 32 * q) if q else lane
            row = k.div(c, Q6K_CHUNKS)
            col16 = k.shl(k.sub(c, k.mul(row, Q6K_CHUNKS)), 4)
            off = k.add(k.mul(k.sub(weight_row(row), row_base), lay["row_bytes"]), col16)  # may be < 0: s32
            chunks.append((k.bitcast(off, "s32"), k.add(ring, k.add(k.mul(row, U), col16)),
                           k.setp("lt", c, nchunks) if (q + 1) * 32 > nchunks else None))
        wrow = k.add(w, k.mul_wide(row_base, lay["row_bytes"]))

        def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
            u = unit_of(j)
            u = u if isinstance(u, Reg) else k.mov(u, "u32")
            base = k.add(wrow, k.cvt(k.sub(k.mul(u, 210), k.shl(k.and_(u, 7), 1)), "u64"))
            for off, dst, ok in chunks:
                pred = k.both(ok, valid)
                k.cp_async(k.add(dst, slot_off) if isinstance(slot_off, Reg) or slot_off else dst,
                           k.add(base, k.cvt(off, "s64")), pred=pred, **hints)
            k.cp_async_commit()
    else:
        # 16-byte chunk c = lane + 32 q of a unit is row c / (U / 16), col c % (U / 16), copied with
        # cp.async; in the ring it lands at 16 c (rows of U bytes, back to back)
        cpr = U // 16
        nchunks = R * cpr
        srcs = []
        for q in range(-(-nchunks // 32)):
            c = k.add(lane, 32 * q) if q else lane
            row = k.div(c, cpr)
            off = k.add(k.mul_wide(weight_row(row), lay["row_bytes"]), k.cvt(k.shl(k.sub(c, k.mul(row, cpr)), 4), "u64"))
            srcs.append((off, k.setp("lt", c, nchunks) if (q + 1) * 32 > nchunks else None))
        dst0 = k.add(ring, k.shl(lane, 4))

        def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
            base = k.add(wbase, k.mul_wide(j, U * kparts) if isinstance(j, Reg) else j * U * kparts)
            dst = k.add(dst0, slot_off) if isinstance(slot_off, Reg) or slot_off else dst0
            for q, (off, ok) in enumerate(srcs):
                pred = k.both(ok, valid)
                k.cp_async(dst, k.add(base, off), pred=pred, dst_offset=512 * q, **hints)
            k.cp_async_commit()

    if not bulk:
        def wait(j: Reg) -> None:  # (cp.async groups: the oldest of the stages in flight has landed)
            k.cp_async_wait_group(stages - 1)
            k.bar_warp_sync()

    for j in range(stages):  # the first units, before waiting for the kernel that writes x
        if j < n_units:
            issue(j, j * stage_bytes, None)
        elif not bulk:
            k.cp_async_commit()  # empty groups keep the count uniform
    k.grid_dependency_wait()

    # x, unit by unit, converted by each warp for itself one unit ahead of its use (loaded two ahead)
    x = k.global_ptr("x")
    lane16 = k.cvt(k.shl(lane, 4), "u64")
    xc = _x_lane_constants(k, wtype, lane)
    XS = XSLOT[wtype]
    xbuf = k.add(smem, k.add(k.mul(warp, 2 * XS), lay["off"]["xbuf"]))
    if wtype == "Q6_K":  # the B words that stay zero (lane (g, t): word [m / 2][g][t][m % 2][g < 4])
        zero = k.add(xbuf, k.add(k.shl(lane, 4), k.selp(4, 0, k.setp("lt", lane, 16), "u32")))
        for off in (sl * XS + 512 * mp + 8 * m2 for sl in range(2) for mp in range(4) for m2 in range(2)):
            k.store("shared", "u32", zero, k.mov(0, "u32"), off)
    # x of units 0, 1 and 2 requested together before unit 0's is converted; those of units j + 1 and
    # j + 2 stay in flight in registers: odd units in xregs[1], even ones in xregs[0] (the loop is
    # unrolled by two so no register is copied while its load is still in flight)
    x0 = _load_x(k, x, lane16, unit_of(0), None)
    xregs = [[k.var("f32", 0.0) for _ in range(8)] for _ in range(2)]
    for jj in (1, 2):
        if jj < n_units:
            _load_x(k, x, lane16, unit_of(jj), None, into=xregs[jj % 2])
    _convert_x(k, wtype, x0, xbuf, xc)
    g, t = k.shr(lane, 2), k.and_(lane, 3)
    TR = TABLE_ROW[wtype]
    ctx = {
        "g": g, "R": R, "tiles": tiles, "U": U,
        "zeros": [k.mov(0, "s32")] * 4,
        # the per-unit table, row r at r * TABLE_ROW, filled by lane r (< R)
        "table": k.add(smem, k.add(k.mul(warp, R * TR), lay["off"]["table"])), "TR": TR,
        # (32-row warps: every lane has a row; no branch, so the table's work can mix with the rest)
        "t_lane": k.setp("lt", lane, R) if R < 32 else None,
        "row_stage": k.mul(lane, U),  # lane r's row in a staged unit
        "t4": k.shl(t, 2),
    }
    ctx["t_mine"] = k.add(ctx["table"], k.mul(lane, TR))
    ctx["t_g"] = k.add(ctx["table"], k.mul(g, TR))  # + 8 * TR * (2 r + h): row 16 r + 8 h + g
    if wtype == "Q8_0":  # lane (g, t)'s B fragments: plane g (g < 4; zero columns past), word group t
        ctx["b_ok"] = k.setp("lt", g, PARTS)
        ctx["b_lane"] = k.add(k.mul(g, PLANE), k.shl(t, 4))
    elif wtype == "Q6_K":
        ctx["minus32"] = [k.mov(0xE0E0E0E0, "u32")] * 4  # -32 in every byte of A
        ctx["b_q6"] = k.add(k.shl(g, 6), k.shl(t, 4))  # lane (g, t)'s B words: [m / 2][g][t][m % 2][2]
        ctx["t_gc"] = k.add(ctx["t_g"], k.shl(k.shr(t, 1), 5))  # its scales: class t / 2 of row g
        ctx["a_lane"] = k.add(k.mul(g, U), ctx["t4"])  # its A words: row g, bytes 4t + 16 m'
    if wtype == "Q4_K":
        ctx["t_gc"] = k.add(ctx["t_g"], k.shl(k.shr(t, 1), 4))  # lane (g, t)'s scales: class t / 2 of row g
        ctx["t_gd"] = k.add(ctx["t_g"], k.add(k.shl(k.shr(t, 1), 2), 32))  # and its d / f
        ctx["b_q4"] = k.add(k.shl(g, 5), k.shl(t, 3))  # its B words: [j][g][t][h]
        lo_cols = k.setp("lt", g, 4)  # columns 0..3 (class 0: B's k < 16), else 4..7 (k >= 16)
        ctx["b_mask"] = (k.selp(0xFFFFFFFF, 0, lo_cols, "u32"), k.selp(0, 0xFFFFFFFF, lo_cols, "u32"))
        ctx["ldm"] = k.add(k.mul(k.add(k.and_(lane, 7), k.shl(k.and_(k.shr(lane, 3), 1), 3)), U),
                           k.shl(k.shr(lane, 4), 4))
    acc = [[k.var("f32", 0.0) for _ in range(4)] for _ in range(tiles)]  # [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1]
    minacc = k.var("f32", 0.0) if wtype == "Q4_K" else None  # lane r: row r's min term

    def step(j: Reg) -> None:
        """Unit j: wait for its weights, compute, refill the ring slot, convert unit j + 1's x (in the
        registers of its parity), start loading unit j + 3's into them."""
        slot_off = k.mul(_mod(k, j, stages), stage_bytes)
        sbase = k.add(ring, slot_off)
        xslot = k.add(xbuf, k.mul(k.and_(j, 1), XS))
        wait(j)
        if wtype == "Q4_K":
            _unit_q4k(k, ctx, sbase, xslot, acc, minacc)
        elif wtype == "Q6_K":
            u = unit_of(j)
            _unit_q6k(k, ctx, sbase, xslot, acc, None if tiled else k.shl(k.and_(u, 7), 1))
        else:
            _unit_q8_0(k, ctx, sbase, xslot, acc)
        k.bar_warp_sync()  # every lane is done with the ring slot and the x slot: refill them
        if bulk:
            k.fence_proxy_async()  # (the reads above come before the bulk copy's writes)
        nxt = k.add(j, stages)
        issue(nxt, slot_off, k.setp("lt", nxt, n_units))
        # unit j + 1's x into its slot. Q6_K: without a branch (past the last unit the registers hold
        # stale x, converted into a slot no unit reads): 4096 x 14336 16.6 us vs 17.4 with it; Q4_K the
        # other way round (11.3-11.4 us with the branch, 11.6-11.7 without)
        j1 = k.add(j, 1)
        regs = xregs[parity[0]]
        with k.if_(k.setp("lt", j1, n_units)) if wtype != "Q6_K" else contextlib.nullcontext():
            _convert_x(k, wtype, list(regs), k.add(xbuf, k.mul(k.and_(j1, 1), XS)), xc)
        j3 = k.add(j, 3)
        _load_x(k, x, lane16, unit_of(j3), k.setp("lt", j3, n_units), into=regs)
        parity[0] ^= 1

    parity = [1]  # unit j + 1 of the first step is odd
    if n_units >= 2:
        with k.loop(0, n_units - n_units % 2, 2) as j:
            step(j)
            step(k.add(j, 1))
    if n_units % 2:
        step(k.mov(n_units - 1, "u32"))
    if not bulk:
        k.cp_async_wait_all()

    # --- row sums: digit columns weighted 1, 256 (lane t = 0), 65536 and 2**24 (t = 1); Q6_K's
    # columns 4..7 (lanes t = 2, 3) are the same digits of its second sub-block of each MMA
    tid = k.tid()
    lane = k.and_(tid, 31)
    g, t = k.shr(lane, 2), k.and_(lane, 3)
    tt = k.and_(t, 1) if wtype != "Q8_0" else t
    t_is0, t_is1 = k.setp("eq", tt, 0), k.setp("eq", tt, 1)
    w0 = k.selp(1.0, k.selp(65536.0, 0.0, t_is1, "f32"), t_is0, "f32")
    w1 = k.selp(256.0, k.selp(16777216.0, 0.0, t_is1, "f32"), t_is0, "f32")
    sums = []  # rows g, g + 8, 16 + g, 24 + g
    for r in range(tiles):
        for a0, a1 in ((acc[r][0], acc[r][1]), (acc[r][2], acc[r][3])):
            s = k.fma(a1, w1, k.mul(a0, w0))
            s = k.add(s, k.shfl("bfly", s, 1))
            sums.append(k.add(s, k.shfl("bfly", s, 2)))
    if minacc is not None:  # lane r holds row r's min term
        sums = [k.sub(sm, k.shfl("idx", minacc, k.add(g, 8 * i) if i else g)) for i, sm in enumerate(sums)]
    _epilogue(k, lay, mtiles, kparts, sums, smem, tid, lane, g, t, out_dim, bias, residual, glu)
    k.ret()
    return k


def _lanes_with_rows(k: KernelBuilder, c: dict):
    """The lanes r < R (one per row of the warp) only: a branch for 16-row warps, nothing for 32."""
    return k.if_(c["t_lane"]) if c["t_lane"] is not None else contextlib.nullcontext()


def _unit_q4k(k: KernelBuilder, c: dict, sbase: Reg, xslot: Reg, acc: list, minacc) -> None:
    """One Q4_K super-block of the warp's rows (staged at ``sbase``).

    Block: d, dmin (f16), 12 bytes of 6-bit scales and mins, qs (128 bytes: byte 32 j + l holds value
    64 j + l of sub-block 2 j in its low nibble and value 64 j + 32 + l of sub-block 2 j + 1 in its
    high nibble). MMA 2 j + h (h = 0, 1) takes values 16 h .. 16 h + 15 of sub-block 2 j (low nibbles,
    class 0) as k 0..15 and the same values of sub-block 2 j + 1 (high nibbles, class 1) as k 16..31:
    both come from one staged word per lane and row, the high nibbles masked in place (16 times the
    code, as unsigned bytes) with no shift. B's columns 0..3 are the digits of class 0's x (zero at
    k >= 16), 4..7 those of class 1's (zero at k < 16), so lanes t = 0, 1 receive sub-block 2 j's sums
    and t = 2, 3 those of 2 j + 1; the two halves h chain through the accumulator and each lane weights
    its sums by one integer scale (class 1's 1 / 16 goes into its d)."""
    U, TR = c["U"], c["TR"]
    # the table: lane r unpacks row r's scales by class ([0, 2, 4, 6][1, 3, 5, 7] as int32), d / f for
    # class 0 and d / 16 f for class 1, and adds its min terms
    with _lanes_with_rows(k, c):
        dm, s0, s1, s2 = k.load("shared", "u32", k.add(sbase, c["row_stage"]), vec=4)
        sc_lo = k.and_(s0, 0x3F3F3F3F)
        sc_hi = k.or_(k.and_(s2, 0x0F0F0F0F), k.and_(k.shr(s0, 2), 0x30303030))
        mn_lo = k.and_(s1, 0x3F3F3F3F)
        mn_hi = k.or_(k.and_(k.shr(s2, 4), 0x0F0F0F0F), k.and_(k.shr(s1, 2), 0x30303030))
        for o, sel in ((0, 0x6420), (16, 0x7531)):
            cls = k.prmt(sc_lo, sc_hi, sel)
            k.store("shared", "u32", c["t_mine"], [k.prmt(cls, 0, 0x4440 | i) for i in range(4)], o)
        d_h, dmin_h = k.unpack_b32(dm)
        inv_f = k.load("shared", "f32", xslot, INVF["Q4_K"])  # the unit's x digits are x f
        dq = k.mul(k.cvt(Reg(d_h.name, ql._f16), "f32"), inv_f)
        k.store("shared", "f32", c["t_mine"], [dq, k.mul(dq, 0.0625)], 32)
        sx = [v for o in (0, 16) for v in k.load("shared", "f32", xslot, XSUM["Q4_K"] + o, vec=4)]
        dmin = k.cvt(Reg(dmin_h.name, ql._f16), "f32")
        msum = None
        for i in range(8):  # dmin m_j first: sum_j m_j sum(x) alone could overflow where the result does not
            mf = k.add(k.bitcast(k.prmt(mn_lo if i < 4 else mn_hi, 0x4B000000, 0x7440 | (i % 4)), "f32"), -8388608.0)
            mf = k.mul(mf, dmin)
            msum = k.mul(mf, sx[i]) if msum is None else k.fma(mf, sx[i], msum)
        k.assign(minacc, k.add(minacc, msum))  # (one update of the loop-carried register: 8 cost 30% at 14336)
    k.bar_warp_sync()
    bfr = []  # MMAs 2j, 2j+1: B words (b0, b1) of half 0, then of half 1; the zero half masked in
    for j in range(4):
        w0, w1 = k.load("shared", "u32", k.add(xslot, c["b_q4"]), 256 * j, vec=2)
        bfr.append([k.and_(w, m) for w in (w0, w1) for m in c["b_mask"]])
    for r in range(c["tiles"]):
        # lane (g, t)'s scales (class t / 2 of rows g and g + 8, one per j); |sums| <= 4 * 32 * 240 * 128 * 63
        scl = [k.load("shared", "u32", c["t_gc"], (16 * r + h) * TR, vec=4) for h in (0, 8)]
        ints = [None] * 4
        for j in range(4):
            regs = k.ldmatrix_x4(k.add(sbase, c["ldm"]), 16 * r * U + 16 + 32 * j)
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


def _sext_byte(k: KernelBuilder, word: Reg, b: int) -> Reg:
    """Byte ``b`` of ``word`` sign-extended to 32 bits (one ``prmt`` in sign-replicate mode)."""
    s = 8 | b
    return k.prmt(word, 0, (s << 12) | (s << 8) | (s << 4) | b)


def _unit_q6k(k: KernelBuilder, c: dict, sbase: Reg, xslot: Reg, acc: list, p: Reg | None) -> None:
    """One Q6_K block of the warp's rows, staged at ``sbase`` + 240 r + ``p`` (row r; p = 0, 2, .., 14),
    or with ``p`` None (tile-major weights) at ``sbase`` + 212 r, word-aligned.

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
    S, TR = c["U"], c["TR"]
    if p is None:  # word-aligned rows
        row_w, a_w = c["row_stage"], c["a_lane"]
    else:
        sh = k.shl(k.and_(p, 2), 3)  # 0 or 16 bits
        pw = k.and_(p, 12)  # the block's first word, p rounded down to 4
        row_w, a_w = k.add(c["row_stage"], pw), k.add(c["a_lane"], pw)

    def realign(lo: Reg, hi: Reg) -> Reg:
        return lo if p is None else k.shf("r", lo, hi, sh)
    with _lanes_with_rows(k, c):  # lane r: row r's scales (table [class 0: m 0..7][class 1: m 0..7]) and d / f
        row = k.add(sbase, row_w)
        ws = [k.load("shared", "u32", row, 192 + 4 * i) for i in range(4 if p is None else 5)]
        sw = [realign(ws[i], ws[i + 1] if i < 3 or p is not None else None) for i in range(4)]  # scales 4i..4i+3
        if p is None:
            d = ql.lds_f16(k, row, 208)
        else:
            d = k.cvt(Reg(k.unpack_b32(realign(ws[4], ws[4]))[0].name, ql._f16), "f32")
        scs = [[_sext_byte(k, w_, b) for b in range(4)] for w_ in sw]
        for o, i in ((0, 0), (16, 2), (32, 1), (48, 3)):  # class 0: scales 0..3, 8..11; class 1: 4..7, 12..15
            k.store("shared", "u32", c["t_mine"], scs[i], o)
        inv_f = k.load("shared", "f32", xslot, INVF["Q6_K"])  # the unit's x digits are x f
        k.store("shared", "f32", c["t_mine"], k.mul(d, inv_f), 64)
    k.bar_warp_sync()
    bfr = [k.load("shared", "u32", k.add(xslot, c["b_q6"]), 512 * mp, vec=4) for mp in range(4)]
    # -32 times the sums of B over k, per column: the same for every row, so once for the warp's tiles
    offs = [k.mma_s8(c["minus32"], bfr[m >> 1][2 * (m & 1):2 * (m & 1) + 2], c["zeros"]) for m in range(8)]
    a0 = k.add(sbase, a_w)
    for r in range(c["tiles"]):
        words, scales = [], []
        for h in (0, 8):  # rows 16 r + g, 16 r + 8 + g
            ro = (16 * r + h) * S

            def word(mi: int) -> Reg:
                lo = k.load("shared", "u32", a0, ro + 16 * mi)
                return lo if p is None else realign(lo, k.load("shared", "u32", a0, ro + 16 * mi + 4))
            words.append([word(mi) for mi in range(12)])
            scales.append([v for o in (0, 16) for v in k.load("shared", "u32", c["t_gc"], (16 * r + h) * TR + o, vec=4)])
        # codes: bits 0..3 from ql, 4..5 from qh, as one bitwise select (LOP3) each: the qh word is
        # masked once into its bit pairs 0 and 2 (qa) and 1 and 3 (qb), whose shifts leave bits 6, 7 zero
        qab = [[(k.and_(wd[8 + i], 0x33333333), k.and_(wd[8 + i], 0xCCCCCCCC)) for i in range(4)] for wd in words]

        def code(low: Reg, high: Reg) -> Reg:
            return k.or_(k.and_(low, 0x0F0F0F0F), k.and_(high, 0xF0F0F0F0))
        ints = [None] * 4
        for m in range(8):
            n, i0, lh = m >> 2, (m >> 1) & 1, m & 1
            a_lo, a_hi = [], []
            for wd, qh in zip(words, qab):
                qlw, (qa, qb) = wd[m], qh[2 * n + lh]
                a_lo.append(code(qlw, k.shl(qb, 2) if i0 else k.shl(qa, 4)))
                a_hi.append(code(k.shr(qlw, 4), k.shr(qb, 2) if i0 else qa))
            b = bfr[m >> 1][2 * (m & 1):2 * (m & 1) + 2]
            dd = k.mma_s8([a_lo[0], a_lo[1], a_hi[0], a_hi[1]], b, offs[m], a_unsigned=True)
            for nn in range(4):
                sc = k.bitcast(scales[nn // 2][m], "s32")
                ints[nn] = k.mul(dd[nn], sc) if ints[nn] is None else k.mad(dd[nn], sc, ints[nn])
        dg = k.load("shared", "f32", c["t_g"], 16 * r * TR + 64)
        dg8 = k.load("shared", "f32", c["t_g"], (16 * r + 8) * TR + 64)
        for nn, dv in ((0, dg), (1, dg), (2, dg8), (3, dg8)):
            k.assign(acc[r][nn], k.fma(dv, k.cvt(ints[nn], "f32"), acc[r][nn]))


def _exact_float(k: KernelBuilder, i: Reg) -> Reg:
    """float(i) for |i| < 2**22 with two ALU instructions (no conversion unit): the float whose
    mantissa is i + 2**22, minus 1.5 * 2**23."""
    return k.add(k.bitcast(k.add(k.bitcast(i, "u32"), 0x4B400000), "f32"), -12582912.0)


def _unit_q8_0(k: KernelBuilder, c: dict, sbase: Reg, xslot: Reg, acc: list) -> None:
    """Eight Q8_0 blocks (34 bytes each) of the warp's rows (staged at ``sbase``)."""
    U = c["U"]
    # the blocks' scales d / f as floats: lane r converts row r's 8
    with _lanes_with_rows(k, c):
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
            words = []
            for roff, half in ((0, 0), (8 * U, 0), (0, 16), (8 * U, 16)):
                off = 16 * r * U + roff + q + half
                if off % 4 == 0:
                    words.append(k.load("shared", "u32", rg_t, off))
                else:
                    w0 = k.load("shared", "u32", rg_t, off - 2)
                    w1 = k.load("shared", "u32", rg_t, off + 2)
                    words.append(k.prmt(w0, w1, 0x5432))
            d = k.mma_s8(words, b[0:2] if blk % 2 == 0 else b[2:4], c["zeros"])
            sg = k.load("shared", "f32", c["t_g"], 16 * r * c["TR"] + 4 * blk)
            sg8 = k.load("shared", "f32", c["t_g"], (16 * r + 8) * c["TR"] + 4 * blk)
            for n, s in ((0, sg), (1, sg), (2, sg8), (3, sg8)):  # |d| <= 32 * 128 * 128 < 2**22
                k.assign(acc[r][n], k.fma(s, _exact_float(k, d[n]), acc[r][n]))


def _first_output(k: KernelBuilder, warp: Reg, mtiles: int, outs: int) -> Reg:
    """The first output of ``warp``: warps mt = warp % mtiles of a CTA take ``outs`` outputs each."""
    group = k.add(k.mul(k.ctaid(), mtiles), k.rem(warp, mtiles)) if mtiles > 1 else k.ctaid()
    return k.mul(group, outs)


def _epilogue(k, lay, mtiles, kparts, sums, smem, tid, lane, g, t, out_dim, bias, residual, glu) -> None:
    """Store (or, with K parts, combine in order and store) the warp's rows, + bias/residual. ``sums``:
    rows g, g + 8 (, g + 16, g + 24) of the warp, complete in lanes t == 0. With ``glu`` output o of
    the warp is silu(row o) * (row 16 + o)."""
    R = lay["rows"]
    outs = 16 if glu else R
    warp = k.shr(tid, 5)
    row_base = _first_output(k, warp, mtiles, outs)

    def store(val: Reg, r: Reg) -> None:
        off = k.mul_wide(r, 4)
        if bias:
            val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("bias"), off)))
        if residual:
            val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("residual"), off)))
        k.store("global", "f32", k.add(k.global_ptr("y"), off), val)

    t0 = k.setp("eq", t, 0)
    if kparts == 1 and glu:
        for i in range(2):
            rr = k.add(row_base, k.add(g, 8 * i) if i else g)
            with k.if_(k.and_(t0, k.setp("lt", rr, out_dim))):
                store(_silu_mul(k, sums[i], sums[2 + i]), rr)
        return
    if kparts == 1:
        for i, sm in enumerate(sums):
            rr = k.add(row_base, k.add(g, 8 * i) if i else g)
            with k.if_(k.and_(t0, k.setp("lt", rr, out_dim))):
                store(sm, rr)
        return
    red = k.add(smem, lay["off"]["red"])
    mine = k.add(red, k.mul(warp, 4 * R))  # red[kp][mt][R] = red[warp][R]
    with k.if_(t0):
        for i, sm in enumerate(sums):
            k.store("shared", "f32", k.add(mine, k.shl(g, 2)), sm, 32 * i)
    k.bar_sync()
    r = k.add(row_base, lane)
    first = k.setp("lt", warp, mtiles)  # kp == 0
    with k.if_(k.and_(k.and_(first, k.setp("lt", lane, outs)), k.setp("lt", r, out_dim))):
        src = k.add(mine, k.shl(lane, 2))

        def part_sum(extra: int) -> Reg:
            v = k.load("shared", "f32", src, extra)
            for p in range(1, kparts):
                v = k.add(v, k.load("shared", "f32", src, p * mtiles * 4 * R + extra))
            return v

        store(_silu_mul(k, part_sum(0), part_sum(64)) if glu else part_sum(0), r)


def _grid_shapes() -> list[dict]:
    shapes = []
    for wt in MMA_TYPES:
        shapes += [{"wtype": wt, "in_dim": 256, "mtiles": 1, "kparts": 1, "stages": 2},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 2, "kparts": 4, "stages": 4},
                   {"wtype": wt, "in_dim": 14336, "mtiles": 2, "kparts": 4, "stages": 4, "residual": True},
                   {"wtype": wt, "in_dim": 14336, "mtiles": 1, "kparts": 8, "stages": 2, "tiles": 2},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 4, "kparts": 2, "stages": 2, "tiles": 2, "bias": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 8, "kparts": 1, "stages": 2, "tiles": 2, "glu": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 2, "kparts": 4, "stages": 2, "tiles": 2, "glu": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 8, "kparts": 1, "stages": 4, "bias": True},
                   {"wtype": wt, "in_dim": 14336, "mtiles": 1, "kparts": 8, "stages": 2, "tiles": 2, "tiled": True,
                    "solo": True, "residual": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 2, "kparts": 4, "stages": 2, "tiled": True, "bias": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 4, "kparts": 2, "stages": 2, "tiles": 2, "glu": True,
                    "tiled": True}]
    for sh in shapes:
        if sh["wtype"] == "Q6_K" and sh["in_dim"] == 256:
            sh["in_dim"] = 2048
    return shapes


@kernel("gemv_mma", grid=_grid_shapes())
def gemv_mma(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, mtiles: int = 2, kparts: int = 4, stages: int = 4,
             bias: bool = False, residual: bool = False, tiles: int = 1, bulk: bool = False,
             glu: bool = False, tiled: bool = False, solo: bool = False) -> KernelBuilder:
    """y[r] = sum_k W[r, k] x[k] (+ bias[r]) (+ residual[r]) for r < out_dim, W in Q4_K, Q8_0 or Q6_K (in_dim
    a multiple of 2048) blocks, on tensor cores (exact int8 MMAs of the codes with x as four base-256 digits).
    ``tiles``: 16-row MMA tiles per warp (2: each x digit fragment and weight-scale step serves 32 rows);
    ``bulk`` (sm_90; not Q6_K): the ring is filled by bulk copies (one per row and unit) instead of cp.async.
    ``glu`` (tiles=2): W is [gate; up] (2 out_dim rows) and y[o] = silu(gate_o . x) * (up_o . x); each
    warp's 32 rows are 16 gate rows and the 16 up rows of the same outputs.
    ``tiled``: W is stored tile-major (:func:`tile_major`; any in_dim multiple of 256, bulk copies for
    Q6_K too); ``solo``: shared memory raised to ``SOLO_SMEM`` so that one CTA holds an SM.
    Launch: grid ceil(out_dim / (16 tiles mtiles)), block 32 mtiles kparts, meta["dyn_smem"] dynamic shared
    bytes."""
    return build(m, wtype, in_dim, mtiles, kparts, stages, bias, residual, tiles, bulk, glu, tiled, solo)
