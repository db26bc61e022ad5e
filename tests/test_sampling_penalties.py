"""OpenAI's presence/frequency penalties, the log-softmax behind reported logprobs, and the top-N
list: each against a direct float64 computation on drawn data."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.errors import InvalidRequestError
from realizar.sampling import (
    Sampler,
    apply_presence_frequency_penalty,
    log_softmax,
    probabilities,
    sample_token,
    top_logprobs,
)
from tests.helpers import examples

_vocab = st.integers(2, 64)


@settings(max_examples=examples(40), deadline=None)
@given(n=_vocab, seed=st.integers(0, 2**31 - 1), presence=st.floats(-2, 2), frequency=st.floats(-2, 2))
def test_penalty_subtracts_presence_plus_frequency_times_count(n, seed, presence, frequency):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal(n) * 3 + 0.5
    generated = rng.integers(0, n, size=int(rng.integers(1, 3 * n))).tolist()
    before = logits.copy()
    out = apply_presence_frequency_penalty(logits, generated + [-1, n], presence, frequency)  # out of range: ignored
    expect = logits.astype(np.float64).copy()
    for t in range(n):
        c = generated.count(t)
        if c:
            expect[t] -= presence + frequency * c
    np.testing.assert_allclose(out, expect, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(logits, before)  # not modified in place


def test_penalties_change_the_sampled_distribution_as_specified():
    logits = np.array([2.0, 1.0, 0.0, -1.0])
    generated = [0, 0, 0, 1]
    sampler = Sampler(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, seed=3)
    draws = np.bincount([sampler(logits, generated, generated) for _ in range(20000)], minlength=4) / 20000
    # token 0: 2 - 0.5 - 0.75 = 0.75; token 1: 1 - 0.5 - 0.25 = 0.25; others unchanged
    expect = probabilities(np.array([0.75, 0.25, 0.0, -1.0]))
    np.testing.assert_allclose(draws, expect, atol=0.015)


def test_penalty_changes_the_greedy_choice_and_negative_encourages():
    logits = np.array([1.0, 0.9, -3.0])
    assert sample_token(logits, generated=[0]) == 0
    assert sample_token(logits, generated=[0], presence_penalty=0.2) == 1
    assert sample_token(logits, generated=[0, 0], frequency_penalty=0.1) == 1
    assert sample_token(logits, generated=[2, 2], presence_penalty=-2.0, frequency_penalty=-2.0) == 2


def test_penalties_look_at_generated_not_the_prompt_history():
    logits = np.array([1.0, 0.9])
    s = Sampler(presence_penalty=1.0)
    assert s(logits, previous=[0, 0, 0], generated=[]) == 0
    assert s(logits, previous=[0], generated=[0]) == 1


class _DeviceLike(np.ndarray):
    """Logits that record whether the sampler used the on-device argmax."""

    def greedy_token(self):
        self.used_device = True
        return int(np.argmax(np.asarray(self)))


def test_greedy_fast_path_only_without_penalties():
    z = np.array([1.0, 0.5]).view(_DeviceLike)
    assert Sampler()(z, [0], [0]) == 0 and getattr(z, "used_device", False)
    z = np.array([1.0, 0.5]).view(_DeviceLike)
    assert Sampler(presence_penalty=1.0)(z, [0], [0]) == 1 and not getattr(z, "used_device", False)


@pytest.mark.parametrize("kw", [{"presence_penalty": 2.5}, {"frequency_penalty": -2.01},
                                {"presence_penalty": float("nan")}])  # fmt: skip
def test_penalties_out_of_range_are_refused(kw):
    with pytest.raises(InvalidRequestError, match=next(iter(kw))):
        Sampler(**kw)


@settings(max_examples=examples(40), deadline=None)
@given(n=_vocab, seed=st.integers(0, 2**31 - 1), scale=st.floats(0.1, 50))
def test_log_softmax_and_top_logprobs(n, seed, scale):
    logits = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    lp = log_softmax(logits)
    z = logits.astype(np.float64)
    expect = z - np.log(np.sum(np.exp(z - z.max()))) - z.max()
    np.testing.assert_allclose(lp, expect, rtol=0, atol=1e-9)
    assert abs(np.exp(lp).sum() - 1.0) < 1e-9
    k = int(np.random.default_rng(seed + 1).integers(0, n + 3))
    tops = top_logprobs(lp, k)
    assert len(tops) == min(k, n)
    order = sorted(range(n), key=lambda i: (-lp[i], i))[: min(k, n)]
    assert [i for i, _ in tops] == order
    assert all(v == lp[i] for i, v in tops)
