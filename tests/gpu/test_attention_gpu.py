"""The attention kernels on the GPU against the float64 oracle (realizar.models.attention).

Shapes are drawn over num_kv_heads in 1..num_heads, every supported head_dim, sequence lengths from
1 to several thousand with the chunk/tile boundaries +-1, data of varied scale (so a wrong online
softmax rescale cannot pass), a large score late in the sequence, NaN-poisoned outputs and NaN in
every cache row past the sequence (which must never be read). Relative error < 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.attention.flash_decoding import fused_buffer_sizes
from realizar import cuda
from realizar.models.attention import attention_with_cache_gqa, gqa_attention
from tests.attention_cases import prefill_case
from tests.helpers import assert_close, examples

pytestmark = pytest.mark.gpu

HEAD_DIMS = [32, 48, 64, 80, 96, 128, 256]
RTOL = 1e-5
BOUNDARIES = sorted({b + e for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) for e in (-1, 0, 1)} | {1, 2, 3})
lengths = st.one_of(st.integers(1, 4600), st.sampled_from(BOUNDARIES))
heads = st.tuples(st.integers(1, 8), st.integers(1, 8))  # (num_kv_heads, group)
scales = st.floats(0.1, 30.0)
# decode-kernel variants (the default first): scores, register prefetch, L2 prefetch depth, unroll, warps
VARIANTS = [{}, {"scores": "butterfly"}, {"prefetch": True}, {"l2_prefetch": 0}, {"l2_prefetch": 4}, {"unroll": 2},
            {"warps": 8}]
variants = st.sampled_from(VARIANTS)


def _decode_case(rng, h, kvh, d, length, max_len, scale, late_spike):
    """q [H, D]; caches [KVH, max_len, D] holding `length` rows, NaN beyond; the float64 reference."""
    q = (rng.standard_normal((h, d)) * scale).astype(np.float32)
    kc = np.full((kvh, max_len, d), np.nan, np.float32)
    vc = np.full((kvh, max_len, d), np.nan, np.float32)
    kc[:, :length] = rng.standard_normal((kvh, length, d))
    vc[:, :length] = rng.standard_normal((kvh, length, d))
    if late_spike and length > 2:
        pos = length - 1 - int(rng.integers(0, min(4, length - 1)))
        group = h // kvh
        for g in range(kvh):
            kc[g, pos] = q[g * group] / np.linalg.norm(q[g * group]) * 4.0
    k64, v64 = kc[:, :length].astype(np.float64), vc[:, :length].astype(np.float64)
    ref = attention_with_cache_gqa(q.astype(np.float64), k64[:, :-1], v64[:, :-1], k64[:, -1], v64[:, -1])
    return q, kc, vc, ref


def _budget(kvh, d, length, limit=6_000_000):
    """Keep one example's cache under ~limit floats (test time)."""
    return length if kvh * d * length <= limit else max(1, limit // (kvh * d))


@settings(max_examples=examples(30), deadline=None)
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), length=lengths, slack=st.integers(0, 40), scale=scales,
       late=st.booleans(), indirect=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_incremental_attention(kernels, hk, d, length, slack, scale, late, indirect, seed):
    kvh, group = hk
    h = kvh * group
    length = _budget(kvh, d, length)
    rng = np.random.default_rng(seed)
    max_len = length + slack
    q, kc, vc, ref = _decode_case(rng, h, kvh, d, length, max_len, scale, late)
    kern = kernels.get("incremental_attention", head_dim=d, group=group, indirect=indirect)
    with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(kc) as dk, \
            cuda.GpuBuffer.from_numpy(vc) as dv, cuda.GpuBuffer(h * d) as out, \
            cuda.GpuBuffer.from_numpy(np.array([length], np.uint32)) as dlen:
        out.poison()
        sl = dlen if indirect else length
        cuda.launch(kern, kvh * kern.meta["subgroups"], kern.meta["block"], kern.args(dq, dk, dv, out, sl, max_len))
        got = out.to_numpy((h, d))
    assert_close(got, ref, RTOL, f"incremental H={h} KVH={kvh} D={d} L={length}")


def _flash_decode(kernels, q, kc, vc, length, max_len, group, num_chunks, min_chunk_mult, indirect, **opts):
    h, d = q.shape
    kvh = kc.shape[0]
    chunk = kernels.get("flash_decoding_chunk", head_dim=d, group=group, indirect=indirect, **opts)
    red = kernels.get("flash_decoding_reduce", head_dim=d, num_chunks=num_chunks, indirect=indirect)
    with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(kc) as dk, \
            cuda.GpuBuffer.from_numpy(vc) as dv, cuda.GpuBuffer(h * d) as out, \
            cuda.GpuBuffer(h * num_chunks * d) as pacc, cuda.GpuBuffer(h * num_chunks * 2) as pml, \
            cuda.GpuBuffer.from_numpy(np.array([length], np.uint32)) as dlen:
        for b in (out, pacc, pml):
            b.poison()
        sl = dlen if indirect else length
        min_chunk = chunk.meta["quantum"] * min_chunk_mult
        cuda.launch(chunk, (kvh * chunk.meta["subgroups"], num_chunks), chunk.meta["block"],
                    chunk.args(dq, dk, dv, pacc, pml, sl, max_len, min_chunk))
        cuda.launch(red, h, red.meta["block"], red.args(pacc, pml, out, sl, max_len))
        return out.to_numpy((h, d))


@settings(max_examples=examples(40), deadline=None)
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), length=lengths, slack=st.integers(0, 40), scale=scales,
       late=st.booleans(), indirect=st.booleans(), num_chunks=st.sampled_from([1, 2, 7, 33, 64, 132, 256]),
       min_mult=st.sampled_from([1, 1, 2, 8]), opts=variants, seed=st.integers(0, 2**32 - 1))
def test_flash_decoding(kernels, hk, d, length, slack, scale, late, indirect, num_chunks, min_mult, opts, seed):
    kvh, group = hk
    h = kvh * group
    length = _budget(kvh, d, length)
    rng = np.random.default_rng(seed)
    max_len = length + slack
    q, kc, vc, ref = _decode_case(rng, h, kvh, d, length, max_len, scale, late)
    got = _flash_decode(kernels, q, kc, vc, length, max_len, group, num_chunks, min_mult, indirect, **opts)
    assert_close(got, ref, RTOL, f"flash decoding H={h} KVH={kvh} D={d} L={length} chunks={num_chunks} {opts}")


def _single_launch(kernels, q, kc, vc, lengths, max_len, group, num_chunks, min_chunk, indirect, grow_rows=0,
                   **opts):
    """Single-launch flash decoding called once per entry of ``lengths`` on the same partial buffers
    and counters (outputs and partials NaN-poisoned before each call); returns the outputs and checks
    that the counters are back at zero after every call."""
    h, d = q.shape
    kvh = kc.shape[0]
    kern = kernels.get("flash_decoding", head_dim=d, group=group, indirect=indirect, **opts)
    gx = kvh * kern.meta["subgroups"]
    n_acc, n_ml, n_cnt = fused_buffer_sizes(h, gx, num_chunks, d)
    outs = []
    with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(kc) as dk, \
            cuda.GpuBuffer.from_numpy(vc) as dv, cuda.GpuBuffer(h * d) as out, cuda.GpuBuffer(n_acc) as pacc, \
            cuda.GpuBuffer(n_ml) as pml, cuda.GpuBuffer.zeros(n_cnt, np.uint32) as cnt, \
            cuda.GpuBuffer(1, np.uint32) as dlen:
        for length in lengths:
            for b in (out, pacc, pml):
                b.poison()
            dlen.copy_from_host(np.array([length], np.uint32))
            sl = dlen if indirect else length
            cuda.launch(kern, (gx, num_chunks), kern.meta["block"],
                        kern.args(dq, dk, dv, out, pacc, pml, cnt, sl, max_len, min_chunk, grow_rows))
            outs.append(out.to_numpy((h, d)))
            assert not cnt.to_numpy().any(), f"L={length}: counters left at {cnt.to_numpy().tolist()}"
    return outs


def _prefix_ref(q, kc, vc, length):
    if length == 0:
        return np.zeros(q.shape)
    k64, v64 = kc[:, :length].astype(np.float64), vc[:, :length].astype(np.float64)
    return attention_with_cache_gqa(q.astype(np.float64), k64[:, :-1], v64[:, :-1], k64[:, -1], v64[:, -1])


@settings(max_examples=examples(40), deadline=None)
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), length=lengths, again=lengths, slack=st.integers(0, 40),
       scale=scales, late=st.booleans(), indirect=st.booleans(),
       num_chunks=st.sampled_from([1, 2, 7, 16, 17, 33, 132, 256, 300]), min_chunk=st.sampled_from([1, 4, 32, 64]),
       grow_rows=st.sampled_from([0, 0, 32, 128]), opts=variants, seed=st.integers(0, 2**32 - 1))
def test_single_launch_flash_decoding(kernels, hk, d, length, again, slack, scale, late, indirect, num_chunks,
                                      min_chunk, grow_rows, opts, seed):
    """Two calls on the same counters and partial buffers: the drawn length, then another one."""
    kvh, group = hk
    h = kvh * group
    length = _budget(kvh, d, length)
    rng = np.random.default_rng(seed)
    max_len = length + slack
    again = min(again, max_len)
    q, kc, vc, ref = _decode_case(rng, h, kvh, d, length, max_len, scale, late)
    kc[:, length:] = rng.standard_normal((kvh, max_len - length, d))  # rows the second call may read
    vc[:, length:] = rng.standard_normal((kvh, max_len - length, d))
    first, second = _single_launch(kernels, q, kc, vc, [length, again], max_len, group, num_chunks, min_chunk,
                                   indirect, grow_rows, **opts)
    what = f"H={h} KVH={kvh} D={d} chunks={num_chunks} min_chunk={min_chunk} grow={grow_rows} {opts}"
    assert_close(first, ref, RTOL, f"single launch L={length} {what}")
    if again:
        assert_close(second, _prefix_ref(q, kc, vc, again), RTOL, f"single launch again L={again} {what}")
    else:
        assert np.array_equal(second, np.zeros_like(second))


def test_single_launch_flash_decoding_many_calls_and_boundaries(kernels):
    """One buffer set, many lengths in a row: one active chunk, one set of 16, 17 chunks (two combine
    levels), the full grid, rows growing past it, clamping and zero; every variant, chunks growing to
    keep short sequences in one set or not."""
    rng = np.random.default_rng(12)
    h, kvh, d, max_len, nch, min_chunk = 14, 2, 64, 300, 40, 4
    q = (rng.standard_normal((h, d)) * 5).astype(np.float32)
    kc = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    vc = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    lengths = [1, 4, 5, 63, 64, 65, 68, 69, 159, 160, 161, 299, 300, 10**6, 0, 2] * 2
    for opts, grow in [(v, 0) for v in VARIANTS] + [({}, 8), ({}, 64)]:
        outs = _single_launch(kernels, q, kc, vc, lengths, max_len, h // kvh, nch, min_chunk, True, grow, **opts)
        for length, got in zip(lengths, outs):
            if length:
                assert_close(got, _prefix_ref(q, kc, vc, min(length, max_len)), RTOL, f"L={length} {opts} {grow}")
            else:
                assert np.array_equal(got, np.zeros_like(got))


@pytest.mark.parametrize("h, kvh, d", [(14, 2, 64), (28, 4, 128), (32, 8, 128), (8, 1, 256), (12, 4, 80)])
def test_flash_decoding_long_context_with_late_spike(kernels, h, kvh, d):
    rng = np.random.default_rng(h * 1000 + d)
    length = 12_289 if d <= 128 else 6001
    q, kc, vc, ref = _decode_case(rng, h, kvh, d, length, length + 7, 8.0, True)
    got = _flash_decode(kernels, q, kc, vc, length, length + 7, h // kvh, 132, 1, True)
    assert_close(got, ref, RTOL, f"long context H={h} KVH={kvh} D={d}")
    for nch in (132, 256):
        got = _single_launch(kernels, q, kc, vc, [length], length + 7, h // kvh, nch, 32, True)[0]
        assert_close(got, ref, RTOL, f"long context, single launch, {nch} chunks, H={h} KVH={kvh} D={d}")


def test_flash_decoding_zero_length_and_clamping(kernels):
    rng = np.random.default_rng(3)
    q, kc, vc, ref = _decode_case(rng, 4, 2, 64, 40, 40, 2.0, False)
    zeros = _flash_decode(kernels, q, kc, vc, 0, 40, 2, 8, 1, True)
    assert np.array_equal(zeros, np.zeros_like(zeros))
    clamped = _flash_decode(kernels, q, kc, vc, 10**6, 40, 2, 8, 1, True)  # past max_len: reads max_len rows
    assert_close(clamped, ref, RTOL, "clamped")


@settings(max_examples=examples(25), deadline=None)  # each new (head_dim, group, causal) is a JIT of a few thousand lines
@given(hk=st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 3, 4, 7])), d=st.sampled_from(HEAD_DIMS),
       sq=st.one_of(st.integers(1, 1100), st.sampled_from(BOUNDARIES[:14])),
       extra=st.one_of(st.just(0), st.integers(0, 600)), slack=st.integers(0, 9), causal=st.booleans(),
       scale=st.floats(0.1, 20.0), seed=st.integers(0, 2**32 - 1))
def test_flash_attention(kernels, hk, d, sq, extra, slack, causal, scale, seed):
    kvh, group = hk
    h = kvh * group
    if h * sq * d > 2_000_000:
        sq = max(1, 2_000_000 // (h * d))
    rng = np.random.default_rng(seed)
    sk = sq + extra
    stride = sk + slack
    q, k, v, ref = prefill_case(rng, h, kvh, d, sq, sk, slack, scale, causal)
    kern = kernels.get("flash_attention", head_dim=d, group=group, causal=causal)
    with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(k) as dk, cuda.GpuBuffer.from_numpy(v) as dv, \
            cuda.GpuBuffer(q.size) as out:
        out.poison()
        grid = (-(-sq // kern.meta["block_q"]), h)
        cuda.launch(kern, grid, kern.meta["block"], kern.args(dq, dk, dv, out, sq, sk, sk - sq, stride),
                    kern.launch.dyn_smem)
        got = out.to_numpy(q.shape)
    assert_close(got, ref, RTOL, f"flash attention H={h} KVH={kvh} D={d} Sq={sq} Sk={sk} causal={causal}")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("s", [1, 3, 31, 63, 65, 129])
def test_flash_attention_short_sequences_are_not_zero(kernels, d, s):
    """The Rust original returned zeros when seq_len < head_dim and dropped a trailing partial tile."""
    rng = np.random.default_rng(s * d)
    q, k, v = (rng.standard_normal((2, s, d)).astype(np.float32) for _ in range(3))
    ref = gqa_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
    kern = kernels.get("flash_attention", head_dim=d, group=1, causal=True)
    with cuda.GpuBuffer.from_numpy(q) as dq, cuda.GpuBuffer.from_numpy(k) as dk, cuda.GpuBuffer.from_numpy(v) as dv, \
            cuda.GpuBuffer(q.size) as out:
        out.poison()
        cuda.launch(kern, (-(-s // kern.meta["block_q"]), 2), kern.meta["block"],
                    kern.args(dq, dk, dv, out, s, s, 0, s), kern.launch.dyn_smem)
        got = out.to_numpy(q.shape)
    assert_close(got, ref, RTOL, f"S={s} D={d}")


@settings(max_examples=examples(20), deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), kvh=st.integers(1, 8), count=st.integers(1, 70), pos=st.integers(0, 300),
       indirect=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_kv_append(kernels, d, kvh, count, pos, indirect, seed):
    rng = np.random.default_rng(seed)
    max_len = 257
    knew = rng.standard_normal((kvh, count, d)).astype(np.float32)
    vnew = rng.standard_normal((kvh, count, d)).astype(np.float32)
    init_k = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    init_v = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    kern = kernels.get("kv_append", head_dim=d, indirect=indirect)
    with cuda.GpuBuffer.from_numpy(init_k) as dk, cuda.GpuBuffer.from_numpy(init_v) as dv, \
            cuda.GpuBuffer.from_numpy(knew) as dkn, cuda.GpuBuffer.from_numpy(vnew) as dvn, \
            cuda.GpuBuffer.from_numpy(np.array([pos], np.uint32)) as dpos:
        grid = (-(-count * d // 4 // kern.meta["block"]), kvh)
        args = kern.args(dk, dv, dkn, dvn, dpos if indirect else pos, count, max_len)
        cuda.launch(kern, grid, kern.meta["block"], args)
        got_k, got_v = dk.to_numpy(init_k.shape), dv.to_numpy(init_v.shape)
    n = max(0, min(count, max_len - pos))
    init_k[:, pos:pos + n] = knew[:, :n]
    init_v[:, pos:pos + n] = vnew[:, :n]
    assert np.array_equal(got_k, init_k) and np.array_equal(got_v, init_v)
