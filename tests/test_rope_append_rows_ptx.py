"""The batched (prefill) RoPE + KV-append kernel ``rope_append_rows`` of a contiguous cache.

* the kernel runs on the PTX emulator against a float64 oracle made of the reference model's own
  RMSNorm and RoPE (S tokens, positions pos0.., both pair layouts, with and without the per-head
  q/k norm), every element of the NaN-poisoned outputs checked, positions past max_len untouched;
* without the norm it rotates to the same bits as the decode kernel ``rope_kv_append``;
* it assembles for sm_80/sm_89/sm_90 without spills over drawn shapes.

Its paged form (``paged_append_rows``) and the cache calls built on it are in tests/test_paged_kv_ptx.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run
from ptx_gen.kernels.elementwise.rope import inv_freq_table
from ptx_gen.ptxas import assemble
from tests.layer_oracles import rope_append_rows_oracle as oracle
from tests.helpers import examples

TARGETS = ("sm_80", "sm_89", "sm_90")
EPS = 1e-6


def _run(d, neox, qk_norm, qkv, n_q, n_kv, pos0, max_len, inv, norms=None):
    """Run the kernel on NaN-poisoned outputs; (qkv after, q_out, k_cache, v_cache)."""
    s = qkv.shape[0]
    kern = catalog.emit("rope_append_rows", target="sm_90", head_dim=d, neox=neox, qk_norm=qk_norm)
    mem = Memory()
    p = {"qkv": mem.alloc_array(qkv.copy()), "q_out": mem.alloc_array(np.full((n_q, s, d), np.nan, np.float32)),
         "k_cache": mem.alloc_array(np.full((n_kv, max_len, d), np.nan, np.float32)),
         "v_cache": mem.alloc_array(np.full((n_kv, max_len, d), np.nan, np.float32)),
         "inv_freq": mem.alloc_array(inv)}
    if qk_norm:
        p.update(q_norm=mem.alloc_array(norms[0]), k_norm=mem.alloc_array(norms[1]), eps=EPS)
    p.update(pos0=pos0, count=s, n_q=n_q, n_kv=n_kv, max_len=max_len)
    grid = (s, -(-(n_q + 2 * n_kv) // kern.meta["warps"]))
    run(kern.ptx, grid, (kern.meta["block"],), p, mem)
    read = lambda name, shape: mem.read(p[name], np.float32, int(np.prod(shape))).reshape(shape)  # noqa: E731
    return (read("qkv", qkv.shape), read("q_out", (n_q, s, d)), read("k_cache", (n_kv, max_len, d)),
            read("v_cache", (n_kv, max_len, d)))


def _close(got: np.ndarray, want: np.ndarray, tol: float, what: str) -> None:
    assert np.isfinite(got).all(), f"{what}: non-finite at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(np.abs(want).max(), 1e-30), err_msg=what)


@settings(max_examples=examples(14), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=st.sampled_from([1, 2, 7, 63, 65]), d=st.sampled_from([10, 32, 48, 64, 80, 96, 128, 256]),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]), neox=st.booleans(), qk_norm=st.booleans(),
       pos0=st.integers(0, 5000), cut=st.integers(0, 3), theta=st.sampled_from([10000.0, 1e6]),
       seed=st.integers(0, 2**32 - 1))
def test_rope_append_rows_matches_oracle(s, d, heads, neox, qk_norm, pos0, cut, theta, seed):
    n_q, n_kv = heads
    if s * (n_q + 2 * n_kv) * d > 40_000:  # keep the emulated launch small
        n_q, n_kv = 1, 1
    rng = np.random.default_rng(seed)
    max_len = max(1, pos0 + s - min(cut, s))  # cut > 0: the last positions fall past max_len
    qkv = (rng.standard_normal((s, (n_q + 2 * n_kv) * d)) * rng.uniform(0.5, 4)).astype(np.float32)
    inv = inv_freq_table(d, theta)
    norms = [(rng.standard_normal(d) + 0.5).astype(np.float32) for _ in range(2)] if qk_norm else [None, None]
    qkv_after, q_out, k_cache, v_cache = _run(d, neox, qk_norm, qkv, n_q, n_kv, pos0, max_len, inv, norms)
    q, k, v = oracle(qkv, n_q, n_kv, d, pos0, inv, neox, *norms, eps=EPS)
    np.testing.assert_array_equal(qkv_after, qkv)  # the input is only read
    tol = 4e-6 if qk_norm else 2e-6
    _close(q_out, q, tol, "q_out")
    n = max(0, min(s, max_len - pos0))  # positions that fit in the cache
    if n:
        _close(k_cache[:, pos0:pos0 + n], k[:, :n], tol, "k_cache")
        np.testing.assert_array_equal(v_cache[:, pos0:pos0 + n], v[:, :n].astype(np.float32))
    assert np.isnan(k_cache[:, :pos0]).all() and np.isnan(v_cache[:, :pos0]).all()  # nothing else written
    assert np.isnan(k_cache[:, pos0 + n:]).all() and np.isnan(v_cache[:, pos0 + n:]).all()


@pytest.mark.parametrize("d, neox", [(64, False), (80, True), (128, True), (256, False)])
def test_rotation_is_bitwise_the_decode_kernels(d, neox):
    """Without the norm, every token rotates to the same bits as a decode step at its position."""
    rng = np.random.default_rng(d)
    n_q, n_kv, s, pos0, max_len = 2, 1, 5, 1234, 1240
    qkv = rng.standard_normal((s, (n_q + 2 * n_kv) * d)).astype(np.float32)
    inv = inv_freq_table(d, 500000.0)
    _, q_out, k_cache, v_cache = _run(d, neox, False, qkv, n_q, n_kv, pos0, max_len, inv)
    dec = catalog.emit("rope_kv_append", target="sm_90", head_dim=d, neox=neox)
    for t in range(s):
        mem = Memory()
        p = dict(qkv=mem.alloc_array(qkv[t].copy()), k_cache=mem.alloc(n_kv * max_len * d * 4),
                 v_cache=mem.alloc(n_kv * max_len * d * 4), inv_freq=mem.alloc_array(inv),
                 pos_ptr=mem.alloc_array(np.array([pos0 + t], np.uint32)), n_q=n_q, n_kv=n_kv, max_len=max_len)
        run(dec.ptx, (-(-(n_q + 2 * n_kv) * d // 2 // 128),), (128,), p, mem)
        q_dec = mem.read(p["qkv"], np.float32, n_q * d).reshape(n_q, d)
        k_dec = mem.read(p["k_cache"], np.float32, n_kv * max_len * d).reshape(n_kv, max_len, d)[:, pos0 + t]
        assert np.array_equal(q_out[:, t].view(np.uint32), q_dec.view(np.uint32))
        assert np.array_equal(k_cache[:, pos0 + t].view(np.uint32), k_dec.view(np.uint32))
        assert np.array_equal(v_cache[:, pos0 + t], qkv[t].reshape(-1, d)[n_q + n_kv:])


@settings(max_examples=examples(6), deadline=None)
@given(d=st.sampled_from([32, 64, 80, 96, 128, 256]), neox=st.booleans(), qk_norm=st.booleans())
def test_rope_append_rows_assembles(d, neox, qk_norm):
    for target in TARGETS:
        rep = assemble(catalog.emit("rope_append_rows", target=target, head_dim=d, neox=neox, qk_norm=qk_norm).ptx,
                       target)[0]
        assert not rep.spills, f"d={d} neox={neox} qk_norm={qk_norm} spills on {target}: {rep.log}"


def test_generator_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="even"):
        catalog.emit("rope_append_rows", head_dim=63)
