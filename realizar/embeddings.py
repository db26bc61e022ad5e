"""Sentence embeddings from a decoder's final-norm hidden states (``/v1/embeddings``).

A sequence's rows (:meth:`realizar.models.reference.ReferenceModel.hidden_states`: after the final RMSNorm, what the
LM head reads) are pooled as the model's :attr:`~realizar.models.config.ModelConfig.pooling` says — the last
token's row (Qwen3-Embedding and other decoder embedders), the mean of every row, or the first token's — and
scaled to unit L2 norm. ``dimensions`` below the hidden size keeps the first ``dimensions`` values and
renormalises them (OpenAI's and Qwen3-Embedding's Matryoshka truncation).
"""

from __future__ import annotations

import numpy as np

from realizar.errors import InvalidRequestError

__all__ = ["pool", "normalize", "truncate", "unit_vectors"]


def pool(rows: np.ndarray, mode: str) -> np.ndarray:
    """One vector ``[hidden]`` from a sequence's hidden ``rows [S, hidden]``: ``"last"``, ``"mean"`` or ``"cls"``."""
    if mode == "last":
        return rows[-1]
    if mode == "mean":
        return rows.mean(axis=0, dtype=np.float64).astype(np.float32)
    if mode == "cls":
        return rows[0]
    raise InvalidRequestError(f"unknown pooling {mode!r} (expected 'last', 'mean' or 'cls')")


def normalize(x: np.ndarray) -> np.ndarray:
    """Each row of ``x [n, d]`` scaled to unit L2 norm (computed in float64; an all-zero row stays zero)."""
    norm = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    return (x / np.where(norm > 0, norm, 1.0)).astype(np.float32)


def truncate(x: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Unit rows ``x [n, hidden]`` cut to their first ``dimensions`` values and renormalised (None: as they are)."""
    if dimensions is None or dimensions == x.shape[-1]:
        return x
    if not 1 <= dimensions <= x.shape[-1]:
        raise InvalidRequestError(f"dimensions must be between 1 and the model's {x.shape[-1]}, got {dimensions}")
    return normalize(x[:, :dimensions])


def unit_vectors(pooled: list[np.ndarray], hidden: int, dimensions: int | None) -> np.ndarray:
    """The embeddings of a request from its inputs' pooled rows: ``[len(pooled), dimensions or hidden]``, unit norm."""
    out = normalize(np.stack(pooled)) if pooled else np.zeros((0, hidden), np.float32)
    return truncate(out, dimensions)
