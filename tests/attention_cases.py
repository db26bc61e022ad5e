"""Inputs and float64 references shared by the attention tests (GPU and emulator)."""

from __future__ import annotations

import numpy as np

from realizar.models.attention import gqa_attention


def prefill_case(rng: np.random.Generator, h: int, kvh: int, d: int, sq: int, sk: int, slack: int, scale: float,
                 causal: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """q ``[h, sq, d]`` (scaled), K/V ``[kvh, sk + slack, d]`` as a cache read in place (rows past
    ``sk`` are NaN and must never be read), and the float64 reference ``[h, sq, d]``."""
    q = (rng.standard_normal((h, sq, d)) * scale).astype(np.float32)
    k = np.full((kvh, sk + slack, d), np.nan, np.float32)
    v = np.full((kvh, sk + slack, d), np.nan, np.float32)
    k[:, :sk] = rng.standard_normal((kvh, sk, d))
    v[:, :sk] = rng.standard_normal((kvh, sk, d))
    ref = gqa_attention(q.astype(np.float64), k[:, :sk].astype(np.float64), v[:, :sk].astype(np.float64),
                        causal=causal)
    return q, k, v, ref
