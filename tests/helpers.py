"""Small helpers shared by tests: random data that is never zero, NaN poisoning checks."""

from __future__ import annotations

import numpy as np


def random_array(rng: np.random.Generator, shape, scale: float = 1.0, dtype=np.float32) -> np.ndarray:
    """Random normal data that is never all zeros (and has no exact zeros at all)."""
    x = rng.standard_normal(shape) * scale
    x[x == 0] = scale
    return x.astype(dtype)


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float, what: str = "") -> None:
    """Every element finite and ||actual - expected|| / ||expected|| below ``rtol``, elementwise too."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    bad = ~np.isfinite(actual)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite outputs (unwritten?) at {np.argwhere(bad)[:5].tolist()}"
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    err = np.abs(actual - expected)
    worst = int(np.argmax(err))
    assert err.flat[worst] <= rtol * scale, (
        f"{what}: max abs error {err.flat[worst]:.3e} at flat index {worst} exceeds {rtol:g} x max|ref| {scale:.3e}"
    )
