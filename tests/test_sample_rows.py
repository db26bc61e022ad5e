"""The NumPy mirror of the device sampling kernel, ``realizar.sampling.sample_rows``: against a
float64 sort-based reference of the semantics (top-k, then top-p over the renormalised kept mass, then
Gumbel-max with the counter-based hash RNG), the RNG pinned by a pure-Python definition, greedy ties,
statistics of the draw, and the checks on bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.errors import ModelOutputError, InvalidRequestError, ShapeError
from realizar.sampling import RowSampling, hash_uniform, row_key, sample_rows, top_p_margin
from tests.helpers import examples

M32 = 0xFFFFFFFF


def _fmix(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & M32
    return x ^ (x >> 16)


def _py_uniform(seed: int, step: int, t: int) -> float:
    key = _fmix(_fmix(_fmix((seed & M32) ^ 0x9E3779B9) ^ (seed >> 32)) ^ step)
    h = _fmix((_fmix(t ^ key) + key) & M32)
    return ((h >> 8) | 1) * 2.0**-24


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8))
@settings(max_examples=examples(60), deadline=None)
def test_hash_rng_matches_its_definition(seed, step, tokens):
    u = hash_uniform(seed, step, np.array(tokens, np.uint32))
    assert u.dtype == np.float32
    assert [float(v) for v in u] == [_py_uniform(seed, step, t) for t in tokens]
    assert ((u > 0) & (u < 1)).all()
    assert row_key(seed, step) == _fmix(_fmix(_fmix((seed & M32) ^ 0x9E3779B9) ^ (seed >> 32)) ^ step)


def test_uniforms_look_uniform():
    u = hash_uniform(12345, 7, np.arange(200_000, dtype=np.uint32)).astype(np.float64)
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    expected = u.size / 20
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 60, chi2  # 19 degrees of freedom: p < 1e-5 above 50
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01
    other = hash_uniform(12346, 7, np.arange(1000, dtype=np.uint32))
    assert not np.array_equal(other, u[:1000].astype(np.float32))


def _reference(row: np.ndarray, spec: RowSampling) -> tuple[set[int], bool]:
    """float64 sort-based semantics. Returns the acceptable tokens (one unless the draw sits within
    rounding of a tie between Gumbel keys) and whether the top-p cut is too close to call."""
    if spec.temperature == 0.0:
        return {int(np.flatnonzero(row == row.max())[0])}, False
    z = (row * (np.float32(1) / np.float32(spec.temperature))).astype(np.float64)  # the f32 z, exact in f64
    order = np.lexsort((np.arange(z.size), -z))  # descending value, ascending index
    keep = np.ones(z.size, bool)
    if 0 < spec.top_k < z.size:
        kth = z[order[spec.top_k - 1]]
        keep = z >= kth
    close = False
    if spec.top_p < 1.0:
        w = np.where(keep, np.exp(z - z.max()), 0.0)
        s = w.sum()
        cum = np.cumsum(w[order])
        n = int(np.searchsorted(cum, spec.top_p * s, side="left")) + 1  # smallest prefix reaching p*S
        tau = z[order[min(n, z.size) - 1]]
        keep &= z >= tau  # ties at tau kept
        close = top_p_margin(row, spec) < 1e-9
    u = hash_uniform(spec.seed, spec.step, np.arange(z.size, dtype=np.uint32)).astype(np.float64)
    key = np.where(keep, z - np.log(-np.log(u)), -np.inf)
    best = key.max()
    tol = 1e-5 * max(1.0, abs(best))
    return {int(i) for i in np.flatnonzero(key >= best - tol)}, close


specs = st.builds(
    RowSampling,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    top_k=st.one_of(st.just(0), st.integers(1, 40)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0, exclude_min=True)),
    seed=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**32 - 1),
)


def _logits(rng: np.random.Generator, b: int, v: int, scale: float, ties: bool) -> np.ndarray:
    x = rng.standard_normal((b, v)) * scale
    x = np.where(x == 0, 0.5, x).astype(np.float32)  # never zero
    if ties:  # a few repeated values, among them the maximum
        for r in range(b):
            idx = rng.choice(v, size=min(v, 3), replace=False)
            x[r, idx] = x[r].max()
            x[r, rng.integers(0, v)] = x[r, rng.integers(0, v)]
    return x


@given(st.integers(1, 6), st.integers(1, 300), st.floats(0.1, 8.0), st.booleans(), st.data(), st.integers(0, 2**32 - 1))
@settings(max_examples=examples(120), deadline=None)
def test_mirror_matches_float64_reference(b, v, scale, ties, data, seed):
    rng = np.random.default_rng(seed)
    x = _logits(rng, b, v, scale, ties)
    row_specs = [data.draw(specs) for _ in range(b)]
    got = sample_rows(x, row_specs)
    assert got.dtype == np.int64 and got.shape == (b,)
    for r in range(b):
        ok, close = _reference(x[r], row_specs[r])
        if not close:
            assert int(got[r]) in ok, (r, row_specs[r], got[r], ok)


def test_greedy_is_argmax_lowest_index_on_ties():
    x = np.array([[1.0, 3.0, -2.0, 3.0], [-np.inf, -1.0, -1.0, -5.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    assert sample_rows(x, [RowSampling()] * 3).tolist() == [1, 1, 0]


def test_filters_are_respected():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 500)).astype(np.float32)
    top5 = set(np.argsort(-x[0])[:5].tolist())
    got = {int(sample_rows(x, [RowSampling(2.0, top_k=5, seed=s)])[0]) for s in range(300)}
    assert got == top5
    p = np.exp(x[0] - x[0].max())
    p /= p.sum()
    order = np.argsort(-p)
    n = int(np.searchsorted(np.cumsum(p[order]), 0.3)) + 1
    got = {int(sample_rows(x, [RowSampling(1.0, top_p=0.3, seed=s, step=9)])[0]) for s in range(400)}
    assert got == set(order[:n].tolist())
    # top-k = 1 is greedy, whatever the temperature
    assert {int(sample_rows(x, [RowSampling(3.0, top_k=1, seed=s)])[0]) for s in range(50)} == {int(x.argmax())}
    # -inf tokens are never drawn
    y = np.full((1, 6), -np.inf, np.float32)
    y[0, [1, 4]] = [0.0, 0.1]
    assert {int(sample_rows(y, [RowSampling(5.0, seed=s)])[0]) for s in range(200)} == {1, 4}


def test_draws_follow_softmax():
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    x = np.log(probs).astype(np.float32)[None] * 2.0  # temperature 2 undoes the factor 2
    n = 20_000
    counts = np.bincount([sample_rows(x, [RowSampling(2.0, seed=s, step=3)])[0] for s in range(n)], minlength=4)
    chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum()
    assert chi2 < 16.3, (counts, chi2)  # 3 degrees of freedom, p = 0.001
    # over the steps of one seed as well
    counts = np.bincount([sample_rows(x, [RowSampling(2.0, seed=77, step=s)])[0] for s in range(n)], minlength=4)
    assert ((counts - n * probs) ** 2 / (n * probs)).sum() < 16.3, counts
    # top-p 0.6 keeps {3, 2} (0.4 + 0.3 >= 0.6) renormalised to 4/7, 3/7
    counts = np.bincount([sample_rows(x, [RowSampling(2.0, top_p=0.6, seed=s)])[0] for s in range(n)], minlength=4)
    assert counts[0] == counts[1] == 0
    assert abs(counts[3] / n - 4 / 7) < 0.015, counts


def test_same_row_alone_or_in_a_batch():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    s = [RowSampling(0.9, top_k=10, top_p=0.9, seed=i * 1000, step=i) for i in range(8)]
    batch = sample_rows(x, s)
    assert batch.tolist() == [int(sample_rows(x[i : i + 1], [s[i]])[0]) for i in range(8)]
    assert batch.tolist() == sample_rows(x[::-1].copy(), s[::-1])[::-1].tolist()


@pytest.mark.parametrize(
    "kwargs, word",
    [({"temperature": -1.0}, "temperature"), ({"temperature": math.inf}, "temperature"),
     ({"temperature": 1e39}, "float32"), ({"temperature": 1e-45}, "float32"), ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
     ({"step": 2**32}, "step"), ({"seed": 1.5}, "seed"), ({"step": True}, "step")],
)
def test_bad_specs_are_refused(kwargs, word):
    with pytest.raises(InvalidRequestError, match=word):
        RowSampling(**kwargs)


def test_bad_logits_are_refused():
    x = np.zeros((2, 4), np.float32) + 1
    with pytest.raises(ShapeError, match="one RowSampling per row"):
        sample_rows(x, [RowSampling()])
    with pytest.raises(ShapeError, match="shape"):
        sample_rows(x[0], [RowSampling()])
    with pytest.raises(ModelOutputError, match="NaN"):
        sample_rows(np.array([[1.0, np.nan]], np.float32), [RowSampling()])
    with pytest.raises(InvalidRequestError, match="finite"):
        sample_rows(np.array([[-np.inf, -np.inf]], np.float32), [RowSampling()])
    with pytest.raises(InvalidRequestError, match="overflow"):
        sample_rows(np.array([[3e38, 1.0]], np.float32), [RowSampling(0.5)])
    with pytest.raises(InvalidRequestError, match="RowSampling"):
        sample_rows(x, [RowSampling(), {"temperature": 1.0}])


def test_row_sampling_at_step_keeps_the_checked_fields():
    spec = RowSampling(temperature=0.7, top_k=40, top_p=0.9, seed=2**40 + 3, step=0)
    later = spec.at_step(17)
    assert later == RowSampling(temperature=0.7, top_k=40, top_p=0.9, seed=2**40 + 3, step=17)
    assert spec.step == 0  # a new spec; the original is unchanged
    for bad in (-1, 2**32, 1.5, True):
        with pytest.raises(InvalidRequestError, match="step must be an integer"):
            spec.at_step(bad)
