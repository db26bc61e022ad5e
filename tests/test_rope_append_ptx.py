"""The fused RoPE + KV-append kernel, run on the PTX emulator against a float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.catalog import emit
from realizar.models.reference import apply_rope
from ptx_gen.emulator import Memory, run
from tests.helpers import examples


def _oracle_rotate(x: np.ndarray, pos: int, inv_freq: np.ndarray, neox: bool) -> np.ndarray:
    """x: [heads, d] float64 rotated by pos * inv_freq (pairs interleaved or NeoX)."""
    ang = np.float64(np.float32(pos) * inv_freq.astype(np.float32))
    c, s = np.cos(ang), np.sin(ang)
    out = x.copy()
    d = x.shape[1]
    if neox:
        a, b = x[:, : d // 2], x[:, d // 2:]
        out[:, : d // 2], out[:, d // 2:] = a * c - b * s, a * s + b * c
    else:
        a, b = x[:, 0::2], x[:, 1::2]
        out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c
    return out


@settings(max_examples=examples(12), deadline=None)
@given(d=st.sampled_from([32, 64, 80, 128]), n_kv=st.integers(1, 3), group=st.integers(1, 3),
       neox=st.booleans(), max_len=st.integers(1, 9), pos_seed=st.integers(0, 10_000), seed=st.integers(0, 2**31))
def test_rope_kv_append_matches_oracle(d, n_kv, group, neox, max_len, pos_seed, seed):
    rng = np.random.default_rng(seed)
    n_q = n_kv * group
    pos = pos_seed % (max_len + 1)  # == max_len: nothing may be written to the caches
    qkv = rng.standard_normal((n_q + 2 * n_kv, d)).astype(np.float32)
    inv = (10000.0 ** (-np.arange(0, d, 2) / d)).astype(np.float32)
    mem = Memory()
    a_qkv = mem.alloc_array(qkv.copy())
    k_cache = np.full((n_kv, max_len, d), np.nan, np.float32)
    v_cache = np.full((n_kv, max_len, d), np.nan, np.float32)
    a_k, a_v = mem.alloc_array(k_cache), mem.alloc_array(v_cache)
    a_inv, a_pos = mem.alloc_array(inv), mem.alloc_array(np.array([pos], np.uint32))
    kern = emit("rope_kv_append", target="sm_90", head_dim=d, neox=neox)
    items = (n_q + 2 * n_kv) * d // 2
    run(kern.ptx, grid=(-(-items // 128),), block=(128,), memory=mem,
        params=dict(qkv=a_qkv, k_cache=a_k, v_cache=a_v, inv_freq=a_inv, pos_ptr=a_pos, n_q=n_q, n_kv=n_kv,
                    max_len=max_len))
    got_qkv = mem.read(a_qkv, np.float32, qkv.size).reshape(qkv.shape)
    got_k = mem.read(a_k, np.float32, k_cache.size).reshape(k_cache.shape)
    got_v = mem.read(a_v, np.float32, v_cache.size).reshape(v_cache.shape)
    x = qkv.astype(np.float64)
    np.testing.assert_allclose(got_qkv[:n_q], _oracle_rotate(x[:n_q], pos, inv, neox), rtol=0, atol=2e-6)
    np.testing.assert_array_equal(got_qkv[n_q:], qkv[n_q:])  # K and V stay as they were in qkv
    if pos < max_len:
        np.testing.assert_allclose(got_k[:, pos], _oracle_rotate(x[n_q:n_q + n_kv], pos, inv, neox), atol=2e-6)
        np.testing.assert_array_equal(got_v[:, pos], qkv[n_q + n_kv:])
    others = [p for p in range(max_len) if p != pos]
    assert np.isnan(got_k[:, others]).all() and np.isnan(got_v[:, others]).all()


def test_rope_matches_the_reference_model_convention():
    """The oracle above agrees with the reference model's own RoPE (both layouts)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64))
    inv = (10000.0 ** (-np.arange(0, 64, 2) / 64)).astype(np.float32)
    for neox in (False, True):
        ang = (np.float32(5) * inv)[None, :].astype(np.float64)
        ref = apply_rope(x[None], np.cos(ang), np.sin(ang), "neox" if neox else "normal")
        np.testing.assert_allclose(_oracle_rotate(x, 5, inv, neox), ref[0], atol=1e-12)


def test_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even"):
        emit("rope_kv_append", head_dim=63)
