"""Shapes, tolerances and hypothesis strategies shared by the emulator tests of the attention kernels
(tests/test_attention_ptx.py and tests/test_flash_decoding_ptx.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

HEAD_DIMS = [32, 48, 64, 80, 96, 128, 256]
RTOL = 1e-5


def _rel(actual: np.ndarray, expected: np.ndarray) -> float:
    assert np.all(np.isfinite(actual)), f"non-finite outputs at {np.argwhere(~np.isfinite(actual))[:5].tolist()}"
    return float(np.max(np.abs(actual.astype(np.float64) - expected)) / max(np.max(np.abs(expected)), 1e-30))


variants = st.sampled_from([{}, {}, {"scores": "butterfly"}, {"prefetch": True}, {"unroll": 2}, {"l2_prefetch": 0},
                            {"warps": 8, "l2_prefetch": 4}])

heads = st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (7, 1), (8, 2), (3, 3), (16, 1), (12, 4)])
