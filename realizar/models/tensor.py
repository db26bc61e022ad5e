"""QuantTensor: a weight kept in its file's block form, dequantized on demand."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuantTensor:
    """One weight tensor as stored in the model file.

    ``shape`` is the logical NumPy (row-major) shape, e.g. ``(out_dim, in_dim)`` for a matrix whose rows
    are the GEMV dot products; ``ggml_type`` is a ``gguf.GGMLQuantizationType`` value (F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); ``data`` is the raw bytes as a uint8 array
    (possibly a read-only view of a memory map) laid out row by row in GGUF block form.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """Return the values as a new float32 array of ``shape``."""
        from realizar.models.quants import dequantize

        return dequantize(self.data, self.ggml_type, self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)
