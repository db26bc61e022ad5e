"""The NumPy attention reference against a naive per-element Python loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.errors import ShapeError
from realizar.models.attention import attention_with_cache_gqa, gqa_attention, multi_head_attention
from tests.helpers import examples


def naive_attention(q, k, v, causal, q_offset=None):
    """q [H, Sq, D], k/v [KVH, Sk, D]; plain Python floats, one element at a time."""
    H, Sq, D = q.shape
    KVH, Sk, _ = k.shape
    group = H // KVH
    if q_offset is None:
        q_offset = Sk - Sq
    out = np.zeros((H, Sq, D), dtype=np.float64)
    scale = 1.0 / math.sqrt(D)
    for h in range(H):
        kv = h // group
        for i in range(Sq):
            last = q_offset + i if causal else Sk - 1
            scores = []
            for j in range(last + 1):
                s = 0.0
                for d in range(D):
                    s += float(q[h, i, d]) * float(k[kv, j, d])
                scores.append(s * scale)
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            z = sum(w)
            for d in range(D):
                acc = 0.0
                for j in range(last + 1):
                    acc += w[j] * float(v[kv, j, d])
                out[h, i, d] = acc / z
    return out


heads = st.sampled_from([(1, 1), (2, 1), (4, 1), (4, 2), (6, 3), (8, 2), (3, 3)])
head_dims = st.sampled_from([1, 2, 7, 16, 64, 80, 96])


@settings(max_examples=examples(40), deadline=None)
@given(hk=heads, d=head_dims, past=st.integers(0, 12), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([0.1, 1.0, 10.0]))  # fmt: skip
def test_cache_attention_matches_naive_float64(hk, d, past, seed, scale):
    h, kvh = hk
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((h, d)) * scale
    kc = rng.standard_normal((kvh, past, d)) * scale
    vc = rng.standard_normal((kvh, past, d))
    ck = rng.standard_normal((kvh, d)) * scale
    cv = rng.standard_normal((kvh, d))
    out = attention_with_cache_gqa(q, kc, vc, ck, cv)
    assert out.shape == (h, d) and out.dtype == np.float64
    k = np.concatenate([kc, ck[:, None]], axis=1)
    v = np.concatenate([vc, cv[:, None]], axis=1)
    ref = naive_attention(q[:, None, :], k, v, causal=False)[:, 0]
    np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)


@settings(max_examples=examples(30), deadline=None)
@given(hk=heads, d=head_dims, s=st.integers(1, 9), extra=st.integers(0, 4), causal=st.booleans(),
       seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_multi_head_attention_matches_naive(hk, d, s, extra, causal, seed):
    h, kvh = hk
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((h, s, d))
    k = rng.standard_normal((kvh, s + extra, d))
    v = rng.standard_normal((kvh, s + extra, d))
    out = multi_head_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(out, naive_attention(q, k, v, causal), rtol=1e-10, atol=1e-12)


def test_float32_in_float32_out_close_to_float64_oracle():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 64)).astype(np.float32)
    kc = rng.standard_normal((2, 33, 64)).astype(np.float32)
    vc = rng.standard_normal((2, 33, 64)).astype(np.float32)
    ck = rng.standard_normal((2, 64)).astype(np.float32)
    cv = rng.standard_normal((2, 64)).astype(np.float32)
    out = attention_with_cache_gqa(q, kc, vc, ck, cv)
    assert out.dtype == np.float32
    ref = attention_with_cache_gqa(*(a.astype(np.float64) for a in (q, kc, vc, ck, cv)))
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6)


def test_float16_inputs_are_computed_in_float32():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 1, 16)).astype(np.float16)
    k = rng.standard_normal((1, 5, 16)).astype(np.float16)
    assert gqa_attention(q, k, k, causal=True).dtype == np.float32


def test_empty_cache_returns_current_value():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((6, 32))
    cv = rng.standard_normal((3, 32))
    out = attention_with_cache_gqa(q, np.zeros((3, 0, 32)), np.zeros((3, 0, 32)), rng.standard_normal((3, 32)), cv)
    np.testing.assert_allclose(out, np.repeat(cv, 2, axis=0), rtol=0, atol=1e-15)


def test_softmax_is_stable_for_huge_scores():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((4, 1, 8)) * 1e4
    k = rng.standard_normal((2, 20, 8)) * 1e4
    v = rng.standard_normal((2, 20, 8))
    for dtype in (np.float32, np.float64):
        out = multi_head_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=False)
        assert np.isfinite(out).all()
    # With scores ~1e8 apart the softmax is one-hot on the best key.
    out = multi_head_attention(q, k, v, causal=False)
    np.testing.assert_allclose(out, naive_attention(q, k, v, False), rtol=1e-9, atol=1e-12)


def test_gqa_equals_mha_with_repeated_kv_heads():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((12, 7, 16))
    k = rng.standard_normal((3, 7, 16))
    v = rng.standard_normal((3, 7, 16))
    a = multi_head_attention(q, k, v, causal=True)
    b = multi_head_attention(q, np.repeat(k, 4, axis=0), np.repeat(v, 4, axis=0), causal=True)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_causal_prefill_row_equals_decode_step():
    rng = np.random.default_rng(5)
    h, kvh, s, d = 8, 2, 11, 24
    q = rng.standard_normal((h, s, d))
    k = rng.standard_normal((kvh, s, d))
    v = rng.standard_normal((kvh, s, d))
    full = multi_head_attention(q, k, v, causal=True)
    for i in range(s):
        step = attention_with_cache_gqa(q[:, i], k[:, :i], v[:, :i], k[:, i], v[:, i])
        np.testing.assert_allclose(full[:, i], step, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(full[:, 0], np.repeat(v[:, 0], h // kvh, axis=0), atol=1e-15)


def test_shape_errors():
    z = np.zeros
    with pytest.raises(ShapeError):
        attention_with_cache_gqa(z((5, 8)), z((2, 3, 8)), z((2, 3, 8)), z((2, 8)), z((2, 8)))  # 5 % 2
    with pytest.raises(ShapeError):
        attention_with_cache_gqa(z((4, 8)), z((2, 3, 8)), z((2, 4, 8)), z((2, 8)), z((2, 8)))
    with pytest.raises(ShapeError):
        attention_with_cache_gqa(z((4, 8)), z((2, 3, 8)), z((2, 3, 8)), z((2, 7)), z((2, 8)))
    with pytest.raises(ShapeError):
        attention_with_cache_gqa(z((4, 6)), z((2, 3, 8)), z((2, 3, 8)), z((2, 8)), z((2, 8)))
    with pytest.raises(ShapeError):
        multi_head_attention(z((4, 5, 8)), z((2, 3, 8)), z((2, 3, 8)), causal=True)
    with pytest.raises(ShapeError):
        multi_head_attention(z((4, 5, 8)), z((2, 5, 8)), z((2, 5, 4)), causal=True)
