"""Geometry of the tensor-core GEMV (:mod:`ptx_gen.kernels.gemv.gemv_mma`): block and stage sizes, the
validated dynamic shared-memory layout of a variant (:func:`layout`), and the tile-major weight
layout (:func:`tile_major`) its ``tiled`` variants read."""

from __future__ import annotations

import numpy as np

UNIT_BYTES = {"Q4_K": 144, "Q8_0": 272, "Q6_K": 210, "Q4_0": 144, "Q4_1": 160, "Q5_0": 176, "Q5_1": 192,
              "Q5_K": 176}  # bytes of 256 values of one row
MMA_TYPES = tuple(UNIT_BYTES)
# the types of 32-value blocks with 4-bit codes (and a fifth bit in qh): two blocks per pair of MMAs, as
# Q4_K's two sub-blocks, their x digits laid out as Q4_K's. Per type: block bytes, the offsets of qs, of
# the min m and of qh (None: none), and the codes' offset (Q4_0: 8, Q5_0: 16; the types with a min have none)
BLOCK32 = {"Q4_0": dict(bs=18, qs=2, m=None, qh=None, zero=8), "Q4_1": dict(bs=20, qs=4, m=2, qh=None, zero=0),
           "Q5_0": dict(bs=22, qs=6, m=None, qh=2, zero=16), "Q5_1": dict(bs=24, qs=8, m=2, qh=4, zero=0)}
Q8_DIGITS = ("Q8_0",)  # x digits as Q8_0 lays them out
PAIRED = ("Q4_K", "Q5_K") + tuple(BLOCK32)  # x digits as Q4_K lays them out (pairs of 32 values per MMA)
MINS = ("Q4_K", "Q5_K", "Q4_1", "Q5_1")  # types with a min term (sums of x per 32 values)
# bytes between two rows of a staged unit: Q6_K copies the 14 aligned 16-byte chunks that cover a
# block at any 2-byte phase into rows of 15 chunks (240 bytes: 60 words, so that the 8 rows of an MMA
# tile read distinct banks)
STRIDE = {**UNIT_BYTES, "Q6_K": 240}
Q6K_CHUNKS = 14
PARTS = 4  # base-256 digits of x
MAX_DYN_SMEM = 227 * 1024
# per warp, two x slots (units j and j + 1). Q8_0: 4 digit planes of 256 bytes, 272 apart (16 mod 128:
# the four planes' B loads hit distinct banks), then 1 / f. Q4_K: its B words in the order the lanes
# load them (1 KiB, see _x_lane_constants), the sums of x per 32 values and 1 / f. Q6_K: the B
# fragments of its 8 MMAs as the lanes load them (see _unit_q6k), half of them zeros, then 1 / f
PLANE = 272
XSUM = {"Q4_K": 1024, "Q8_0": 4 * 272, "Q5_K": 1024, **{wt: 1024 for wt in BLOCK32}}
INVF = {**{wt: XSUM[wt] + 32 for wt in XSUM}, "Q6_K": 2048}
XSLOT = {wt: INVF[wt] + 16 for wt in INVF}
# per warp and row, per unit: 8 int32 sub-block scales and d / f (Q4_K), 8 block scales d / f (Q8_0),
# or 16 int32 sub-block scales (as the two lane classes use them) and d / f (Q6_K); Q5_K as Q4_K; the
# 32-value block types: 8 block scales d / f (even blocks, then odd ones: a lane's four in one load), then
# (Q5_0, Q5_1 on GGUF rows) the 8 blocks' qh words
# (Q5_0, Q5_1: 80 bytes, not 64: the lanes of a group read their row's qh words, and rows 16 words apart
# would put every other row in the same banks)
TABLE_ROW = {"Q4_K": 48, "Q8_0": 48, "Q6_K": 80, "Q5_K": 48, "Q4_0": 48, "Q4_1": 48, "Q5_0": 80, "Q5_1": 80}


def table_row(wtype: str, tiled: bool) -> int:
    """Bytes of a row of the per-unit table: ``TABLE_ROW``, but 48 for tile-major Q5_0 / Q5_1, whose
    lanes read the qh words from the staged unit (lane order), so that the table holds only the scales."""
    return 48 if tiled and wtype in ("Q5_0", "Q5_1") else TABLE_ROW[wtype]


TILE_ROWS = 32  # rows of a tile of tile-major weights (tile_major)
# Tile-major weights of the 32-value block types are re-encoded per row and unit (tile_major): the 8
# blocks' scale fields side by side (d, or d and m: ``sc`` bytes a block) from byte 0, then (Q5_0, Q5_1)
# their 8 qh words with the bits in lane order (see :func:`lane_order_qh`) from byte ``qh``, then their
# 8 runs of 16 qs bytes from byte ``qs``: every field word-aligned and the qs 16-byte aligned (GGUF's
# 18- and 22-byte blocks put half the code words 2 bytes off a word), the unit's size unchanged
TILED_B32 = {"Q4_0": dict(sc=2, qh=None, qs=16), "Q4_1": dict(sc=4, qh=None, qs=32),
             "Q5_0": dict(sc=2, qh=16, qs=48), "Q5_1": dict(sc=4, qh=32, qs=64)}
# bytes of a row's unit in a tile (a tile's unit is TILE_ROWS * TILE_UNIT bytes): as in GGUF
TILE_UNIT = dict(UNIT_BYTES)
# Tile-major Q6_K units hold each 16-row half of a tile as its 16 rows of ``Q6K_ROW`` bytes (ql, qh and
# scales, as in GGUF: every row 16-byte aligned) and then the 16 rows' d (f16), ``Q6K_HALF`` bytes in
# all: no padding, and rows 52 words apart, so that the 8 rows g of an MMA tile, read at word 4 m + t by
# lane (g, t), hit distinct banks (210-byte rows padded to 212 were 53 words apart: 2-3 way conflicts)
Q6K_ROW = 208
Q6K_D = 16 * Q6K_ROW  # the d's offset in a half
Q6K_HALF = 16 * UNIT_BYTES["Q6_K"]
# Q4_1's 160-byte rows (40 words) would put rows g and g + 4 of an MMA tile in the same banks where a
# warp loads one word of a block from 8 rows (rows g of a tile, word t), Q5_1's 192-byte rows (48 words)
# rows g, g + 2, g + 4, g + 6. On GGUF rows they are staged ``ROW_PAD`` bytes apart more than they are
# stored; tile-major rows instead hold their 16-byte chunks permuted (``SWIZZLE``: row r of a tile keeps
# its chunk c at chunk ``c ^ ((r >> shift) & mask)``), which spreads those rows over distinct banks with
# no padding, so that a stage stays one contiguous run of bytes (one bulk copy) and reads as it landed
ROW_PAD = {"Q4_1": 16, "Q5_1": 16}
SWIZZLE = {"Q4_1": (2, 1), "Q5_1": (1, 3)}  # (shift, mask)
# shared memory a ``solo`` CTA asks for, so that no second CTA fits its SM (two need 2 x (this + 1 KiB)
# > 228 KiB): where two CTAs of one long-K launch (or of two launches under programmatic dependent
# launch) share an SM while other SMs idle, the launch takes as long as those two CTAs in a row
SOLO_SMEM = 120 * 1024
# K parts of a CTA (warps sharing its rows, each every kparts-th unit of K; where kparts does not divide
# the units, the first parts take one unit more) and the most warps a CTA has. A 16-warp CTA leaves 128
# registers a thread, which every type's 32-row warps fit (bulk copies) on sm_90
KPARTS = tuple(range(1, 17))
MAX_WARPS = 16
# columns of x (tokens of a small batch) one launch multiplies by W: the weights are read and decoded once
# for all of them, the MMAs and the float work run once per column
MAX_COLS = 8


def q6k_glu_offsets_fit(ffn: int, in_dim: int) -> bool:
    """Whether the Q6_K kernel's 32-bit copy offsets, from a warp's first gate row to the end of the
    last chunk of its last up row (ffn + 16 rows on), stay below 2**31 in a fused gate/up GEMV."""
    return (ffn + 16) * (in_dim // 256 * UNIT_BYTES["Q6_K"]) + 16 * Q6K_CHUNKS < 2**31


def layout(wtype: str, in_dim: int, mtiles: int, kparts: int, stages: int, tiles: int = 1, tiled: bool = False,
           solo: bool = False, cols: int = 1) -> dict:
    """Validated shape and the dynamic shared-memory layout (byte offsets) of a variant (``tiles``:
    16-row MMA tiles per warp; ``tiled``: W tile-major, see :func:`tile_major`; ``solo``: at least
    ``SOLO_SMEM`` bytes, so that one CTA holds an SM; ``cols``: columns of x, 1..MAX_COLS, each with its
    own x slots and K-part sums). ``stride``: bytes between two staged rows of a unit in shared memory;
    ``unit``: a row's bytes of a unit in W (the two differ by ``ROW_PAD`` on GGUF rows)."""
    if cols not in range(1, MAX_COLS + 1):
        raise ValueError(f"cols must be 1..{MAX_COLS}, got {cols}")
    if wtype not in UNIT_BYTES:
        raise ValueError(f"the tensor-core GEMV handles {MMA_TYPES}, not {wtype}")
    if mtiles not in range(1, 9) or kparts not in KPARTS or tiles not in (1, 2) or mtiles * kparts > MAX_WARPS:
        raise ValueError(f"mtiles must be 1..8, kparts 1..16 and tiles 1 or 2, with at most {MAX_WARPS} warps; got "
                         f"mtiles={mtiles}, kparts={kparts}, tiles={tiles}")
    if stages not in (2, 3, 4, 8):
        raise ValueError(f"stages must be 2, 3, 4 or 8, got {stages}")
    if in_dim <= 0 or in_dim % 256 or in_dim // 256 < kparts:
        raise ValueError(f"in_dim must be a positive multiple of 256 with at least kparts = {kparts} units of 256, "
                         f"got {in_dim}")
    if wtype == "Q6_K" and in_dim % 2048 and not tiled:
        # 8 blocks = 1680 bytes = 105 16-byte chunks: then every row starts 16-byte aligned and all rows
        # of a unit share its phase
        raise ValueError(f"the tensor-core Q6_K GEMV needs in_dim a multiple of 2048, got {in_dim}")
    warps = mtiles * kparts
    unit = TILE_UNIT[wtype] if tiled else STRIDE[wtype]  # (tile-major: a stage is its tile's bytes as they are)
    stride = unit + (0 if tiled else ROW_PAD.get(wtype, 0))
    if tiled and wtype == "Q6_K":  # (rows Q6K_ROW apart within each 16-row half, see Q6K_HALF)
        stride = Q6K_ROW
    rows = 16 * tiles
    off = {}
    pos = 0

    def take(name: str, nbytes: int) -> None:
        nonlocal pos
        off[name] = pos
        pos += -(-nbytes // 16) * 16

    take("ring", warps * stages * stage_bytes(rows, stride, unit, tiled))
    take("xbuf", warps * cols * XSLOT[wtype])  # (a warp's slot, a column: the unit's digits while it is used)
    take("table", warps * rows * table_row(wtype, tiled))
    take("red", warps * rows * 4 * cols if kparts > 1 else 0)
    take("mbar", warps * stages * 8)  # sm_90: one mbarrier per ring slot
    if pos > MAX_DYN_SMEM:
        raise ValueError(f"{wtype} rows of {in_dim} with mtiles={mtiles}, kparts={kparts}, stages={stages}, "
                         f"tiles={tiles}" + (f", cols={cols}" if cols > 1 else "") + f" need {pos} bytes of shared "
                         f"memory, more than {MAX_DYN_SMEM}: fewer warps or stages")
    units = in_dim // 256
    return dict(stride=stride, unit=unit, units=units, per_warp=-(-units // kparts), per_warp_min=units // kparts,
                warps=warps, smem=pos, off=off,
                row_bytes=in_dim // 256 * UNIT_BYTES[wtype], rows=rows, launch_smem=max(pos, SOLO_SMEM) if solo else pos)


def stage_bytes(rows: int, stride: int, unit: int, tiled: bool) -> int:
    """Bytes of a warp's stage of ``rows`` rows: its tile's bytes as they are (tile-major), or rows
    ``stride`` bytes apart."""
    return rows * (unit if tiled else stride)


def swizzle_key(wtype: str, row: int) -> int:
    """The chunk permutation key of row ``row`` of a tile (tile-major weights, ``SWIZZLE``; 0 where the
    type has none): the row keeps logical byte ``B`` of a unit at ``B ^ (16 key)``."""
    if wtype not in SWIZZLE:
        return 0
    shift, mask = SWIZZLE[wtype]
    return (row >> shift) & mask


def _swizzle_rows(tiles: np.ndarray, wtype: str) -> np.ndarray:
    """``tiles`` (..., TILE_ROWS rows, unit bytes) with each row's 16-byte chunks permuted (``SWIZZLE``)."""
    if wtype not in SWIZZLE:
        return tiles
    nch = tiles.shape[-1] // 16
    chunks = tiles.reshape(*tiles.shape[:-1], nch, 16)
    out = np.empty_like(chunks)
    for r in range(TILE_ROWS):
        key = swizzle_key(wtype, r)
        out[..., r, np.arange(nch) ^ key, :] = chunks[..., r, :, :]
    return out.reshape(tiles.shape)


def lane_order_qh(qh: np.ndarray) -> np.ndarray:
    """A 32-value block's qh word (bit v: the fifth bit of value v) with its bits in lane order: value
    ``16 h + 4 t + i`` (h, i < 2, 4; t < 4) at bit ``8 i + 4 h + t``. Then the fifth bits of any 4
    consecutive values 4 t'.. (a code word's low or high nibbles) are one byte apart, at bit
    ``s = 4 h + t`` of each byte: one shift (or rotation) and one mask put them at bit 4 (or 6) of
    their bytes, where GGUF's order needs a spreading multiply."""
    qh = np.asarray(qh, dtype=np.uint32)
    out = np.zeros_like(qh)
    for v in range(32):
        h, t, i = v >> 4, (v >> 2) & 3, v & 3
        out |= ((qh >> np.uint32(v)) & np.uint32(1)) << np.uint32(8 * i + 4 * h + t)
    return out


def _repack_b32(units: np.ndarray, wtype: str) -> np.ndarray:
    """``units`` (..., 8 GGUF blocks of ``wtype``) re-encoded as :data:`TILED_B32` lays them out."""
    f, tb = BLOCK32[wtype], TILED_B32[wtype]
    lead = units.shape[:-1]
    blocks = units.reshape(*lead, 8, f["bs"])
    parts = [blocks[..., :tb["sc"]].reshape(*lead, 8 * tb["sc"])]
    if f["qh"] is not None:
        qh = np.ascontiguousarray(blocks[..., f["qh"]:f["qh"] + 4]).view("<u4")[..., 0]
        parts.append(lane_order_qh(qh).astype("<u4").view(np.uint8).reshape(*lead, 32))
    parts.append(blocks[..., f["qs"]:f["qs"] + 16].reshape(*lead, 128))
    return np.concatenate(parts, axis=-1)


def tile_major(raw: np.ndarray, wtype: str, out_dim: int, in_dim: int, glu: bool = False) -> np.ndarray:
    """W's bytes (GGUF rows, ``out_dim`` x ``in_dim``) as the ``tiled`` kernels read them: tiles of
    ``TILE_ROWS`` rows, and within a tile unit by unit, each unit's ``TILE_ROWS`` rows of 256 values back
    to back, ``TILE_UNIT`` bytes apart, i.e. ``TILE_ROWS * TILE_UNIT`` contiguous bytes, what one warp
    stages (the 32-value block types' units re-encoded as :data:`TILED_B32` says, Q4_1's and Q5_1's rows
    with their 16-byte chunks permuted as :data:`SWIZZLE` says; Q6_K's two halves of 16 rows each as
    :data:`Q6K_HALF` says: rows of :data:`Q6K_ROW` bytes, then their d). Tile T, unit u starts at byte
    ``(T * units + u) * TILE_ROWS * TILE_UNIT``; the last tile is zero-filled past ``out_dim``.
    With ``glu`` W is [gate; up] (``out_dim`` = 2 ffn rows) and tile T holds gate rows 16 T .. 16 T + 15
    and then up rows 16 T .. 16 T + 15 (the rows a warp of the fused gate/up GEMV takes)."""
    ub, units = UNIT_BYTES[wtype], in_dim // 256  # (TILE_UNIT[wtype] == ub: no padding)
    rows = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if in_dim % 256 or rows.size != out_dim * units * ub:
        raise ValueError(f"tile_major: {wtype} {out_dim} x {in_dim} needs in_dim a multiple of 256 and "
                         f"{out_dim * units * ub} bytes, got in_dim {in_dim} and {rows.size} bytes")
    rows = rows.reshape(out_dim, units, ub)
    if wtype in BLOCK32:
        rows = _repack_b32(rows, wtype)
    if glu:
        if out_dim % 2:
            raise ValueError(f"tile_major: a gate/up weight holds 2 ffn rows, got {out_dim}")
        half = TILE_ROWS // 2
        ffn = out_dim // 2
        n_t = -(-ffn // half)
        pad = np.zeros((2, n_t * half, units, ub), np.uint8)
        pad[0, :ffn], pad[1, :ffn] = rows[:ffn], rows[ffn:]
        tiles = pad.reshape(2, n_t, half, units, ub).transpose(1, 3, 0, 2, 4)  # (T, u, gate/up, row, bytes)
        tiles = tiles.reshape(n_t, units, TILE_ROWS, ub)
    else:
        n_t = -(-out_dim // TILE_ROWS)
        pad = np.zeros((n_t * TILE_ROWS, units, ub), np.uint8)
        pad[:out_dim] = rows
        tiles = pad.reshape(n_t, TILE_ROWS, units, ub).transpose(0, 2, 1, 3)  # (T, u, row, bytes)
    if wtype == "Q6_K":  # each half: its 16 rows' first Q6K_ROW bytes, then their d (Q6K_HALF)
        halves = tiles.reshape(*tiles.shape[:2], 2, TILE_ROWS // 2, ub)
        tiles = np.concatenate([halves[..., :Q6K_ROW].reshape(*tiles.shape[:2], 2, Q6K_D),
                                halves[..., Q6K_ROW:].reshape(*tiles.shape[:2], 2, Q6K_HALF - Q6K_D)], axis=-1)
    return np.ascontiguousarray(_swizzle_rows(tiles, wtype)).reshape(-1)
