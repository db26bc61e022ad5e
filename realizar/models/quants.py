"""GGML weight types on the file-format side: block tables, sizes and NumPy dequantization.

The block layouts themselves (:class:`BlockLayout`, :data:`LAYOUTS`, ...) live in :mod:`ptx_gen.ggml`,
where the PTX kernels read them; this module re-exports them, turns their plain ``ValueError``s into
realizar's error types (:class:`UnsupportedError` for a type without a layout, :class:`ShapeError` for
a row that is not whole blocks), and dequantizes through ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from ptx_gen import ggml
from ptx_gen.ggml import LAYOUTS, QK_K, SUPPORTED_TYPES, BlockField, BlockLayout, GGMLType
from realizar.errors import ShapeError, UnsupportedError

__all__ = [
    "BlockField",
    "BlockLayout",
    "GGMLType",
    "LAYOUTS",
    "SUPPORTED_TYPES",
    "QK_K",
    "layout",
    "type_name",
    "row_nbytes",
    "tensor_nbytes",
    "dequantize",
]


def type_name(ggml_type: int) -> str:
    """Human-readable name of a GGML type id, also for ids this gguf version does not know."""
    try:
        return T(int(ggml_type)).name
    except ValueError:
        return f"ggml type {int(ggml_type)} (unknown)"


def layout(ggml_type: int) -> BlockLayout:
    """The :class:`BlockLayout` of ``ggml_type``; :class:`UnsupportedError` for any other type."""
    try:
        return ggml.layout(int(ggml_type))
    except ValueError:
        supported = ", ".join(t.name for t in LAYOUTS)
        raise UnsupportedError(
            f"unsupported tensor type {type_name(ggml_type)}; supported: {supported}"
        ) from None


def row_nbytes(ggml_type: int, n: int) -> int:
    """Bytes taken by a row of ``n`` values; :class:`ShapeError` when ``n`` is not whole blocks."""
    lay = layout(ggml_type)
    try:
        return ggml.row_nbytes(lay.ggml_type, n)
    except ValueError as e:
        raise ShapeError(str(e)) from None


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


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode ``data`` (raw bytes as uint8, or any array whose bytes are the blocks) of GGML type
    ``ggml_type`` into a new float32 array of NumPy ``shape`` (last axis = rows of blocks).

    The decoding is ``gguf.quants.dequantize`` (it works through groups of rows, which bounds its
    temporaries); this adds the size check against ``shape`` and always returns a fresh array."""
    lay = layout(ggml_type)
    shape = tuple(int(s) for s in shape)
    nbytes = tensor_nbytes(lay.ggml_type, shape)
    raw = np.ascontiguousarray(data)
    raw = raw.reshape(-1).view(np.uint8) if raw.ndim else raw.reshape(1).view(np.uint8)
    if raw.size != nbytes:
        raise ShapeError(
            f"{lay.name} tensor of shape {shape} needs {nbytes} bytes, got {raw.size}"
        )
    if nbytes == 0:
        return np.zeros(shape, dtype=np.float32)
    rows = raw.reshape(-1, row_nbytes(lay.ggml_type, shape[-1] if shape else 1))
    out = gguf_quants.dequantize(rows, T(int(lay.ggml_type)))
    if np.may_share_memory(out, raw):  # F32 comes back as a view of the input
        out = out.copy()
    return out.reshape(shape)
