"""The batched-prefill pieces of a layer's attention side on the GPU, against float64 oracles:
RMSNorm of S rows into f16, ``KVCache.rope_append_rows`` (per-head q/k norm, RoPE, Q out, K/V into
the cache) and ``prefill_attention(out_layout="tokens-f16")`` over chunks that continue after tokens
already in the cache. Outputs NaN-poisoned before every launch; every element checked."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.elementwise.rope import inv_freq_table
from realizar.gpu.kv_cache import KVCache
from realizar.gpu.ops import LayerOps
from realizar.models.attention import gqa_attention
from tests.layer_oracles import rmsnorm_oracle, rope_append_rows_oracle as oracle

pytestmark = pytest.mark.gpu

EPS = 1e-6

LENGTHS = [1, 2, 63, 64, 65, 511, 512, 513]


def _f16_bound(got: np.ndarray, ref: np.ndarray, rel: float) -> None:
    """|got - ref| within f16 rounding of ref plus ``rel`` of max|ref|, every element finite."""
    assert np.isfinite(got).all(), f"non-finite (unwritten?) at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    err = np.abs(got.astype(np.float64) - ref)
    bound = 2.0**-11 * np.abs(ref) + 2.0**-24 + rel * np.abs(ref).max()
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"error {err[worst]:.3e} above its bound {bound[worst]:.3e} at {worst}"


@settings(max_examples=20, deadline=None)
@given(hidden=st.sampled_from([64, 576, 896, 2048, 4096, 4100, 8192]), rows=st.sampled_from(LENGTHS),
       residual=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rmsnorm_rows_to_f16(device, hidden, rows, residual, seed):
    ops = LayerOps(device)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    r = rng.standard_normal((rows, hidden)).astype(np.float32)
    out = ops.buffer(rows * hidden, np.float16)
    out.poison()
    dr = ops.to_device(r) if residual else None
    ops.rmsnorm(ops.to_device(x), ops.to_device(w), out, 1e-5, rows=rows, residual=dr, out_f16=True)
    ref, _ = rmsnorm_oracle(x, w, 1e-5, r if residual else None)
    _f16_bound(out.to_numpy((rows, hidden)), ref, 1e-5)
    if residual:
        np.testing.assert_array_equal(dr.to_numpy((rows, hidden)), r + x)


@settings(max_examples=25, deadline=None)
@given(d=st.sampled_from([64, 80, 96, 128, 256]), kv_group=st.sampled_from([(1, 1), (2, 4), (3, 3), (8, 4), (4, 7)]),
       chunks=st.lists(st.sampled_from(LENGTHS), min_size=1, max_size=3), neox=st.booleans(), qk_norm=st.booleans(),
       tensor_cores=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_rope_append_rows_then_tokens_f16_attention(device, d, kv_group, chunks, neox, qk_norm, tensor_cores, seed):
    """Chunks of a prompt, each appended at the end of the cache and attended causally over everything
    cached so far: Q and the cache rows against the reference RMSNorm + RoPE, the token-major f16
    attention output against float64 attention (the f32 SIMT kernel within its f16 output rounding; the
    tensor-core kernel, where the head size allows it, within its f16 operands' rounding)."""
    kvh, group = kv_group
    h = kvh * group
    total = sum(chunks)
    rng = np.random.default_rng(seed)
    cache = KVCache(1, h, kvh, d, total + 3, device=device, use_tensor_cores=tensor_cores)
    rel = 4e-3 if cache.tensor_core_attention else 2e-5
    inv = inv_freq_table(d, 500000.0)
    inv_buf = cache.ops.to_device(inv)
    norms = [(rng.standard_normal(d) + 1).astype(np.float32) for _ in range(2)] if qk_norm else [None, None]
    norm_bufs = [cache.ops.to_device(w) for w in norms] if qk_norm else [None, None]
    ks, vs, pos0 = [], [], 0
    for s in chunks:
        qkv = (rng.standard_normal((s, (h + 2 * kvh) * d)) * 2).astype(np.float32)
        q_buf, out_buf = cache.ops.buffer(h * s * d), cache.ops.buffer(s * h * d, np.float16)
        q_buf.poison()
        out_buf.poison()
        cache.rope_append_rows(0, cache.ops.to_device(qkv), inv_buf, pos0, s, q_buf, neox=neox, q_norm=norm_bufs[0],
                               k_norm=norm_bufs[1], eps=EPS)
        cache.prefill_attention(0, q_buf, out_buf, s, pos0, pos0 + s, out_layout="tokens-f16")
        q, k, v = oracle(qkv, h, kvh, d, pos0, inv, neox, *norms, eps=EPS)
        ks.append(k)
        vs.append(v)
        got_q = q_buf.to_numpy((h, s, d))
        assert np.isfinite(got_q).all()
        np.testing.assert_allclose(got_q, q, rtol=0, atol=4e-6 * np.abs(q).max())
        ref = gqa_attention(q, np.concatenate(ks, 1), np.concatenate(vs, 1), causal=True)
        _f16_bound(out_buf.to_numpy((s, h * d)), ref.transpose(1, 0, 2).reshape(s, h * d), rel)
        pos0 += s
    assert cache.lengths == (total,)
    kc = cache.k_cache(0).to_numpy((kvh, total + 3, d))[:, :total]
    vc = cache.v_cache(0).to_numpy((kvh, total + 3, d))[:, :total]
    np.testing.assert_allclose(kc, np.concatenate(ks, 1), rtol=0, atol=4e-6 * np.abs(kc).max())
    np.testing.assert_array_equal(vc, np.concatenate(vs, 1).astype(np.float32))
    cache.close()
