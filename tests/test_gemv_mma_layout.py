"""CPU tests of the tensor-core GEMV's tile-major weight layout (``tile_major``): every unit lands where
the kernel reads it (the 32-value block types re-encoded and swizzled, Q6_K's half tiles, gate/up
pairs), Q6_K's staged rows read without bank conflicts, the lane order of the fifth bits, and wrong
sizes rejected. The kernel's emulated runs are in tests/test_gemv_mma_ptx.py."""

from __future__ import annotations

import numpy as np
import pytest

from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES, tile_major
from ptx_gen.kernels.gemv.gemv_mma_layout import BLOCK32


@pytest.mark.parametrize("wtype", MMA_TYPES)
@pytest.mark.parametrize("out_dim", [1, 31, 32, 45, 64])
def test_tile_major_places_every_unit_where_the_kernel_reads_it(wtype, out_dim):
    """tile_major: row r's unit u at ((r // 32) * units + u) * 32 T + (r % 32) T (T = TILE_UNIT), zeros
    past out_dim; Q6_K: within each 16-row half of the tile (3360 bytes), row r's first 208 bytes at
    208 (r % 16) and its d at 3328 + 2 (r % 16); with glu, tile T holds gate rows 16 T.. then up rows
    16 T.. (the rows of outputs 16 T..16 T + 15)."""
    from ptx_gen.kernels.gemv.gemv_mma import TILE_ROWS, TILE_UNIT, UNIT_BYTES

    ub, tu, units = UNIT_BYTES[wtype], TILE_UNIT[wtype], 3
    assert tu == ub  # (no padding)
    raw = np.random.default_rng(out_dim).integers(1, 256, out_dim * units * ub, dtype=np.uint8)
    rows = raw.reshape(out_dim, units, ub)
    zero = np.zeros(tu, np.uint8)

    def unit(r, u, tile_row):
        if wtype in BLOCK32:  # re-encoded: scales, fifth bits in lane order, codes (see _tiled_b32_unit)
            return _swizzled(_tiled_b32_unit(rows[r, u], wtype), wtype, tile_row)
        return rows[r, u]

    def placed(t, base, tile_row):  # row tile_row's unit in the tile's unit starting at t[base]
        if wtype != "Q6_K":
            at = base + tile_row * tu
            return t[at:at + tu]
        half, i = divmod(tile_row, 16)
        at = base + 3360 * half
        return np.r_[t[at + 208 * i:at + 208 * i + 208], t[at + 3328 + 2 * i:at + 3328 + 2 * i + 2]]
    t = tile_major(raw, wtype, out_dim, 256 * units)
    n_t = -(-out_dim // TILE_ROWS)
    assert t.size == n_t * TILE_ROWS * units * tu
    for r in range(n_t * TILE_ROWS):
        for u in range(units):
            base = ((r // TILE_ROWS) * units + u) * TILE_ROWS * tu
            got = placed(t, base, r % TILE_ROWS)
            assert (got == (unit(r, u, r % TILE_ROWS) if r < out_dim else zero)).all(), (r, u)
    if out_dim % 2 == 0:  # [gate; up] with ffn = out_dim / 2 outputs
        ffn, half = out_dim // 2, TILE_ROWS // 2
        g = tile_major(raw, wtype, out_dim, 256 * units, glu=True)
        assert g.size == -(-ffn // half) * TILE_ROWS * units * tu
        for o in range(-(-ffn // half) * half):
            for u in range(units):
                base = ((o // half) * units + u) * TILE_ROWS * tu
                for which in (0, 1):
                    want = unit(which * ffn + o, u, which * half + o % half) if o < ffn else zero
                    assert (placed(g, base, which * half + o % half) == want).all(), (o, u, which)


def test_q6k_tile_major_rows_are_read_without_bank_conflicts():
    """Tile-major Q6_K: a staged half-tile's rows lie Q6K_ROW bytes apart, so that lane (g, t)'s A word
    4 m' + t of row g (g < 8, t < 4, each of the 12 code words m') lands in its own bank, every row
    16-byte aligned, and a tile's unit is exactly 32 rows of 210 bytes (no padding)."""
    from ptx_gen.kernels.gemv.gemv_mma_layout import Q6K_D, Q6K_HALF, Q6K_ROW, TILE_ROWS, TILE_UNIT, layout
    lay = layout("Q6_K", 4096, 1, 2, 2, 2, tiled=True)
    assert lay["stride"] == Q6K_ROW and Q6K_ROW % 16 == 0 and Q6K_HALF % 16 == 0
    for mi in range(12):
        banks = {(g * Q6K_ROW // 4 + 4 * mi + t) % 32 for g in range(8) for t in range(4)}
        assert len(banks) == 32, mi
    assert Q6K_D == 16 * Q6K_ROW and 2 * Q6K_HALF == TILE_ROWS * TILE_UNIT["Q6_K"] == TILE_ROWS * 210
    # (the 212-byte rows before: 53 words apart, 2-3 lanes a bank)
    assert len({(g * 53 + t) % 32 for g in range(8) for t in range(4)}) < 32


def _swizzled(unit: np.ndarray, wtype: str, tile_row: int) -> np.ndarray:
    """A unit as row ``tile_row`` of a tile holds it: Q4_1 rows 4..7 (mod 8) swap their 16-byte chunks
    in pairs (chunk c at c ^ 1), Q5_1 rows 2 j, 2 j + 1 (mod 8) keep chunk c at c ^ j."""
    key = {"Q4_1": (tile_row >> 2) & 1, "Q5_1": (tile_row >> 1) & 3}.get(wtype, 0)
    chunks = unit.reshape(-1, 16)
    return chunks[np.arange(len(chunks)) ^ key].reshape(-1)


def _tiled_b32_unit(unit: np.ndarray, wtype: str) -> np.ndarray:
    """A 256-value unit of GGUF blocks of a 32-value block type as tile-major weights hold it, written
    out block by block from the GGUF layout: the 8 d (Q4_1, Q5_1: d, m) fields, the 8 qh words with
    bit v moved to bit 8 (v % 4) + 4 (v // 16) + (v // 4) % 4, the 8 x 16 qs bytes."""
    bs, qs, qh, sc = {"Q4_0": (18, 2, None, 2), "Q4_1": (20, 4, None, 4), "Q5_0": (22, 6, 2, 2),
                      "Q5_1": (24, 8, 4, 4)}[wtype]
    blocks = [unit[bs * b:bs * (b + 1)] for b in range(8)]
    out = [b[:sc] for b in blocks]
    if qh is not None:
        for b in blocks:
            word = int.from_bytes(b[qh:qh + 4].tobytes(), "little")
            moved = sum(1 << (8 * (v % 4) + 4 * (v // 16) + (v // 4) % 4) for v in range(32) if word >> v & 1)
            out.append(np.frombuffer(moved.to_bytes(4, "little"), np.uint8))
    out += [b[qs:qs + 16] for b in blocks]
    return np.concatenate(out)


def test_lane_order_puts_each_code_words_fifth_bits_in_one_bit_of_each_byte():
    """lane_order_qh: the fifth bits of values 16 h + 4 t + i (i = 0..3) are bit 4 h + t of bytes 0..3."""
    from ptx_gen.kernels.gemv.gemv_mma_layout import lane_order_qh
    rng = np.random.default_rng(7)
    qh = rng.integers(1, 2**32, 64, dtype=np.uint64).astype(np.uint32)
    got = lane_order_qh(qh)
    for a, b in zip(qh.tolist(), got.tolist()):
        for h in range(2):
            for t in range(4):
                want = [(a >> (16 * h + 4 * t + i)) & 1 for i in range(4)]
                assert [(b >> (8 * i + 4 * h + t)) & 1 for i in range(4)] == want
        assert bin(a).count("1") == bin(b).count("1")


def test_tile_major_rejects_wrong_sizes():
    with pytest.raises(ValueError, match="multiple of 256"):
        tile_major(np.zeros(10 * 144, np.uint8), "Q4_K", 10, 300)
    with pytest.raises(ValueError, match="needs in_dim a multiple of 256 and 1440 bytes"):
        tile_major(np.zeros(100, np.uint8), "Q4_K", 10, 256)
    with pytest.raises(ValueError, match="2 ffn rows"):
        tile_major(np.zeros(3 * 144, np.uint8), "Q4_K", 3, 256, glu=True)
