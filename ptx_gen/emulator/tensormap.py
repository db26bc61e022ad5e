"""The emulator's tensor maps: a 2-D tiled ``CUtensorMap`` for ``cp.async.bulk.tensor``.

The driver's ``CUtensorMap`` (``cuTensorMapEncodeTiled``) is 128 opaque bytes. The emulated device writes this
module's own 128-byte encoding instead (:func:`encode`), and the emulator's ``cp.async.bulk.tensor`` reads it
(:func:`decode`): the same fields, the same checks the driver makes of the forms the kernels use, the same
landing (elements outside the tensor as zeros; the 128-byte swizzle: within each 1024 bytes, the 16-byte piece
``p`` of the 128-byte row ``r`` at piece ``p ^ r % 8``).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ptx_gen.emulator.memory import EmulatorError

MAGIC = b"RZTMAP2D"
_FIELDS = struct.Struct("<8sQQQQIIII")  # magic, base, inner, outer, stride, box_inner, box_outer, elem_bytes, swizzle
SWIZZLES = (0, 128)


@dataclass(frozen=True)
class TensorMap2d:
    """``outer`` rows of ``inner`` elements of ``elem_bytes`` at ``base``, rows ``stride`` bytes apart; a copy moves a
    box of ``box_outer`` rows of ``box_inner`` elements, laid out row after row (``swizzle`` 128: swizzled)."""

    base: int
    inner: int
    outer: int
    stride: int
    box_inner: int
    box_outer: int
    elem_bytes: int
    swizzle: int


def check(t: TensorMap2d) -> None:
    """The driver's requirements of a tiled 2-D map, for the forms emulated (ValueError naming the field)."""
    if t.base % 16:
        raise ValueError(f"a tensor map's global address must be 16-byte aligned, got {t.base:#x}")
    if t.stride % 16 or t.stride < t.inner * t.elem_bytes:
        raise ValueError(f"a tensor map's row stride must be a multiple of 16 bytes covering a row, got {t.stride}")
    if not (1 <= t.box_inner <= 256 and 1 <= t.box_outer <= 256):
        raise ValueError(f"a tensor map's box dimensions must be in 1..256, got {t.box_inner} x {t.box_outer}")
    if (t.box_inner * t.elem_bytes) % 16:
        raise ValueError(f"a tensor map's box rows must be multiples of 16 bytes, got {t.box_inner * t.elem_bytes}")
    if t.swizzle not in SWIZZLES:
        raise ValueError(f"swizzle must be one of {SWIZZLES} bytes, got {t.swizzle}")
    if t.swizzle and t.box_inner * t.elem_bytes != t.swizzle:
        raise ValueError(f"a {t.swizzle}-byte swizzle takes box rows of {t.swizzle} bytes (the form emulated), got "
                         f"{t.box_inner * t.elem_bytes}")


def encode(t: TensorMap2d) -> bytes:
    """The 128 bytes of ``t`` (checked first)."""
    check(t)
    raw = _FIELDS.pack(MAGIC, t.base, t.inner, t.outer, t.stride, t.box_inner, t.box_outer, t.elem_bytes, t.swizzle)
    return raw + bytes(128 - len(raw))


def decode(raw: bytes | np.ndarray) -> TensorMap2d:
    raw = bytes(raw)
    if len(raw) != 128 or raw[:8] != MAGIC:
        raise EmulatorError("cp.async.bulk.tensor: the tensor map is not one the emulated device encoded")
    _, *fields = _FIELDS.unpack(raw[:_FIELDS.size])
    return TensorMap2d(*fields)


def box(t: TensorMap2d, read, c0: int, c1: int) -> np.ndarray:
    """The box at coordinates (``c0`` innermost, ``c1``) as it lands in shared memory (bytes): rows read with
    ``read(address, nbytes)``, elements outside the tensor as zeros, the swizzle applied."""
    row_bytes = t.box_inner * t.elem_bytes
    out = np.zeros((t.box_outer, row_bytes), np.uint8)
    lo, hi = max(c0, 0), min(c0 + t.box_inner, t.inner)  # the elements of a row inside the tensor
    for r in range(t.box_outer):
        y = c1 + r
        if 0 <= y < t.outer and lo < hi:
            a = (lo - c0) * t.elem_bytes
            out[r, a:a + (hi - lo) * t.elem_bytes] = read(t.base + y * t.stride + lo * t.elem_bytes, (hi - lo) * t.elem_bytes)
    if t.swizzle:
        pieces = out.reshape(t.box_outer, row_bytes // 16, 16)
        rows = np.arange(t.box_outer)[:, None]
        swz = np.empty_like(pieces)
        swz[rows, np.arange(row_bytes // 16)[None, :] ^ (rows % 8)] = pieces
        out = swz
    return out.reshape(-1)
