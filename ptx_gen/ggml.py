"""GGML block layouts, written down once: what the GEMV/GEMM/embedding kernels decode.

Every weight type the kernels and the model loaders read is described here by a :class:`BlockLayout`:
how many values one block holds, how many bytes it takes, and the byte offset and size of each field inside the block. The GPU
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

This module depends on nothing but the standard library, so the PTX emitter can use it without the
file-format side (``realizar.models.quants``), which re-exports these tables and adds the
project's own error types and NumPy dequantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "GGMLType",
    "BlockField",
    "BlockLayout",
    "LAYOUTS",
    "SUPPORTED_TYPES",
    "QK_K",
    "layout",
    "row_nbytes",
]


class GGMLType(IntEnum):
    """The GGML type ids (as stored in GGUF files) of the types with a layout here. Members compare
    and hash as their integer ids, so they index :data:`LAYOUTS` interchangeably with
    ``gguf.GGMLQuantizationType`` members or plain ints."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


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

    ggml_type: GGMLType
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


def _layout(ggml_type: GGMLType, block_size: int, *fields: tuple[str, int, str, str]) -> BlockLayout:
    out, offset = [], 0
    for name, size, dtype, doc in fields:
        out.append(BlockField(name, offset, size, dtype, doc))
        offset += size
    return BlockLayout(ggml_type, ggml_type.name, block_size, offset, tuple(out))


LAYOUTS: dict[GGMLType, BlockLayout] = {
    GGMLType.F32: _layout(GGMLType.F32, 1, ("value", 4, "f32", "the value")),
    GGMLType.F16: _layout(GGMLType.F16, 1, ("value", 2, "f16", "the value")),
    GGMLType.BF16: _layout(GGMLType.BF16, 1, ("value", 2, "bf16", "upper 16 bits of the float32 value")),
    GGMLType.Q8_0: _layout(
        GGMLType.Q8_0, 32,
        ("d", 2, "f16", "scale"),
        ("qs", 32, "i8", "signed codes, value i at byte i"),
    ),
    GGMLType.Q4_0: _layout(
        GGMLType.Q4_0, 32,
        ("d", 2, "f16", "scale"),
        ("qs", 16, "u8", "values 0..15 in low nibbles, 16..31 in high nibbles; code offset 8"),
    ),
    GGMLType.Q4_1: _layout(
        GGMLType.Q4_1, 32,
        ("d", 2, "f16", "scale"),
        ("m", 2, "f16", "minimum (added)"),
        ("qs", 16, "u8", "values 0..15 in low nibbles, 16..31 in high nibbles"),
    ),
    GGMLType.Q5_0: _layout(
        GGMLType.Q5_0, 32,
        ("d", 2, "f16", "scale"),
        ("qh", 4, "u32", "bit i = bit 4 of value i (little-endian uint32)"),
        ("qs", 16, "u8", "low 4 bits: values 0..15 low nibbles, 16..31 high nibbles; code offset 16"),
    ),
    GGMLType.Q5_1: _layout(
        GGMLType.Q5_1, 32,
        ("d", 2, "f16", "scale"),
        ("m", 2, "f16", "minimum (added)"),
        ("qh", 4, "u32", "bit i = bit 4 of value i (little-endian uint32)"),
        ("qs", 16, "u8", "low 4 bits: values 0..15 low nibbles, 16..31 high nibbles"),
    ),
    GGMLType.Q4_K: _layout(
        GGMLType.Q4_K, QK_K,
        ("d", 2, "f16", "super-block scale of the 6-bit sub-block scales"),
        ("dmin", 2, "f16", "super-block scale of the 6-bit sub-block mins"),
        ("scales", 12, "u8", "8 scales + 8 mins, 6 bits each (see module doc)"),
        ("qs", 128, "u8", "4 chunks of 32 bytes: sub-block 2c low nibbles, 2c+1 high nibbles"),
    ),
    GGMLType.Q5_K: _layout(
        GGMLType.Q5_K, QK_K,
        ("d", 2, "f16", "super-block scale of the 6-bit sub-block scales"),
        ("dmin", 2, "f16", "super-block scale of the 6-bit sub-block mins"),
        ("scales", 12, "u8", "8 scales + 8 mins, 6 bits each (as Q4_K)"),
        ("qh", 32, "u8", "bit j of qh[l] = bit 4 of value 32*j + l"),
        ("qs", 128, "u8", "low 4 bits, arranged as Q4_K"),
    ),
    GGMLType.Q6_K: _layout(
        GGMLType.Q6_K, QK_K,
        ("ql", 128, "u8", "low 4 bits (see module doc)"),
        ("qh", 64, "u8", "high 2 bits (see module doc)"),
        ("scales", 16, "i8", "signed scale of each 16-value sub-block"),
        ("d", 2, "f16", "super-block scale"),
    ),
}

SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(LAYOUTS)


def layout(ggml_type: int | str) -> BlockLayout:
    """The :class:`BlockLayout` of ``ggml_type`` (a type id or name such as ``"Q4_K"``);
    :class:`ValueError` for any other type."""
    try:
        t = GGMLType[ggml_type] if isinstance(ggml_type, str) else GGMLType(int(ggml_type))
        return LAYOUTS[t]
    except (ValueError, KeyError):
        supported = ", ".join(t.name for t in LAYOUTS)
        raise ValueError(f"unsupported tensor type {ggml_type!r}; supported: {supported}") from None


def row_nbytes(ggml_type: int | str, n: int) -> int:
    """Bytes taken by a row of ``n`` values; :class:`ValueError` when ``n`` is not whole blocks."""
    lay = layout(ggml_type)
    n = int(n)
    if n < 0 or n % lay.block_size:
        raise ValueError(
            f"a {lay.name} row of {n} values is not a multiple of the block size {lay.block_size}"
        )
    return n // lay.block_size * lay.type_size
