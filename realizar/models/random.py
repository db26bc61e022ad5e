"""Random GGUF-encoded weights for experiments, benchmarks and tests.

    rng = np.random.default_rng(0)
    raw = random_weight(rng, "Q4_K", 4096, 4096)      # uint8 GGUF bytes of a 4096 x 4096 Q4_K tensor
    w = dequant(raw, "Q4_K", 4096, 4096)              # the float32 matrix those bytes encode

Any byte pattern is a valid quantized block once its f16 scale fields are finite, so random codes
plus random finite scales give a tensor every kernel must handle, without a model file.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from realizar.models.quants import LAYOUTS, dequantize

__all__ = ["random_weight", "dequant"]

# f16 fields of each block type that must hold finite numbers
_F16_FIELDS = {
    "Q8_0": ("d",), "Q4_0": ("d",), "Q4_1": ("d", "m"), "Q5_0": ("d",), "Q5_1": ("d", "m"),
    "Q4_K": ("d", "dmin"), "Q5_K": ("d", "dmin"), "Q6_K": ("d",),
}


def random_weight(rng: np.random.Generator, wtype: str, out_dim: int, in_dim: int, scale: float = 1.0) -> np.ndarray:
    """Raw GGUF bytes (uint8) of an ``out_dim x in_dim`` tensor of type ``wtype`` (a GGML type name:
    F32, F16, BF16 or a block type) with random codes and finite random scales."""
    if wtype == "F32":
        return (rng.standard_normal((out_dim, in_dim)) * scale).astype(np.float32).reshape(-1).view(np.uint8)
    if wtype == "F16":
        return (rng.standard_normal((out_dim, in_dim)) * scale).astype(np.float16).reshape(-1).view(np.uint8)
    if wtype == "BF16":
        f = (rng.standard_normal((out_dim, in_dim)) * scale).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).reshape(-1).view(np.uint8)
    if wtype not in _F16_FIELDS:
        raise ValueError(f"no random weights for type {wtype!r}; known: F32, F16, BF16, {', '.join(_F16_FIELDS)}")
    lay = LAYOUTS[T[wtype]]
    if in_dim % lay.block_size:
        raise ValueError(f"in_dim {in_dim} is not a multiple of the {wtype} block size {lay.block_size}")
    nb = out_dim * in_dim // lay.block_size
    raw = rng.integers(0, 256, size=(nb, lay.type_size), dtype=np.uint8)
    for name in _F16_FIELDS[wtype]:
        off = lay.offset(name)
        # K-quant scales multiply 6-bit sub-scales: a smaller magnitude keeps the weights near unit size
        mag = scale / (64.0 if wtype in ("Q4_K", "Q5_K", "Q6_K") else 16.0)
        vals = (rng.uniform(0.25, 1.0, nb) * mag * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def dequant(raw: np.ndarray, wtype: str, out_dim: int, in_dim: int) -> np.ndarray:
    """The float32 ``out_dim x in_dim`` matrix that the GGUF bytes ``raw`` of type ``wtype`` encode."""
    return dequantize(raw, T[wtype], (out_dim, in_dim))
