"""The batched-prefill pieces of a layer's attention side on the GPU, against float64 oracles:
RMSNorm of S rows into f16, ``PagedKVCache.append_rows`` (per-head q/k norm, RoPE, Q out, K/V into
the f32 pools through a shuffled block table) and the prefill attention over chunks that continue after
tokens already in the cache (tensor cores, token-major f16 out; or the f32 SIMT kernel, heads out). Outputs NaN-poisoned before every launch; every element checked."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.elementwise.rope import inv_freq_table
from realizar.gpu.paged_kv import PagedKVCache
from realizar.gpu.ops import LayerOps
from realizar.models.attention import gqa_attention
from tests.layer_oracles import rmsnorm_oracle, rope_append_rows_oracle as oracle
from tests.helpers import examples

pytestmark = pytest.mark.gpu

EPS = 1e-6

LENGTHS = [1, 2, 63, 64, 65, 511, 512, 513]


def _f16_bound(got: np.ndarray, ref: np.ndarray, rel: float, f16: bool = True) -> None:
    """|got - ref| within f16 rounding of ref (``f16``) plus ``rel`` of max|ref|, every element finite."""
    assert np.isfinite(got).all(), f"non-finite (unwritten?) at {np.argwhere(~np.isfinite(got))[:5].tolist()}"
    err = np.abs(got.astype(np.float64) - ref)
    bound = (2.0**-11 * np.abs(ref) + 2.0**-24 if f16 else 0.0) + rel * np.abs(ref).max()
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), f"error {err[worst]:.3e} above its bound {bound[worst]:.3e} at {worst}"


@settings(max_examples=examples(20), deadline=None)
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


@settings(max_examples=examples(25), deadline=None)
@given(d=st.sampled_from([64, 80, 96, 128, 256]), kv_group=st.sampled_from([(1, 1), (2, 4), (3, 3), (8, 4), (4, 7)]),
       chunks=st.lists(st.sampled_from(LENGTHS), min_size=1, max_size=3), bs=st.sampled_from([16, 32, 64]),
       neox=st.booleans(), qk_norm=st.booleans(), tensor_cores=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_append_rows_then_prefill_attention(device, d, kv_group, chunks, bs, neox, qk_norm, tensor_cores, seed):
    """Chunks of a prompt, each appended at the end of the sequence and attended causally over everything
    cached so far: Q and the pool rows against the reference RMSNorm + RoPE, the attention output against
    float64 attention (tensor cores, where the head size allows: token-major f16 within its f16 operands'
    rounding; the f32 SIMT kernel: [H, s, D] f32 within 2e-5 of max|ref|)."""
    kvh, group = kv_group
    h = kvh * group
    total = sum(chunks)
    rng = np.random.default_rng(seed)
    n = -(-total // bs)
    table = rng.permutation(np.arange(1, n + 3))[:n].astype(np.uint32)
    cache = PagedKVCache(1, h, kvh, d, n + 3, bs, "f32", device)
    tensor_cores = tensor_cores and d != 256
    ops = cache.ops
    tab = ops.to_device(table)
    inv = inv_freq_table(d, 500000.0)
    inv_buf = ops.to_device(inv)
    norms = [(rng.standard_normal(d) + 1).astype(np.float32) for _ in range(2)] if qk_norm else [None, None]
    norm_bufs = [ops.to_device(w) for w in norms] if qk_norm else [None, None]
    ks, vs, pos0 = [], [], 0
    for s in chunks:
        qkv = (rng.standard_normal((s, (h + 2 * kvh) * d)) * 2).astype(np.float32)
        q_buf = ops.buffer(h * s * d)
        out_buf = ops.buffer(s * h * d, np.float16 if tensor_cores else np.float32)
        q_buf.poison()
        out_buf.poison()
        cache.append_rows(0, ops.to_device(qkv), inv_buf, pos0, s, q_buf, tab, neox=neox, q_norm=norm_bufs[0],
                          k_norm=norm_bufs[1], eps=EPS)
        if tensor_cores:
            cache.prefill_attention(0, q_buf, out_buf, s, pos0, pos0 + s, tab)
        else:
            cache.prefill_attention_heads(0, q_buf, out_buf, s, pos0, pos0 + s, tab)
        q, k, v = oracle(qkv, h, kvh, d, pos0, inv, neox, *norms, eps=EPS)
        ks.append(k)
        vs.append(v)
        got_q = q_buf.to_numpy((h, s, d))
        assert np.isfinite(got_q).all()
        np.testing.assert_allclose(got_q, q, rtol=0, atol=4e-6 * np.abs(q).max())
        ref = gqa_attention(q, np.concatenate(ks, 1), np.concatenate(vs, 1), causal=True)
        if tensor_cores:
            _f16_bound(out_buf.to_numpy((s, h * d)), ref.transpose(1, 0, 2).reshape(s, h * d), 4e-3)
        else:
            _f16_bound(out_buf.to_numpy((h, s, d)), ref, 2e-5, f16=False)
        pos0 += s
    kp, vp = cache.pools_to_numpy(0)  # [blocks, KVH, bs, D] -> the sequence through the table
    kc = kp[table].transpose(1, 0, 2, 3).reshape(kvh, -1, d)[:, :total]
    vc = vp[table].transpose(1, 0, 2, 3).reshape(kvh, -1, d)[:, :total]
    np.testing.assert_allclose(kc, np.concatenate(ks, 1), rtol=0, atol=4e-6 * np.abs(kc).max())
    np.testing.assert_array_equal(vc, np.concatenate(vs, 1).astype(np.float32))
    cache.close()
