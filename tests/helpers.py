"""Small helpers shared by tests: random data that is never zero, NaN poisoning checks, hypothesis example
counts by profile."""

from __future__ import annotations

import os

import numpy as np

# Hypothesis profiles (tests/conftest.py loads the same one): "dev", the default, the fast suite a contributor
# runs; "ci", every test at the example counts written in it (what CI's full run uses); "full", four times those.
PROFILES = ("dev", "ci", "full")
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
if PROFILE not in PROFILES:
    raise ValueError(f"HYPOTHESIS_PROFILE must be one of {PROFILES}, got {PROFILE!r}")
_SCALE = {"dev": 0.1, "ci": 1.0, "full": 4.0}


def examples(n: int) -> int:
    """A test's hypothesis example count under the loaded profile: ``n`` (as written) under "ci", ``4 n``
    under "full", a tenth (at least 2) under "dev"."""
    scale = _SCALE[PROFILE]
    return max(2, min(n, round(n * scale))) if scale < 1 else int(n * scale)


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


def fit_mma_shape(wtype: str, units: int, mtiles: int, kparts: int, stages: int, tiles: int,
                  tiled: bool = False) -> tuple[int, ...]:
    """A drawn tensor-core GEMV launch shape shrunk to one that exists: at most 8 warps (fewer K parts
    first, then fewer warps along the rows), then a ring that fits the shared memory (fewer stages,
    then fewer warps along the rows). Returns (in_dim, mtiles, kparts, stages), in_dim = 256 kparts units
    (Q6_K on GGUF rows: 2048 units, the multiple its tensor-core kernel needs)."""
    from ptx_gen.kernels.gemv.gemv_mma import layout

    while mtiles * kparts > 8:
        kparts, mtiles = (kparts // 2, mtiles) if kparts > 1 else (kparts, mtiles - 1)
    in_dim = 2048 * units if wtype == "Q6_K" and not tiled else 256 * kparts * units
    while True:
        try:
            layout(wtype, in_dim, mtiles, kparts, stages, tiles, tiled)
            return in_dim, mtiles, kparts, stages
        except ValueError:  # more shared memory than a CTA may have
            stages, mtiles = ({8: 4, 4: 3, 3: 2}[stages], mtiles) if stages > 2 else (stages, mtiles - 1)


def fit_wide_mma_shape(wtype: str, kparts: int, extra: int, mtiles: int, tiled: bool) -> tuple[int, int] | None:
    """A drawn shape of a tensor-core GEMV with up to 16 warps and K parts that need not divide the units:
    (in_dim, mtiles) with kparts + extra units (Q6_K on GGUF rows: rounded up to whole 2048-value groups)
    and the most warps along the rows, up to ``mtiles``, that fit 16 warps and the shared memory (2 stages,
    32-row warps); None where not even one row tile fits."""
    from ptx_gen.kernels.gemv.gemv_mma import layout

    units = kparts + extra
    if wtype == "Q6_K" and not tiled:
        units = -(-units // 8) * 8
    in_dim = 256 * units
    for m in range(max(1, min(mtiles, 16 // kparts)), 0, -1):
        try:
            layout(wtype, in_dim, m, kparts, 2, 2, tiled)
            return in_dim, m
        except ValueError:  # more shared memory than a CTA may have (Q8_0, Q6_K with many warps)
            continue
    return None


def rel_err(got, want) -> float:
    """max |got - want| / max |want| in float64, after checking that ``got`` is finite everywhere."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


def greedy_walk(ref, model, prompt, steps: int) -> tuple[list, list]:
    """(reference logits, model logits) of ``prompt`` then ``steps`` greedy tokens, both fed the reference's
    choices: prefill, then one decode a token (``model``'s outputs copied to the host)."""
    want, got = [ref.prefill(prompt)], [np.asarray(model.prefill(prompt)).copy()]
    for _ in range(steps):
        tok = int(np.argmax(want[-1]))
        want.append(ref.decode(tok))
        got.append(np.asarray(model.decode(tok)).copy())
    return want, got


def tiered(values, fast, ids=None, unpack: bool = False) -> list:
    """``values`` as pytest params: those whose index is in ``fast`` run in every suite, the others only in
    the exhaustive tier (marked ``full``). ``ids``: a function of the value or a list; ``unpack``: each value
    is a tuple of several arguments."""
    import pytest

    out = []
    for i, v in enumerate(values):
        marks = () if i in fast else (pytest.mark.full,)
        if hasattr(v, "values") and hasattr(v, "marks"):  # already a pytest.param: keep its marks and id
            out.append(pytest.param(*v.values, marks=(*v.marks, *marks), id=v.id))
            continue
        pid = None if ids is None else (ids(v) if callable(ids) else ids[i])
        out.append(pytest.param(*(v if unpack else (v,)), marks=marks, id=pid))
    return out
