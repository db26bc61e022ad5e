"""PTX-side decoding of GGUF weight blocks, shared by the GEMV, GEMM and embedding kernels.

Block layouts come from :mod:`ptx_gen.ggml` (written down once there). The kernels stage a
row's raw bytes in shared memory with 16-byte coalesced loads and decode from there, so a block may
sit at any 2-byte alignment.

**Lane mapping.** A *round* is 256 consecutive values of a row; lane ``l`` of a warp owns values
``[8l, 8l + 8)`` of the round. For 32-value blocks that is block ``l // 4`` of the round (8 blocks per
round), values ``8 (l % 4) ..``; for 256-value K-quant blocks the round is one block; for dense
types (F32/F16/BF16) it is 256 elements. Every decoder returns, for the lane's 8 values,

    value_i = A * f_i + C          (C may be None: 0)

with ``f_i`` exact float32 numbers built from the quantized codes and ``A``, ``C`` per lane (the
block's or sub-block's scale terms). A dot product then costs one FMA per value:
``sum_i value_i x_i = A * sum_i f_i x_i + C * sum_i x_i``. The decoders return a :class:`Decoded`
that keeps ``A = s * alpha`` and ``C = s * beta + m`` factored (``alpha``, ``beta`` constants): the
GEMV then needs one FMA per row for ``alpha * dot + beta * sum x`` (the ``beta * sum x`` is shared by
all rows) and one more to scale by ``s``, instead of forming A and C for every row.

**Codes to floats without I2F.** Integer-to-float conversion runs at a quarter of the FMA rate, so
codes are turned into floats by placing their bits in a float32 mantissa with ``prmt``:

* ``n`` of ``b`` <= 7 bits: byte 2 of the word is ``n << (7 - b)``, byte 3 is ``0x3F`` (exponent
  0x7E): ``f = 0.5 + n / 2**(b + 1)`` (exact); ``n = 2**(b+1) f - 2**b``, the offset folded into ``C``.
  One rotate + one AND place four codes, one ``prmt`` per value makes the float.
* 8-bit codes (Q8_0): byte 0 is ``q ^ 0x80``, byte 3 is ``0x4B``: ``f = 2**23 + q + 128``, then one
  FADD of ``-(2**23 + 128)`` gives ``q`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.ggml import layout as _layout
from ptx_gen.kernels.gemv.gemv_mma_layout import SWIZZLE, TILED_B32

ROUND = 256  # values per round (32 lanes x 8 values)
PER_LANE = 8

#: weight types the kernels handle, by name
WEIGHT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
DENSE = ("F32", "F16", "BF16")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# K-quants whose 6-bit scales are decoded once per tile into a shared-memory table
K_TABLE = ("Q4_K", "Q5_K")


@dataclass(frozen=True)
class TypeInfo:
    name: str
    block_values: int  # values per block (1 for dense types)
    block_bytes: int

    @property
    def round_bytes(self) -> int:
        """Bytes of one round (256 values)."""
        return ROUND // self.block_values * self.block_bytes if self.block_values <= ROUND else self.block_bytes

    def row_bytes(self, in_dim: int) -> int:
        return in_dim // self.block_values * self.block_bytes


@lru_cache(maxsize=None)
def type_info(wtype: str) -> TypeInfo:
    if wtype not in WEIGHT_TYPES:
        raise ValueError(f"unsupported weight type {wtype!r}; expected one of {WEIGHT_TYPES}")
    lay = _layout(wtype)
    return TypeInfo(wtype, lay.block_size, lay.type_size)


def check_in_dim(wtype: str, in_dim: int) -> None:
    """Reject row lengths GGUF cannot hold (and, for dense types, ones that are not whole 16-byte
    vectors of x): never read out of bounds instead."""
    info = type_info(wtype)
    if in_dim <= 0:
        raise ValueError(f"in_dim must be positive, got {in_dim}")
    if in_dim % info.block_values:
        raise ValueError(
            f"a {wtype} row of {in_dim} values is not a multiple of the block size {info.block_values}: "
            f"GGUF cannot store it"
        )
    if wtype in DENSE and in_dim % PER_LANE:
        raise ValueError(f"{wtype} rows must be a multiple of {PER_LANE} values for the GPU kernels, got {in_dim}")


@lru_cache(maxsize=None)
def field_offset(wtype: str, name: str) -> int:
    return _layout(wtype).offset(name)


# ---------------------------------------------------------------------------------------------
# Shared-memory readers


def lds_words(k: KernelBuilder, addr: Reg, offset: int, n: int, align: int | None, sel: Reg | None = None) -> list[Reg]:
    """``n`` 32-bit little-endian words from shared byte address ``addr + offset``.

    ``align`` is the known alignment of the register ``addr`` (16/8/4; ``offset`` is exact), or None
    when ``addr + offset`` is only known to be even: then ``n + 1`` aligned words are read and
    realigned with ``prmt`` using ``sel`` (from :func:`realign_selector` of the same address, or an
    immediate when the phase is known)."""
    if align is not None and align >= 4:
        out: list[Reg] = []
        i = 0
        while i < n:
            if offset % 4:
                raise ValueError(f"offset {offset} breaks the {align}-byte alignment")
            if align >= 16 and n - i >= 4 and (offset + 4 * i) % 16 == 0:
                out += list(k.load("shared", "u32", addr, offset + 4 * i, vec=4))
                i += 4
            elif align >= 8 and n - i >= 2 and (offset + 4 * i) % 8 == 0:
                out += list(k.load("shared", "u32", addr, offset + 4 * i, vec=2))
                i += 2
            else:
                out.append(k.load("shared", "u32", addr, offset + 4 * i))
                i += 1
        return out
    if sel is None:
        raise ValueError("an unaligned read needs its realign selector")
    base = k.and_(k.add(addr, offset), 0xFFFFFFFC)
    raw = [k.load("shared", "u32", base, 4 * i) for i in range(n + 1)]
    return [k.prmt(raw[i], raw[i + 1], sel) for i in range(n)]


def lds_bits(k: KernelBuilder, addr: Reg, n: int, phase: tuple[int, int], rot: Reg, fr: Reg, mask: int) -> list[Reg]:
    """``n`` 32-bit words from shared byte address ``addr`` (``addr % phase[0] == phase[1]``, modulus 4
    or 8, residue even), each rotated left by ``rot`` and masked with ``mask`` (``mask`` must not keep
    the bits a rotation wraps around, i.e. the low ``rot`` bits of every byte the rotation crosses).

    A word at an address of phase 2 (mod 4) lies across two aligned words; one funnel shift right by
    ``fr = (16 - rot) % 32`` of that pair both realigns and rotates it (the ``rot`` low bits come from
    the lower word instead of wrapping: ``mask`` drops them), so no ``prmt`` is needed."""
    mod, res = phase
    if res % 4 == 0:
        align = 8 if mod == 8 and res == 0 else 4
        return [nibbles_to_bits(k, w, rot, mask) for w in lds_words(k, addr, 0, n, align)]
    if res % 2:
        raise ValueError(f"odd phase {phase}")
    raw: list[Reg] = []
    base = k.sub(addr, 2)  # the aligned word holding the first two bytes (ptxas folds the -2 into the loads)
    off = 0
    while len(raw) < n + 1:
        if mod == 8 and (res - 2 + off) % 8 == 0 and n + 1 - len(raw) >= 2:
            raw += list(k.load("shared", "u32", base, off, vec=2))
            off += 8
        else:
            raw.append(k.load("shared", "u32", base, off))
            off += 4
    return [k.and_(k.shf("r", raw[i], raw[i + 1], fr), mask) for i in range(n)]


def realign_selector(k: KernelBuilder, addr: Reg, offset: int = 0) -> Reg:
    """prmt selector for :func:`lds_words` at an even address: 0x3210 (aligned) or 0x5432."""
    two = k.and_(k.add(addr, offset) if offset else addr, 2)
    return k.mad(two, 0x1111, 0x3210)


def lds_f16(k: KernelBuilder, addr: Reg, offset: int) -> Reg:
    """An f16 field from shared memory, as f32."""
    h = k.load("shared", "b16", addr, offset)
    return k.cvt(Reg(h.name, F16_TYPE), "f32")


# ---------------------------------------------------------------------------------------------
# Codes -> floats

from ptx_gen.types import ptx_type  # noqa: E402

F16_TYPE = ptx_type("f16")
_b16 = ptx_type("b16")


@dataclass(frozen=True)
class Decoded:
    """A lane's 8 values ``value_i = s * (alpha * fs[i] + beta) + m`` (``m`` None: 0; ``s`` may be the
    Python float 1.0)."""

    fs: list
    s: Reg | float
    alpha: float = 1.0
    beta: float = 0.0
    m: Reg | None = None


def affine(k: KernelBuilder, dec: Decoded) -> tuple[Reg | float, Reg | None]:
    """(A, C) of ``value_i = A * fs[i] + C`` (C None: 0), for code that dequantizes values one by one."""
    if dec.alpha == 1.0 and dec.beta == 0.0:
        return dec.s, dec.m
    a = k.mul(dec.s, dec.alpha)
    c = k.mul(dec.s, dec.beta)
    return a, (c if dec.m is None else k.add(c, dec.m))


def magic_small(k: KernelBuilder, t: Reg) -> list[Reg]:
    """``t`` holds four bytes ``n << (7 - b)``: return ``0.5 + n / 2**(b+1)`` for each byte."""
    return [k.bitcast(k.prmt(t, 0x3F000000, 0x7044 | (i << 8)), "f32") for i in range(4)]


def magic_q8(k: KernelBuilder, w: Reg) -> list[Reg]:
    """Four signed bytes of ``w`` -> four exact floats."""
    u = k.xor(w, 0x80808080)
    out = []
    for i in range(4):
        f = k.bitcast(k.prmt(u, 0x4B000000, 0x7440 | i), "f32")
        out.append(k.add(f, -8388736.0))  # -(2**23 + 128)
    return out


def nibbles_to_bits(k: KernelBuilder, w: Reg, rot: Reg | int, mask: int) -> Reg:
    """Rotate ``w`` left by ``rot`` and keep ``mask`` (used to move nibbles/bits into position)."""
    if isinstance(rot, int) and rot % 32 == 0:
        return k.and_(w, mask)
    return k.and_(k.shf("l", w, w, rot), mask)


def spread4(k: KernelBuilder, bits4: Reg) -> Reg:
    """The low 4 bits of ``bits4`` to bit 0 of bytes 0..3."""
    return k.and_(k.mul(k.and_(bits4, 0xF), 0x00204081), 0x01010101)


# ---------------------------------------------------------------------------------------------
# Per-type decoders.  Each gets the kernel, the shared address of the block start ``bb`` and what it
# knows about its alignment, the lane constants ``lc`` (a dict made once by :func:`lane_constants`),
# and returns (fs[8], A, C).


def lane_constants(k: KernelBuilder, wtype: str, lane: Reg, tiled: bool = False) -> dict:
    """Per-lane constants (registers computed once) used by the decoders; ``tiled``: also those of the
    re-encoded 32-value blocks of tile-major weights (:func:`decode_q32`'s ``fields``)."""
    c: dict = {"lane": lane}
    if wtype in DENSE:
        return c
    if type_info(wtype).block_values == 32:
        u = k.and_(lane, 3)  # which 8 values of the block
        c["blk"] = k.shr(lane, 2)  # block within the round
        c["pos"] = k.shl(u, 3)  # 8 * (lane % 4)
        # Q4/Q5: bytes qs[pos % 16 ...], low nibbles for pos < 16, high for pos >= 16
        c["qoff"] = k.and_(c["pos"], 15)
        hi = k.shr(u, 1)  # 1 for the high nibbles
        c["rot4"] = k.sub(3, k.shl(hi, 2))  # 4-bit codes to bits 3..6: rotl 3 (low) or rotl 31 (high)
        c["rot4"] = k.and_(c["rot4"], 31)
        c["rot5"] = k.and_(k.sub(2, k.shl(hi, 2)), 31)  # to bits 2..5: rotl 2 or rotl 30
        c["tiled"] = tiled and wtype in TILED_B32
        if c["tiled"] and wtype in ("Q5_0", "Q5_1"):
            # fifth bits in lane order: those of the lane's word w (values pos + 4 w ..) at bit 2 u + w of
            # each byte (lane_order_qh), to bit 6: rotl 6 - 2 u - w
            c["qhrot"] = [k.and_(k.sub(6 - w, k.shl(u, 1)), 31) for w in (0, 1)]
        return c
    # K-quants: lane l owns values [8l, 8l + 8) of the 256-value block
    c["pos8"] = k.shl(lane, 3)
    if wtype in ("Q4_K", "Q5_K"):
        j = k.shr(lane, 2)  # sub-block of 32
        c["j"] = j
        q = k.shl(k.and_(lane, 3), 3)  # position within the sub-block
        c["qs_off"] = k.add(k.shl(k.shr(j, 1), 5), q)  # 32 * (j // 2) + q
        c["q"] = q
        hi = k.and_(j, 1)
        if wtype == "Q4_K":
            c["rot"] = k.and_(k.sub(3, k.shl(hi, 2)), 31)
        else:
            c["rot"] = k.and_(k.sub(2, k.shl(hi, 2)), 31)
            c["hrot"] = k.and_(k.sub(6, j), 31)  # bit j of each qh byte to bit 6
        return c
    # Q6_K
    h = k.shr(lane, 4)
    lp = k.and_(lane, 15)
    qq = k.shr(lp, 2)
    pos = k.shl(k.and_(lp, 3), 3)
    c["ql_off"] = k.add(k.add(k.shl(h, 6), k.shl(k.and_(qq, 1), 5)), pos)  # 64h + 32(qq%2) + pos
    c["qh_off"] = k.add(k.add(k.shl(h, 5), pos), 128)  # 128 + 32h + pos
    c["sc_off"] = k.add(k.add(k.add(k.shl(h, 3), k.shl(qq, 1)), k.shr(pos, 4)), 192)  # 192 + sub-block
    qhi = k.shr(qq, 1)
    c["rot_l"] = k.and_(k.sub(1, k.shl(qhi, 2)), 31)  # low nibble to bits 1..4: rotl 1; high: rotl 29
    c["rot_h"] = k.and_(k.sub(5, k.shl(qq, 1)), 31)  # bits 2qq..2qq+1 to bits 5..6
    c["fr_l"] = k.and_(k.sub(16, c["rot_l"]), 31)  # the same from a word at phase 2 (lds_bits)
    c["fr_h"] = k.and_(k.sub(16, c["rot_h"]), 31)
    return c


def decode_dense(k: KernelBuilder, wtype: str, bb: Reg, offset: int) -> Decoded:
    """8 values at ``bb + offset`` (16-byte aligned: dense rows are whole 16-byte vectors)."""
    if wtype == "F32":
        fs = list(k.load("shared", "f32", bb, offset, vec=4)) + list(k.load("shared", "f32", bb, offset + 16, vec=4))
        return Decoded(fs, 1.0)
    words = list(k.load("shared", "u32", bb, offset, vec=4))
    fs = []
    for w in words:
        if wtype == "F16":
            lo, hi = k.unpack_b32(w)
            fs.append(k.cvt(Reg(lo.name, F16_TYPE), "f32"))
            fs.append(k.cvt(Reg(hi.name, F16_TYPE), "f32"))
        else:  # BF16: the upper 16 bits of a float32
            fs.append(k.bitcast(k.shl(w, 16), "f32"))
            fs.append(k.bitcast(k.and_(w, 0xFFFF0000), "f32"))
    return Decoded(fs, 1.0)


def decode_q32(k: KernelBuilder, wtype: str, bb: Reg | None, lc: dict, sel_qs: Reg | None, sel_qh: Reg | None,
               align_qs: int | None, align_qh: int | None, fields: tuple[Reg, Reg | None, Reg] | None = None) -> Decoded:
    """A 32-value block type (Q8_0/Q4_0/Q4_1/Q5_0/Q5_1) at shared address ``bb`` (the lane's block).

    ``fields``: the block re-encoded as tile-major weights hold it (``TILED_B32``; ``bb`` unused): the
    shared addresses of its scale field (d, then m), its qh word (lane order, None for Q4_0 / Q4_1) and
    its 16 qs bytes, each aligned (the lane constants made with ``tiled``)."""
    if fields is not None:
        return _decode_q32_tiled(k, wtype, lc, *fields)
    d = lds_f16(k, bb, 0)
    if wtype == "Q8_0":
        qs = field_offset(wtype, "qs")
        addr = k.add(bb, lc["pos"])
        words = lds_words(k, addr, qs, 2, align_qs, sel_qs)
        fs = magic_q8(k, words[0]) + magic_q8(k, words[1])
        return Decoded(fs, d)
    qs = field_offset(wtype, "qs")
    words = lds_words(k, k.add(bb, lc["qoff"]), qs, 2, align_qs, sel_qs)
    five = wtype in ("Q5_0", "Q5_1")
    if not five:
        ts = [nibbles_to_bits(k, w, lc["rot4"], 0x78787878) for w in words]
    else:
        qh = lds_words(k, bb, field_offset(wtype, "qh"), 1, align_qh, sel_qh)[0]
        hb = k.shr(qh, lc["pos"])  # bits pos.. of qh: the high bits of this lane's 8 values
        ts = []
        for i, w in enumerate(words):
            low = nibbles_to_bits(k, w, lc["rot5"], 0x3C3C3C3C)
            hi = k.shl(spread4(k, hb if i == 0 else k.shr(hb, 4)), 6)
            ts.append(k.or_(low, hi))
    return _small_codes(k, wtype, ts, d, lambda: lds_f16(k, bb, field_offset(wtype, "m")))


def _small_codes(k: KernelBuilder, wtype: str, ts: list[Reg], d: Reg, m) -> Decoded:
    """The Decoded of a 4- or 5-bit block type from its two words of codes ``n << (7 - bits)`` a byte,
    its d and (Q4_1, Q5_1) ``m()``, its min."""
    fs = magic_small(k, ts[0]) + magic_small(k, ts[1])
    # n = 2 half f - half with half = 2**bits / 2
    half = 32.0 if wtype in ("Q5_0", "Q5_1") else 16.0
    if wtype in ("Q4_0", "Q5_0"):
        # the code offset is half / 2 (8 or 16): d (n - half/2) = d (2 half f - 1.5 half)
        return Decoded(fs, d, 2 * half, -1.5 * half)
    return Decoded(fs, d, 2 * half, -half, m())  # d n + m = d (2 half f - half) + m


def swizzle_key16(k: KernelBuilder, wtype: str, row: Reg | int) -> Reg | int:
    """16 times the chunk permutation key of tile row ``row`` (``SWIZZLE``; any row congruent to it mod 8
    has the same key): the row keeps logical byte ``B`` of its unit at ``B ^ key16``. 0 for the types
    without one."""
    if wtype not in SWIZZLE:
        return 0
    shift, mask = SWIZZLE[wtype]
    if isinstance(row, int):
        return ((row >> shift) & mask) << 4
    return k.shl(k.and_(k.shr(row, shift) if shift else row, mask), 4)


def tiled_fields(k: KernelBuilder, wtype: str, unit: Reg, blk: Reg | int,
                 key16: Reg | int = 0) -> tuple[Reg, Reg | None, Reg]:
    """:func:`decode_q32`'s ``fields`` of block ``blk`` (0..7) of a re-encoded unit (tile-major weights,
    ``TILED_B32``) staged at shared address ``unit``; ``key16``: the row's :func:`swizzle_key16` (its
    logical byte B sits at ``B ^ key16``)."""
    tb = TILED_B32[wtype]
    swizzled = isinstance(key16, Reg) or key16 != 0

    def at(base: int, size: int) -> Reg:
        if isinstance(blk, int):
            off = base + size * blk
        elif swizzled:
            off = k.add(k.mul(blk, size), base) if base else k.mul(blk, size)
        else:
            return k.add(k.add(unit, base) if base else unit, k.mul(blk, size))
        if swizzled:  # (the register operand first)
            off = off ^ key16 if isinstance(off, int) and isinstance(key16, int) else \
                k.xor(key16, off) if isinstance(key16, Reg) else k.xor(off, key16)
        return k.add(unit, off) if isinstance(off, Reg) or off else unit
    return at(0, tb["sc"]), (at(tb["qh"], 4) if tb["qh"] is not None else None), at(tb["qs"], 16)


def _decode_q32_tiled(k: KernelBuilder, wtype: str, lc: dict, sc: Reg, qh: Reg | None, qs: Reg) -> Decoded:
    """:func:`decode_q32` of a re-encoded block: every field aligned, the fifth bits in lane order."""
    d = lds_f16(k, sc, 0)
    words = list(k.load("shared", "u32", k.add(qs, lc["qoff"]), vec=2))
    if qh is None:
        ts = [nibbles_to_bits(k, w, lc["rot4"], 0x78787878) for w in words]
    else:
        bits = k.load("shared", "u32", qh)
        ts = [k.or_(nibbles_to_bits(k, w, lc["rot5"], 0x3C3C3C3C), nibbles_to_bits(k, bits, lc["qhrot"][i], 0x40404040))
              for i, w in enumerate(words)]
    return _small_codes(k, wtype, ts, d, lambda: lds_f16(k, sc, 2))


def k_scale_pair(k: KernelBuilder, wtype: str, bb: Reg, sel: dict) -> list[Reg]:
    """(A_j, C_j, A_j+1, C_j+1) of sub-blocks j = 2u, 2u + 1 of the Q4_K/Q5_K block at ``bb``
    (16-aligned); ``sel`` is :func:`k_pair_selectors` of u (a lane constant, 0..3).

    The 6-bit scales and mins of four sub-blocks are unpacked at once, one per byte (j < 4:
    ``scales[j] & 63``, ``scales[j + 4] & 63``; j >= 4: the low/high nibble of ``scales[j + 4]`` with
    the top two bits of ``scales[j - 4]`` / ``scales[j]`` above it), then each byte becomes the float
    ``2**23 + n`` with one ``prmt`` and an FMA removes the ``2**23``: A = (32 or 64) d sc and
    C = -(A / 2 + dmin mn), each rounded once (as ``d * sc`` and ``dmin * mn`` would be)."""
    sc, mn, d, dmin = k_scale_codes(k, bb, sel)
    # 4-bit: n = 32 f - 16 -> d sc n - dmin mn = 32 d sc f - (16 d sc + dmin mn); 5-bit: 64 d sc f - ...
    da = k.mul(d, 32.0 if wtype == "Q4_K" else 64.0)
    da_off = k.mul(da, -8388608.0)  # -(2**23) da: exact
    ndmin = k.neg(dmin)
    dmin_off = k.mul(dmin, 8388608.0)
    out = []
    for byte in ("b0", "b1"):
        a = k.fma(k.bitcast(k.prmt(sc, 0x4B000000, sel[byte]), "f32"), da, da_off)
        neg_ml = k.fma(k.bitcast(k.prmt(mn, 0x4B000000, sel[byte]), "f32"), ndmin, dmin_off)
        out += [a, k.fma(a, -0.5, neg_ml)]
    return out


def k_scale_codes(k: KernelBuilder, bb: Reg, sel: dict) -> tuple[Reg, Reg, Reg, Reg]:
    """(sc, mn, d, dmin) of the Q4_K/Q5_K block at ``bb`` (16-aligned) for :func:`k_scale_pair`: the 6-bit
    scales and mins of four sub-blocks (2u, 2u + 1 in the bytes ``sel["b0"]``, ``sel["b1"]`` select), one
    per byte of ``sc`` and ``mn``, and the block's d and dmin as f32."""
    h0, h1, h2, h3 = k.load("shared", "u32", bb, 0, vec=4)
    lo_sc = k.prmt(h1, h3, sel["word"])  # scales[0..3] (j < 4) or scales[8..11]
    lo_mn = k.prmt(h2, h3, sel["word"])  # scales[4..7] (j < 4) or scales[8..11]
    sc = k.or_(k.and_(lo_sc, sel["m1"]), k.and_(k.shr(h1, 2), sel["m2"]))
    mn = k.or_(k.and_(k.shr(lo_mn, sel["shm"]), sel["m1"]), k.and_(k.shr(h2, 2), sel["m2"]))
    dlo, dhi = k.unpack_b32(h0)
    d = k.cvt(Reg(dlo.name, F16_TYPE), "f32")
    dmin = k.cvt(Reg(dhi.name, F16_TYPE), "f32")
    return sc, mn, d, dmin


def k_pair_selectors(k: KernelBuilder, u: Reg) -> dict:
    """Lane constants for :func:`k_scale_pair` of sub-blocks 2u, 2u + 1 (``u`` a register, 0..3)."""
    upper = k.shr(u, 1)  # 1 for j >= 4
    b0 = k.or_(k.shl(k.and_(u, 1), 1), 0x7440)  # prmt: byte 2 * (u % 2) of the word -> the float 2**23 + byte
    return {
        "word": k.mad(upper, 0x4444, 0x3210),  # the first word (j < 4) or the second
        "m1": k.sub(0x3F3F3F3F, k.mul(upper, 0x30303030)),  # 63 or 15 per byte
        "m2": k.mul(upper, 0x30303030),  # 0 or 0x30 per byte
        "shm": k.shl(upper, 2),  # 0 or 4
        "b0": b0,
        "b1": k.add(b0, 1),
    }


def decode_kq(k: KernelBuilder, wtype: str, bb: Reg, lc: dict) -> list[Reg]:
    """The lane's 8 codes of a Q4_K/Q5_K block at ``bb`` (16-aligned) as magic floats."""
    qs = field_offset(wtype, "qs")
    words = k.load("shared", "u32", k.add(bb, lc["qs_off"]), qs, vec=2)
    if wtype == "Q4_K":
        ts = [nibbles_to_bits(k, w, lc["rot"], 0x78787878) for w in words]
    else:
        qh = k.load("shared", "u32", k.add(bb, lc["q"]), field_offset(wtype, "qh"), vec=2)
        ts = []
        for w, h in zip(words, qh):
            low = nibbles_to_bits(k, w, lc["rot"], 0x3C3C3C3C)
            hi = nibbles_to_bits(k, h, lc["hrot"], 0x40404040)
            ts.append(k.or_(low, hi))
    return magic_small(k, ts[0]) + magic_small(k, ts[1])


def decode_q6k(k: KernelBuilder, bb: Reg, lc: dict, phase: tuple[int, int] | None, sel: Reg | None = None,
               d_at: Reg | None = None) -> Decoded:
    """The lane's 8 values of the Q6_K block at ``bb`` (an even address). ``phase``: what is known of
    its alignment, ``(modulus, residue)`` as for :func:`lds_bits`; None when only the runtime realign
    selector ``sel`` (:func:`realign_selector` of ``bb``) knows it. ``d_at``: where the block's d is, if
    not after its scales (tile-major weights keep a half-tile's d after its rows)."""
    if phase is not None:  # ql/qh offsets are multiples of 8: the block's phase is theirs
        lows = lds_bits(k, k.add(bb, lc["ql_off"]), 2, phase, lc["rot_l"], lc.get("fr_l"), 0x1E1E1E1E)
        his = lds_bits(k, k.add(bb, lc["qh_off"]), 2, phase, lc["rot_h"], lc.get("fr_h"), 0x60606060)
    else:
        ql = lds_words(k, k.add(bb, lc["ql_off"]), 0, 2, None, sel)
        qh = lds_words(k, k.add(bb, lc["qh_off"]), 0, 2, None, sel)
        lows = [nibbles_to_bits(k, w, lc["rot_l"], 0x1E1E1E1E) for w in ql]
        his = [nibbles_to_bits(k, w, lc["rot_h"], 0x60606060) for w in qh]
    ts = [k.or_(lo, hi) for lo, hi in zip(lows, his)]
    fs = magic_small(k, ts[0]) + magic_small(k, ts[1])
    d = lds_f16(k, bb, field_offset("Q6_K", "d")) if d_at is None else lds_f16(k, d_at, 0)
    sc8 = k.load("shared", "s8", k.add(bb, lc["sc_off"]))
    sc = k.cvt(Reg(sc8.name, ptx_type("s16")), "f32")
    # q = 128 f - 64: dl (q - 32) = dl (128 f - 96)
    return Decoded(fs, k.mul(d, sc), 128.0, -96.0)
