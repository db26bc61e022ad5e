"""GGML block layouts, defined once, and NumPy dequantization.

Every weight type realizar reads is described here by a :class:`BlockLayout`: how many values one block
holds, how many bytes it takes, and the byte offset and size of each field inside the block. The GPU
GEMV kernels take their offsets from these tables, so a layout is written down in one place only.

A row of ``n`` values is ``n // block_size`` consecutive blocks; a tensor of NumPy shape
``(..., n)`` is its rows one after the other. All multi-byte fields are little-endian. ``f16`` is IEEE
half precision; ``d``/``dmin``/``m`` are per-block scales/minimums.

Value order inside a block (``q`` is the unsigned integer code, ``y`` the value):

* ``Q8_0`` (32 values, 34 bytes): ``y[i] = int8(qs[i]) * d``.
* ``Q4_0`` (32, 18): ``q[i] = qs[i] & 0xF`` for i < 16, ``qs[i-16] >> 4`` for i >= 16;
  ``y = d * (q - 8)``.
* ``Q4_1`` (32, 20): nibbles as Q4_0; ``y = d * q + m``.
* ``Q5_0`` (32, 22): nibbles as Q4_0, bit 4 of value i is bit i of the little-endian uint32 ``qh``;
  ``y = d * (q - 16)``.
* ``Q5_1`` (32, 24): as Q5_0; ``y = d * q + m``.
* ``Q4_K`` (256 values, 144 bytes): 8 sub-blocks of 32 values, each with a 6-bit scale ``sc[j]`` and
  6-bit min ``mn[j]`` packed into ``scales[12]``::

      j < 4:  sc[j] = scales[j] & 63                     mn[j] = scales[j + 4] & 63
      j >= 4: sc[j] = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
              mn[j] = (scales[j + 4] >> 4)  | ((scales[j] >> 6) << 4)

  ``qs`` is 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and sub-block 2c+1 in
  its high nibbles: value ``32*(2c) + l`` is ``qs[32c + l] & 0xF``, value ``32*(2c+1) + l`` is
  ``qs[32c + l] >> 4``. ``y = (d * sc[j]) * q - (dmin * mn[j])``.
* ``Q5_K`` (256, 176): as Q4_K plus ``qh[32]``: bit 4 of value ``32*j + l`` is bit j of ``qh[l]``.
* ``Q6_K`` (256, 210): 16 sub-blocks of 16 values with int8 scales ``scales[16]``; the block is two
  halves of 128 values (h = 0, 1) using ``ql[64h : 64h+64]`` and ``qh[32h : 32h+32]``; for l < 32::

      value 128h + l      : (ql[64h + l]      & 0xF) | (((qh[32h + l] >> 0) & 3) << 4)
      value 128h + l + 32 : (ql[64h + l + 32] & 0xF) | (((qh[32h + l] >> 2) & 3) << 4)
      value 128h + l + 64 : (ql[64h + l]      >> 4)  | (((qh[32h + l] >> 4) & 3) << 4)
      value 128h + l + 96 : (ql[64h + l + 32] >> 4)  | (((qh[32h + l] >> 6) & 3) << 4)

  ``y[i] = (d * scales[i // 16]) * (q[i] - 32)``.

The arithmetic (float32, operation order as written above) reproduces ``gguf.quants.dequantize`` bit
for bit; ``tests/test_quants.py`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from realizar.errors import ShapeError, UnsupportedError

__all__ = [
    "BlockField",
    "BlockLayout",
    "LAYOUTS",
    "SUPPORTED_TYPES",
    "QK_K",
    "layout",
    "type_name",
    "row_nbytes",
    "tensor_nbytes",
    "dequantize",
]

QK_K = 256  # values per K-quant super-block


@dataclass(frozen=True)
class BlockField:
    """One field of a block: ``name`` at byte ``offset``, ``size`` bytes, element type ``dtype``."""

    name: str
    offset: int
    size: int
    dtype: str  # "f16", "f32", "bf16", "u8", "i8", "u32"
    doc: str = ""


@dataclass(frozen=True)
class BlockLayout:
    """The byte layout of one block of a GGML type.

    ``block_size`` values are stored in ``type_size`` bytes; ``fields`` lists the parts of a block in
    byte order (their sizes add up to ``type_size``). ``offset(name)`` gives a field's byte offset.
    """

    ggml_type: T
    name: str
    block_size: int
    type_size: int
    fields: tuple[BlockField, ...]

    def field(self, name: str) -> BlockField:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"{self.name} has no field {name!r}")

    def offset(self, name: str) -> int:
        return self.field(name).offset

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type_size / self.block_size


def _layout(ggml_type: T, block_size: int, *fields: tuple[str, int, str, str]) -> BlockLayout:
    out, offset = [], 0
    for name, size, dtype, doc in fields:
        out.append(BlockField(name, offset, size, dtype, doc))
        offset += size
    return BlockLayout(ggml_type, ggml_type.name, block_size, offset, tuple(out))


LAYOUTS: dict[T, BlockLayout] = {
    T.F32: _layout(T.F32, 1, ("value", 4, "f32", "the value")),
    T.F16: _layout(T.F16, 1, ("value", 2, "f16", "the value")),
    T.BF16: _layout(T.BF16, 1, ("value", 2, "bf16", "upper 16 bits of the float32 value")),
    T.Q8_0: _layout(
        T.Q8_0, 32,
        ("d", 2, "f16", "scale"),
        ("qs", 32, "i8", "signed codes, value i at byte i"),
    ),
    T.Q4_0: _layout(
        T.Q4_0, 32,
        ("d", 2, "f16", "scale"),
        ("qs", 16, "u8", "values 0..15 in low nibbles, 16..31 in high nibbles; code offset 8"),
    ),
    T.Q4_1: _layout(
        T.Q4_1, 32,
        ("d", 2, "f16", "scale"),
        ("m", 2, "f16", "minimum (added)"),
        ("qs", 16, "u8", "values 0..15 in low nibbles, 16..31 in high nibbles"),
    ),
    T.Q5_0: _layout(
        T.Q5_0, 32,
        ("d", 2, "f16", "scale"),
        ("qh", 4, "u32", "bit i = bit 4 of value i (little-endian uint32)"),
        ("qs", 16, "u8", "low 4 bits: values 0..15 low nibbles, 16..31 high nibbles; code offset 16"),
    ),
    T.Q5_1: _layout(
        T.Q5_1, 32,
        ("d", 2, "f16", "scale"),
        ("m", 2, "f16", "minimum (added)"),
        ("qh", 4, "u32", "bit i = bit 4 of value i (little-endian uint32)"),
        ("qs", 16, "u8", "low 4 bits: values 0..15 low nibbles, 16..31 high nibbles"),
    ),
    T.Q4_K: _layout(
        T.Q4_K, QK_K,
        ("d", 2, "f16", "super-block scale of the 6-bit sub-block scales"),
        ("dmin", 2, "f16", "super-block scale of the 6-bit sub-block mins"),
        ("scales", 12, "u8", "8 scales + 8 mins, 6 bits each (see module doc)"),
        ("qs", 128, "u8", "4 chunks of 32 bytes: sub-block 2c low nibbles, 2c+1 high nibbles"),
    ),
    T.Q5_K: _layout(
        T.Q5_K, QK_K,
        ("d", 2, "f16", "super-block scale of the 6-bit sub-block scales"),
        ("dmin", 2, "f16", "super-block scale of the 6-bit sub-block mins"),
        ("scales", 12, "u8", "8 scales + 8 mins, 6 bits each (as Q4_K)"),
        ("qh", 32, "u8", "bit j of qh[l] = bit 4 of value 32*j + l"),
        ("qs", 128, "u8", "low 4 bits, arranged as Q4_K"),
    ),
    T.Q6_K: _layout(
        T.Q6_K, QK_K,
        ("ql", 128, "u8", "low 4 bits (see module doc)"),
        ("qh", 64, "u8", "high 2 bits (see module doc)"),
        ("scales", 16, "i8", "signed scale of each 16-value sub-block"),
        ("d", 2, "f16", "super-block scale"),
    ),
}

SUPPORTED_TYPES: frozenset[T] = frozenset(LAYOUTS)


def type_name(ggml_type: int) -> str:
    """Human-readable name of a GGML type id, also for ids this gguf version does not know."""
    try:
        return T(int(ggml_type)).name
    except ValueError:
        return f"ggml type {int(ggml_type)} (unknown)"


def layout(ggml_type: int) -> BlockLayout:
    """The :class:`BlockLayout` of ``ggml_type``; :class:`UnsupportedError` for any other type."""
    try:
        return LAYOUTS[T(int(ggml_type))]
    except (ValueError, KeyError):
        supported = ", ".join(t.name for t in LAYOUTS)
        raise UnsupportedError(
            f"unsupported tensor type {type_name(ggml_type)}; supported: {supported}"
        ) from None


def row_nbytes(ggml_type: int, n: int) -> int:
    """Bytes taken by a row of ``n`` values; :class:`ShapeError` when ``n`` is not whole blocks."""
    lay = layout(ggml_type)
    n = int(n)
    if n < 0 or n % lay.block_size:
        raise ShapeError(
            f"a {lay.name} row of {n} values is not a multiple of the block size {lay.block_size}"
        )
    return n // lay.block_size * lay.type_size


def tensor_nbytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    """Bytes taken by a tensor of NumPy ``shape`` (last axis = row) of type ``ggml_type``."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        shape = (1,)
    if any(s < 0 for s in shape):
        raise ShapeError(f"negative dimension in shape {shape}")
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows * row_nbytes(ggml_type, shape[-1])


# ---------------------------------------------------------------------------------------------
# Dequantization. Each function takes a (n_blocks, type_size) uint8 array and returns
# (n_blocks, block_size) float32, with the operation order of gguf.quants (see module doc).

_NIBBLE_SHIFT = np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)


def _f16(b: np.ndarray, offset: int) -> np.ndarray:
    """Column of f16 fields at byte ``offset`` of each block, as float32, shape (n_blocks, 1)."""
    return np.ascontiguousarray(b[:, offset : offset + 2]).view(np.float16).astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32) codes: low nibbles are values 0..15, high nibbles 16..31."""
    return ((qs[:, None, :] >> _NIBBLE_SHIFT) & np.uint8(0xF)).reshape(qs.shape[0], 32)


def _qh_bits_32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes (a little-endian uint32) -> (n, 32) bits: bit i of the word."""
    return np.unpackbits(qh, axis=1, bitorder="little")


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    return b[:, 2:34].view(np.int8).astype(np.float32) * d


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    q = _nibbles_32(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles_32(b[:, 4:20]).astype(np.float32)
    return d * q + m


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b, 0)
    q = _nibbles_32(b[:, 6:22]) | (_qh_bits_32(b[:, 2:6]) << np.uint8(4))
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles_32(b[:, 8:24]) | (_qh_bits_32(b[:, 4:8]) << np.uint8(4))
    return d * q.astype(np.float32) + m


def _k_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed bytes -> (n, 8) 6-bit scales and (n, 8) 6-bit mins (Q4_K / Q5_K)."""
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _q4k_low_bits(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 8, 32) low-4-bit codes of the 8 sub-blocks."""
    n = qs.shape[0]
    return ((qs.reshape(n, 4, 1, 32) >> _NIBBLE_SHIFT.reshape(1, 1, 2, 1)) & np.uint8(0xF)).reshape(
        n, 8, 32
    )


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    q = _q4k_low_bits(b[:, 16:144]).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


_BIT_SHIFT_8 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales_mins(b[:, 4:16])
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    high = (b[:, None, 16:48] >> _BIT_SHIFT_8) & np.uint8(1)  # (n, 8, 32): bit j of qh[l]
    q = (_q4k_low_bits(b[:, 48:176]) | (high << np.uint8(4))).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


_SHIFT_0246 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b, 208)
    dl = (d * scales).reshape(n, 16, 1)
    # ql: per half h, bytes 64h..64h+63; low nibbles give values +0..63, high nibbles +64..127.
    low = ((ql.reshape(n, 2, 1, 64) >> _NIBBLE_SHIFT.reshape(1, 1, 2, 1)) & np.uint8(0xF)).reshape(
        n, 2, 4, 32
    )
    # qh: per half h, bytes 32h..32h+31; bit pairs 0,2,4,6 give values +0, +32, +64, +96.
    high = (qh.reshape(n, 2, 1, 32) >> _SHIFT_0246) & np.uint8(3)
    q = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    return (dl * q.reshape(n, 16, 16)).reshape(n, QK_K)


_BLOCK_DEQUANT = {
    T.Q8_0: _deq_q8_0,
    T.Q4_0: _deq_q4_0,
    T.Q4_1: _deq_q4_1,
    T.Q5_0: _deq_q5_0,
    T.Q5_1: _deq_q5_1,
    T.Q4_K: _deq_q4_k,
    T.Q5_K: _deq_q5_k,
    T.Q6_K: _deq_q6_k,
}

_CHUNK_BLOCKS = 1 << 15  # blocks per chunk: bounds the temporaries of one step


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode ``data`` (raw bytes as uint8, or any array whose bytes are the blocks) of GGML type
    ``ggml_type`` into a new float32 array of NumPy ``shape`` (last axis = rows of blocks)."""
    lay = layout(ggml_type)
    shape = tuple(int(s) for s in shape)
    nbytes = tensor_nbytes(lay.ggml_type, shape)
    raw = np.ascontiguousarray(data)
    raw = raw.reshape(-1).view(np.uint8) if raw.ndim else raw.reshape(1).view(np.uint8)
    if raw.size != nbytes:
        raise ShapeError(
            f"{lay.name} tensor of shape {shape} needs {nbytes} bytes, got {raw.size}"
        )
    t = lay.ggml_type
    if t == T.F32:
        return raw.view("<f4").astype(np.float32).reshape(shape)
    if t == T.F16:
        return raw.view("<f2").astype(np.float32).reshape(shape)
    if t == T.BF16:
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32).reshape(shape)

    n_blocks = nbytes // lay.type_size
    blocks = raw.reshape(n_blocks, lay.type_size)
    out = np.empty((n_blocks, lay.block_size), dtype=np.float32)
    fn = _BLOCK_DEQUANT[t]
    for start in range(0, n_blocks, _CHUNK_BLOCKS):
        stop = min(start + _CHUNK_BLOCKS, n_blocks)
        out[start:stop] = fn(blocks[start:stop])
    return out.reshape(shape)
