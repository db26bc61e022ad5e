"""Planning of the CUDA-core GEMV (:mod:`ptx_gen.kernels.gemv.gemv`): how a row (or a K slice of it) is
walked in staged tiles, how ``ksplit`` warps share a row, and the static shared memory of a variant."""

from __future__ import annotations

from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.quant_layout import DENSE, K_TABLE, ROUND, type_info

# rounds per staged tile, per type: ~1-2 KB of weights per row per tile (2-4 loads per lane); with the
# next tile prefetched into registers during decode, each warp has about that much in flight per row
TILE_ROUNDS = {"F32": 1, "F16": 2, "BF16": 2, "Q8_0": 4, "Q4_0": 8, "Q4_1": 8, "Q5_0": 8, "Q5_1": 8,
               "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}
TABLE_BYTES = 8 * 8  # per K-quant block: 8 sub-blocks x (A, C) f32
MAX_STATIC_SMEM = 48 * 1024
KSPLITS = (1, 2, 4, 8)
# split-K slices are walked in tiles of at most this many bytes per row (6 pieces of 16 bytes per lane):
# a slice of up to 3 KB per row is one tile, all its loads in flight at once and no loop (whose
# prefetch registers would stay live through the decode)
SPLIT_TILE_BYTES = 3072
L1_MARGIN = 8 * 1024  # L1 wanted beyond x itself (bias, residual, the lines of x around a slice)


def plan(wtype: str, in_dim: int, phase: int | None = None, rpt: int | None = None) -> dict:
    """Static facts of the tiling of a row, or of one K slice of a row (``in_dim`` values), walked in
    tiles of ``rpt`` rounds (default ``TILE_ROUNDS``). ``phase`` is what is known of the alignment of
    its first byte: 16 (``aligned``), 4 or 2; by default 16 when the row length is a multiple of 16
    bytes (every row then starts 16-byte aligned), else 2. Also used by tests, the GEMM and the
    embedding."""
    ql.check_in_dim(wtype, in_dim)
    info = type_info(wtype)
    rb = info.round_bytes
    rpt = TILE_ROUNDS[wtype] if rpt is None else rpt
    row_bytes = info.row_bytes(in_dim)
    if phase is None:
        phase = 16 if row_bytes % 16 == 0 else 2
    aligned = phase == 16
    full_rounds, rem = divmod(in_dim, ROUND)
    n_full_tiles, tail_full = divmod(full_rounds, rpt)
    tail = [(i, ROUND) for i in range(tail_full)] + ([(tail_full, rem)] if rem else [])
    rem_bytes = rem // info.block_values * info.block_bytes
    extra = 0 if aligned else 1
    pieces_full = rpt * rb // 16 + extra
    pieces_tail = -(-(tail_full * rb + rem_bytes) // 16) + extra if tail else 0
    # +16: a realigning read (lds_words) may fetch one word past the last block
    stage = 16 * max(pieces_full if n_full_tiles else 0, pieces_tail) + (0 if wtype in DENSE else 16)
    table = rpt * TABLE_BYTES if wtype in K_TABLE else 0
    return dict(info=info, rb=rb, rpt=rpt, tile_bytes=rpt * rb, row_bytes=row_bytes, aligned=aligned, phase=phase,
                n_full_tiles=n_full_tiles, tail=tail, pieces_full=pieces_full, pieces_tail=pieces_tail,
                stage=stage, table=table)


def _rounds_per(wtype: str, mult: int) -> int:
    """The fewest rounds whose bytes are a multiple of ``mult``."""
    rb = type_info(wtype).round_bytes
    g = 1
    while g * rb % mult:
        g += 1
    return g


def split(wtype: str, in_dim: int, ksplit: int) -> dict:
    """How ``ksplit`` warps share a row: slice ``s`` holds values ``[s * slice_vals, ...)``; slices
    ``s < n_full`` hold ``slice_vals`` values, slice ``n_full`` the remaining ``last_vals`` (0: none),
    later slices nothing (only when the row has fewer rounds than ``ksplit``).

    Slices start a multiple of 4 bytes apart (Q6_K: an even number of its 210-byte rounds; every
    other type's rounds are whole 16-byte pieces), so ``phase`` (see :func:`plan`) is known. A slice
    is walked in tiles of ``rpt`` rounds (whole 16-byte pieces): ``TILE_ROUNDS`` for ``ksplit == 1``
    (the unsplit kernel); a slice of at most ``SPLIT_TILE_BYTES`` per row is one tile;
    a longer one is cut into equal tiles of at most ``TILE_ROUNDS`` (14 rounds -> 2 x 7, not 8 + 6)."""
    ql.check_in_dim(wtype, in_dim)
    if ksplit not in KSPLITS:
        raise ValueError(f"ksplit must be one of {KSPLITS}, got {ksplit}")
    info = type_info(wtype)
    g4, g16 = _rounds_per(wtype, 4), _rounds_per(wtype, 16)
    rounds = -(-in_dim // ROUND)
    per = -(-(-(-rounds // ksplit)) // g4) * g4  # rounds per slice
    slice_vals = min(per * ROUND, in_dim)
    n_full, last_vals = divmod(in_dim, slice_vals)
    slice_bytes = info.row_bytes(slice_vals)
    row_bytes = info.row_bytes(in_dim)
    if ksplit == 1:
        rpt = TILE_ROUNDS[wtype]
        phase = 16 if row_bytes % 16 == 0 else 2  # plan's default
    else:
        phase = next(a for a in (16, 4, 2) if row_bytes % a == 0 and slice_bytes % a == 0)
        if per * info.round_bytes <= SPLIT_TILE_BYTES:
            rpt = -(-per // g16) * g16  # one tile, copied with cp.async
        else:
            tiles = -(-per // TILE_ROUNDS[wtype])
            rpt = -(-(-(-per // tiles)) // g16) * g16
    return dict(slice_vals=slice_vals, slice_bytes=slice_bytes, n_full=n_full, last_vals=last_vals, rpt=rpt,
                phase=phase, used=n_full + (1 if last_vals else 0))


def slice_plans(wtype: str, sp: dict) -> tuple[dict | None, dict | None]:
    """The plans of the full slices and of the short last slice (None where there is none)."""
    return tuple(plan(wtype, n, sp["phase"], sp["rpt"]) if n else None for n in (sp["slice_vals"], sp["last_vals"]))


def tiles_per_slice(wtype: str, in_dim: int, ksplit: int) -> int:
    """How many tiles a warp walks for its (longest) slice of a row."""
    sp = split(wtype, in_dim, ksplit)
    return -(-sp["slice_vals"] // (sp["rpt"] * ROUND))


def shared_bytes(wtype: str, in_dim: int, rows: int, warps: int, ksplit: int = 1) -> int:
    """Static shared memory of a GEMV variant: per warp and row a staging buffer and (K-quants) a
    scale table, sized for the longest slice; with ``ksplit > 1`` also the slices' row sums."""
    plans = [p for p in slice_plans(wtype, split(wtype, in_dim, ksplit)) if p is not None]
    per_row = max(p["stage"] for p in plans) + max(p["table"] for p in plans)
    return per_row * rows * warps + (4 * rows * warps if ksplit > 1 else 0)
