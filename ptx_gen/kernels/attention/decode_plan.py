"""Geometry of the decode attention kernels (:mod:`ptx_gen.kernels.attention.decode_core`): the work layout of
a block (:class:`DecodeLayout`, chosen by :func:`decode_layout` within a register budget) and how a
sequence is cut into chunks (:func:`chunk_rows`)."""

from __future__ import annotations

from dataclasses import dataclass

LOG2E = 1.4426950408889634
NEG_INF = float("-inf")
MAX_HEAD_DIM = 256
SCORE_MODES = ("scatter", "butterfly")
DEFAULT_L2_PREFETCH = 0  # steps of rows requested from the L2 ahead (sm_90); off by default: it slows long sequences
_REG_BUDGET = 128  # registers per thread that leave room for 16 warps per SM


@dataclass(frozen=True)
class DecodeLayout:
    """Compile-time work layout of a decode-attention block."""

    head_dim: int
    group: int  # query heads per KV head
    heads_per_block: int  # query heads of the group served by one block
    warps: int
    lanes_per_row: int  # T
    chunks_per_lane: int  # C (float4 chunks of a row per lane)
    unroll: int  # U (rows per lane group per step)
    prefetch: bool = False  # load step i+1 into registers while computing step i
    scatter: bool = False  # reduce-scatter scores (see the module doc); False: butterfly per dot
    l2_prefetch: int = 0  # steps of rows the block asks the L2 to fetch ahead (sm_90); 0: none

    @property
    def nc(self) -> int:
        """float4 chunks per row."""
        return self.head_dim // 4

    @property
    def rows_per_warp(self) -> int:
        return (32 // self.lanes_per_row) * self.unroll

    @property
    def rows_per_step(self) -> int:
        """Rows a block covers per loop iteration."""
        return self.warps * self.rows_per_warp

    @property
    def subgroups(self) -> int:
        """Blocks per KV head."""
        return self.group // self.heads_per_block

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def heads_pad(self) -> int:
        """heads_per_block rounded up to a power of two (the scatter index space)."""
        return 1 << (self.heads_per_block - 1).bit_length()

    @property
    def scatter_values(self) -> int:
        """V: scores per lane before the reduce-scatter."""
        return self.heads_pad * self.unroll

    @property
    def scatter_entries(self) -> int:
        """E: full scores per lane after it."""
        return max(1, self.scatter_values // self.lanes_per_row)

    @property
    def exchange_floats(self) -> int:
        """Floats of one lane group's exchange buffer (probabilities, then per-head factors)."""
        return round4(self.scatter_values) + round4(self.heads_pad)

    def smem_bytes(self) -> int:
        combine = self.warps * self.heads_per_block * (self.head_dim + 2) * 4
        exchange = self.warps * (32 // self.lanes_per_row) * 2 * self.exchange_floats * 4 if self.scatter else 0
        return combine + exchange


def layout_name(lay: DecodeLayout) -> str:
    """The variant part of a decode kernel's entry name."""
    return (f"d{lay.head_dim}_g{lay.group}_hb{lay.heads_per_block}_w{lay.warps}_u{lay.unroll}"
            f"{'_sc' if lay.scatter else '_bf'}{'_pf' if lay.prefetch else ''}"
            f"{f'_l2p{lay.l2_prefetch}' if lay.l2_prefetch else ''}")


def round4(n: int) -> int:
    return -(-n // 4) * 4


def choose_lanes(nc: int) -> tuple[int, int]:
    """(T, C): the lane-group width and chunks per lane that waste the fewest lanes for ``nc`` chunks,
    keeping C <= 3 where possible (registers) and preferring wider groups on ties."""
    cap = max(3, -(-nc // 32))
    best = None
    for t in (32, 16, 8, 4, 2, 1):
        c = -(-nc // t)
        if c > cap:
            continue
        waste = c * t - nc
        if best is None or waste < best[0]:
            best = (waste, t, c)
    assert best is not None
    return best[1], best[2]


def check_head_dim(head_dim: int) -> None:
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 4 or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be a positive multiple of 4 up to {MAX_HEAD_DIM} (16-byte rows), got {head_dim!r}"
        )


def loop_registers(lay: DecodeLayout) -> int:
    """Per-thread registers of the row loop, estimated (q, accumulators, K/V loads, scores; calibrated
    on ptxas 13 for sm_90: within ~8 of its counts for head_dim 64-128 and groups 4-7)."""
    return _registers(lay.scatter, lay.heads_per_block, lay.heads_pad, lay.chunks_per_lane, lay.unroll,
                      lay.prefetch)


def _registers(scatter: bool, hb: int, hbp: int, c: int, u: int, prefetch: bool) -> int:
    kv = 8 * u * c * (2 if prefetch else 1)
    if scatter:
        return 4 * c * hbp + 4 * c * hb + kv + hbp * u
    return 8 * hb * c + kv + hb * u + 12


def decode_layout(
    head_dim: int,
    group: int,
    heads_per_block: int | None = None,
    warps: int = 4,
    unroll: int | None = None,
    prefetch: bool = False,
    scores: str | None = None,
    l2_prefetch: int = DEFAULT_L2_PREFETCH,
) -> DecodeLayout:
    """The layout for ``head_dim`` and a GQA ``group``; ``None`` picks the defaults:
    ``heads_per_block`` = the largest divisor of ``group`` keeping <= 32 q and 32 accumulator floats
    per lane; ``scores`` = ``scatter`` where the padded head count fits a lane group (always for
    head_dim >= 32); ``unroll`` = about 8 float4 loads in flight per lane, lowered while the register
    estimate exceeds 128 (16 warps per SM), a power of two for ``scatter``."""
    check_head_dim(head_dim)
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group (num_heads // num_kv_heads) must be a positive integer, got {group!r}")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {warps}")
    if scores not in (None, *SCORE_MODES):
        raise ValueError(f"scores must be one of {SCORE_MODES} (or None for the default), got {scores!r}")
    if isinstance(l2_prefetch, bool) or not isinstance(l2_prefetch, int) or not 0 <= l2_prefetch <= 16:
        raise ValueError(f"l2_prefetch must be an integer number of steps in 0..16, got {l2_prefetch!r}")
    t, c = choose_lanes(head_dim // 4)
    per_head = 4 * c
    if heads_per_block is None:
        heads_per_block = max(d for d in range(1, group + 1) if group % d == 0 and (d * per_head <= 32 or d == 1))
    if heads_per_block < 1 or group % heads_per_block:
        raise ValueError(f"heads_per_block must divide the group size {group}, got {heads_per_block}")
    hbp = 1 << (heads_per_block - 1).bit_length()
    if scores is None:
        scores = "scatter" if hbp <= t and (unroll is None or unroll & (unroll - 1) == 0) else "butterfly"
    scatter = scores == "scatter"
    if scatter and hbp > t:
        raise ValueError(f"scatter scores need the {heads_per_block} heads of a block (padded to {hbp}) to fit "
                         f"a lane group of {t} lanes; use scores='butterfly'")
    if unroll is None:
        unroll = max(1, 4 // c)
        if scatter:
            unroll = 1 << (unroll.bit_length() - 1)
        while unroll > 1 and _registers(scatter, heads_per_block, hbp, c, unroll, prefetch) > _REG_BUDGET:
            unroll = unroll // 2 if scatter else unroll - 1
    if unroll < 1 or unroll > 8:
        raise ValueError(f"unroll must be in 1..8, got {unroll}")
    if scatter and unroll & (unroll - 1):
        raise ValueError(f"scatter scores need a power-of-two unroll, got {unroll}")
    return DecodeLayout(head_dim, group, heads_per_block, warps, t, c, unroll, bool(prefetch), scatter, l2_prefetch)


def default_decode_warps(head_dim: int, group: int) -> int:
    """Warps per flash-decoding block: 8 where the block's shared memory stays within 32 KB, else 4.
    A block then covers twice the rows per step, so a short sequence needs half the steps or chunks
    (fewer partials to combine), while an SM holds the same 16 warps at <= 128 registers."""
    return 8 if decode_layout(head_dim, group, warps=8).smem_bytes() <= 32 * 1024 else 4


def chunk_rows(seq_len: int, num_chunks: int, min_chunk: int, grow_rows: int = 0, set_chunks: int = 1) -> int:
    """Rows per flash-decoding chunk, as the kernels compute it on the device: ``max(ceil(L /
    num_chunks), min_chunk, 1)``, raised to ``ceil(L / set_chunks)`` where that is at most ``grow_rows``
    (a short sequence then needs at most ``set_chunks`` chunks: one combine level in single-launch flash
    decoding). Chunk ``c`` covers rows ``[c * rows, min((c + 1) * rows, L))``; the first
    ``ceil(L / rows)`` chunks are the active ones."""
    rows = max(-(-seq_len // num_chunks), min_chunk, 1)
    grown = -(-seq_len // set_chunks)
    return max(rows, grown) if grown <= grow_rows else rows


def active_chunks(seq_len: int, rows: int) -> int:
    return -(-seq_len // rows)
