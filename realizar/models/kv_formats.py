"""The KV cache's element formats in NumPy: how a K or V value is rounded when a cache stores it.

One definition for every cache that stores K/V below float32: the GPU's paged pools
(:mod:`realizar.gpu.paged_kv`, whose append kernels round exactly so) and the NumPy serving backend
(:mod:`realizar.serving.cpu_backend`), so the CPU backend shows what each format does to a model's
logits without a GPU.

* ``f32``: as computed. ``f16``: IEEE half, nearest even. ``bf16``: the top 16 bits of the float32,
  nearest even (NaN kept quiet).
* ``q8_0``: GGML's Q8_0 over each 32 values of a head row: ``d = max|x| / 127``, codes
  ``rint(x / d)`` as int8, ``d`` stored as float16; read back as ``code * float32(d)``.
"""

from __future__ import annotations

import numpy as np

from realizar.errors import ShapeError

__all__ = ["KV_FORMATS", "QK", "block_bytes", "dequantize_q8_0", "quantize_q8_0", "round_bf16", "round_kv",
           "row_bytes"]

KV_FORMATS = ("f32", "f16", "bf16", "q8_0")
QK = 32  # values per q8_0 group


def row_bytes(head_dim: int, kv_format: str) -> int:
    """Bytes one head row (one position of one KV head, K or V) takes in ``kv_format``
    (q8_0: the int8 codes and one float16 scale per 32 values)."""
    if kv_format == "q8_0":
        return head_dim + head_dim // QK * 2
    if kv_format not in KV_FORMATS:
        raise ShapeError(f"kv format must be one of {KV_FORMATS}, got {kv_format!r}")
    return head_dim * (4 if kv_format == "f32" else 2)


def block_bytes(config, block_size: int, kv_format: str) -> int:
    """Bytes one KV block of ``block_size`` positions takes over all layers of a model of ``config``
    (its num_layers, num_kv_heads, head_dim), K and V: what a memory budget divides by to get the
    number of blocks."""
    return 2 * config.num_layers * config.num_kv_heads * block_size * row_bytes(config.head_dim, kv_format)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """GGML's Q8_0 over groups of 32 along the last axis, as the append kernels compute it (f32 arithmetic):
    ``d = max|x| / 127``, ``id = 1 / d`` (0 for d = 0), codes ``rint(x * id)`` (nearest even) as int8,
    scales ``float16(d)``. Returns (codes shaped like ``x``, scales ``[..., n / 32]`` float16). A group
    holding NaN gets a NaN scale (codes 0)."""
    x = np.asarray(x, np.float32)
    if x.shape[-1] % QK:
        raise ShapeError(f"q8_0 quantises groups of {QK} values: the last axis ({x.shape[-1]}) must be a multiple")
    g = x.reshape(*x.shape[:-1], x.shape[-1] // QK, QK)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        d = np.max(np.abs(g), axis=-1) / np.float32(127)
        inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
        codes = np.rint(g * inv[..., None])
    codes = np.nan_to_num(codes, nan=0.0).astype(np.int8).reshape(x.shape)
    return codes, d.astype(np.float16)


def dequantize_q8_0(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``code * scale`` (what every kernel reads from a q8_0 pool)."""
    g = codes.reshape(*codes.shape[:-1], codes.shape[-1] // QK, QK).astype(np.float32)
    return (g * scales.astype(np.float32)[..., None]).reshape(codes.shape)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """The bf16 bit patterns (uint16) of float32 ``x``, nearest even; NaN stays a (quiet) NaN."""
    x = np.ascontiguousarray(x, np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), (x.view(np.uint32) >> 16).astype(np.uint16) | 0x40, rounded)


def round_kv(x: np.ndarray, kv_format: str) -> np.ndarray:
    """``x`` (float32) as a cache of ``kv_format`` stores and reads it back, as float32."""
    x = np.asarray(x, np.float32)
    if kv_format == "f32":
        return x
    if kv_format == "f16":
        return x.astype(np.float16).astype(np.float32)
    if kv_format == "bf16":
        return (round_bf16(x).astype(np.uint32) << 16).view(np.float32)
    if kv_format == "q8_0":
        return dequantize_q8_0(*quantize_q8_0(x))
    raise ShapeError(f"kv format must be one of {KV_FORMATS}, got {kv_format!r}")
