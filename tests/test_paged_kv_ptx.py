"""The paged-KV kernels through :class:`realizar.gpu.paged_kv.PagedKVCache` on an emulated device (the real
PTX on the CPU) against float64 oracles:

* ``append_decode``: B rows at drawn positions through shuffled, non-contiguous block tables (qk-norm or
  not, both pair layouts): Q rotated in place, K/V in the right pool rows rounded to the pool's dtype,
  every other pool element untouched;
* ``decode_attention``: B rows of mixed lengths (1 .. a few hundred, chunk and block boundaries) through
  their tables, pools holding NaN everywhere no sequence owns (blocks of no table, rows past a length),
  f32 or f16 outputs NaN-poisoned before the launch; repeated launches leave the counters at zero;
* ``append_rows`` + ``prefill_attention``: a prefill chunk after cached positions (q_offset > 0), read
  back through the table on tensor cores, f16 token-major output;
* ptxas on sm_80/89/90 without spills at real shapes; bad arguments raise ShapeError.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.elementwise.rope import inv_freq_table
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu.paged_kv import KV_NUMPY_DTYPES, PagedKVCache, decode_min_chunk, dequantize_q8_0, quantize_q8_0
from realizar.models.attention import gqa_attention
from tests.layer_kernels_ptx_cases import _assemble_all
from tests.layer_oracles import rope_append_rows_oracle
from tests.helpers import examples, tiered

EPS = 1e-6
HEADS = [(1, 1), (2, 1), (4, 2), (3, 3), (8, 1), (6, 2)]


def _round(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """``x`` as stored in a pool of ``kv_dtype``, back as float64 (f16/bf16: round to nearest even; q8_0:
    quantised in groups of 32 along the last axis)."""
    x = np.asarray(x, np.float32)
    if kv_dtype == "q8_0":
        return dequantize_q8_0(*quantize_q8_0(x)).astype(np.float64)
    if kv_dtype == "f32":
        return x.astype(np.float64)
    if kv_dtype == "f16":
        return x.astype(np.float16).astype(np.float64)
    bits = x.view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _encode(x: np.ndarray, kv_dtype: str) -> np.ndarray:
    """float64 values (already representable) -> the pool's numpy storage."""
    if kv_dtype == "bf16":
        return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.asarray(x).astype(KV_NUMPY_DTYPES[kv_dtype])


def _cache(h, kvh, d, num_blocks, bs, kv_dtype, **kw) -> PagedKVCache:
    return PagedKVCache(1, h, kvh, d, num_blocks, bs, kv_dtype, device=cuda.EmulatedDevice(sm_count=2), **kw)


def _upload(cache, layer, kpool, vpool):
    if cache.kv_dtype == "q8_0":  # codes and scales (a group holding NaN gets a NaN scale)
        cache.pools_from_numpy(layer, kpool, vpool)
        return
    cache.k_pool(layer).copy_from_host(_encode(kpool, cache.kv_dtype).reshape(-1))
    cache.v_pool(layer).copy_from_host(_encode(vpool, cache.kv_dtype).reshape(-1))


def _tables(rng, lengths, bs, num_blocks, stride):
    """Disjoint shuffled block ids (never 0) for every row; unused entries 0."""
    need = [-(-max(n, 1) // bs) for n in lengths]
    ids = rng.permutation(np.arange(1, num_blocks))[: sum(need)]
    tab = np.zeros((len(lengths), stride), np.uint32)
    at = 0
    for b, n in enumerate(need):
        tab[b, :n] = ids[at:at + n]
        at += n
    return tab


def _buf(dev, a):
    return cuda.GpuBuffer.from_numpy(np.ascontiguousarray(a), device=dev)


# ---- decode attention ----------------------------------------------------------------------------------

def _decode_case(rng, h, kvh, d, bs, kv_dtype, lengths, scale):
    stride = max(-(-max(n, 1) // bs) for n in lengths) + int(rng.integers(0, 2))
    num_blocks = 1 + sum(-(-max(n, 1) // bs) for n in lengths) + int(rng.integers(0, 3))
    tab = _tables(rng, lengths, bs, num_blocks, stride)
    kpool = np.full((num_blocks, kvh, bs, d), np.nan)
    vpool = np.full((num_blocks, kvh, bs, d), np.nan)
    keys, vals = [], []
    for b, n in enumerate(lengths):
        kk = _round(rng.standard_normal((kvh, n, d)), kv_dtype)
        vv = _round(rng.standard_normal((kvh, n, d)), kv_dtype)
        for p in range(n):
            kpool[tab[b, p // bs], :, p % bs] = kk[:, p]
            vpool[tab[b, p // bs], :, p % bs] = vv[:, p]
        keys.append(kk)
        vals.append(vv)
    q = (rng.standard_normal((len(lengths), h, d)) * scale).astype(np.float32)
    ref = np.stack([gqa_attention(q[b][:, None].astype(np.float64), keys[b], vals[b], causal=False)[:, 0]
                    if n else np.zeros((h, d)) for b, n in enumerate(lengths)])
    return q, kpool, vpool, tab, stride, num_blocks, ref


def _run_decode(cache, q, tab, stride, lengths, out_f16, repeats=1):
    dev, rows = cache.device, len(lengths)
    h, d = cache.num_heads, cache.head_dim
    qb, tb, lb = _buf(dev, q.reshape(-1)), _buf(dev, tab.reshape(-1)), _buf(dev, np.array(lengths, np.uint32))
    ob = cuda.GpuBuffer(rows * h * d, np.float16 if out_f16 else np.float32, device=dev)
    outs = []
    for _ in range(repeats):
        ob.poison()
        cache.decode_attention(0, qb, ob, lb, tb, stride, rows, out_f16=out_f16)
        assert not cache._counters.copy_to_host().any(), "combine counters not left at zero"
        outs.append(ob.copy_to_host().astype(np.float64).reshape(rows, h, d))
    return outs


@settings(max_examples=examples(14), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=st.sampled_from(HEADS), d=st.sampled_from([32, 64, 96, 128]), bs=st.sampled_from([16, 32, 64]),
       kv_dtype=st.sampled_from(["f16", "f32", "bf16", "q8_0"]), out_f16=st.booleans(), unroll=st.sampled_from([1, 2, 4]),
       lengths=st.lists(st.one_of(st.integers(1, 40), st.integers(60, 300)), min_size=1, max_size=3),
       min_chunk=st.sampled_from([None, 1, 16, 64]), scale=st.floats(0.2, 8), lanes=st.sampled_from([0, 0, 4, 8, 16]),
       prefetch=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_decode_attention_matches_oracle(hk, d, bs, kv_dtype, out_f16, unroll, lengths, min_chunk, scale, lanes,
                                         prefetch, seed):
    h, kvh = hk
    lanes = 0 if d % (4 * max(lanes, 1)) else lanes
    rng = np.random.default_rng(seed)
    q, kpool, vpool, tab, stride, nb, ref = _decode_case(rng, h, kvh, d, bs, kv_dtype, lengths, scale)
    cache = _cache(h, kvh, d, nb, bs, kv_dtype, max_batch=4, decode_unroll=unroll, min_chunk=min_chunk,
                   decode_lanes=lanes, decode_prefetch=prefetch)
    _upload(cache, 0, kpool, vpool)
    got, = _run_decode(cache, q, tab, stride, lengths, out_f16)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs or a NaN pool row read"
    tol = 2e-3 if out_f16 else 2e-5  # f16 output: its own rounding; f32: ex2.approx / summation order
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())


@pytest.mark.parametrize("unroll,lanes", [(4, 16), (1, 8)])
def test_decode_attention_prefetching_block_ids(unroll, lanes):
    """Block ids loaded a step ahead: rows ending inside a step, at a step's end, one position long, empty, and a
    long one over several chunks, all against the oracle."""
    rng = np.random.default_rng(12)
    lengths = [257, 64, 1, 0, 95]
    q, kpool, vpool, tab, stride, nb, ref = _decode_case(rng, 8, 2, 64, 16, "f16", lengths, 2.0)
    cache = _cache(8, 2, 64, nb, 16, "f16", max_batch=5, num_chunks=3, min_chunk=16, decode_unroll=unroll,
                   decode_lanes=lanes, decode_prefetch=True)
    assert cache._decode_kernel(False).source.entry.endswith("_pp")
    _upload(cache, 0, kpool, vpool)
    got, = _run_decode(cache, q, tab, stride, lengths, False)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_decode_attention_long_and_short_rows_many_chunks():
    """A long row split over many chunks (partials combined by the last block) beside one-position rows,
    an empty row (zeros), the same launch twice on the same counters."""
    rng = np.random.default_rng(5)
    lengths = [700, 1, 0, 33]
    q, kpool, vpool, tab, stride, nb, ref = _decode_case(rng, 4, 2, 64, 16, "f16", lengths, 3.0)
    cache = _cache(4, 2, 64, nb, 16, "f16", max_batch=4, num_chunks=9, min_chunk=16)
    _upload(cache, 0, kpool, vpool)
    first, second = _run_decode(cache, q, tab, stride, lengths, False, repeats=2)
    np.testing.assert_array_equal(first, second)
    assert not first[2].any()
    np.testing.assert_allclose(first, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_min_chunk_policy():
    """One block per chunk while the launch's (row, KV head) pairs do not fill the SMs, two after, eight once the
    pairs alone fill four blocks an SM; a min_chunk given to the cache wins."""
    rows = (1, 16, 17, 64, 65, 66, 128, 256)
    assert [decode_min_chunk(r, 8, 132) for r in rows] == [32, 32, 64, 64, 64, 256, 256, 256]
    assert decode_min_chunk(32, 3, 132) == 32 and decode_min_chunk(64, 3, 132) == 64
    auto = _cache(4, 2, 32, 4, 16, "f16", max_batch=4)
    sms = auto.device.sm_count
    assert auto.min_chunk_for(1) == decode_min_chunk(1, 2, sms)
    assert _cache(4, 2, 32, 4, 16, "f16", max_batch=4, min_chunk=7).min_chunk_for(1) == 7


def test_decode_attention_reads_q_from_qkv_rows():
    rng = np.random.default_rng(8)
    h, kvh, d, lengths = 4, 2, 32, [20, 50]
    q, kpool, vpool, tab, stride, nb, ref = _decode_case(rng, h, kvh, d, 16, "f32", lengths, 2.0)
    cache = _cache(h, kvh, d, nb, 16, "f32", max_batch=2)
    _upload(cache, 0, kpool, vpool)
    qkv = rng.standard_normal((2, (h + 2 * kvh) * d)).astype(np.float32)
    qkv[:, :h * d] = q.reshape(2, -1)
    dev = cache.device
    out = cuda.GpuBuffer(2 * h * d, device=dev)
    out.poison()
    cache.decode_attention(0, _buf(dev, qkv.reshape(-1)), out, _buf(dev, np.array(lengths, np.uint32)),
                           _buf(dev, tab.reshape(-1)), stride, 2, q_stride=(h + 2 * kvh) * d)
    got = out.copy_to_host().reshape(2, h, d)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


# ---- decode append ------------------------------------------------------------------------------------

@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=st.sampled_from(HEADS), d=st.sampled_from([32, 64, 96, 128]), bs=st.sampled_from([16, 32, 64]),
       kv_dtype=st.sampled_from(["f16", "f32", "bf16", "q8_0"]), neox=st.booleans(), qk_norm=st.booleans(),
       positions=st.lists(st.integers(0, 200), min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1))
def test_append_decode_matches_oracle(hk, d, bs, kv_dtype, neox, qk_norm, positions, seed):
    h, kvh = hk
    rng = np.random.default_rng(seed)
    rows = len(positions)
    stride = max(p // bs for p in positions) + 1
    nb = 1 + rows * stride
    tab = _tables(rng, [stride * bs] * rows, bs, nb, stride)
    kpool = _round(rng.standard_normal((nb, kvh, bs, d)), kv_dtype)  # existing contents must stay
    vpool = _round(rng.standard_normal((nb, kvh, bs, d)), kv_dtype)
    cache = _cache(h, kvh, d, nb, bs, kv_dtype, max_batch=rows)
    _upload(cache, 0, kpool, vpool)
    qkv = (rng.standard_normal((rows, (h + 2 * kvh) * d)) * 2).astype(np.float32)
    inv = inv_freq_table(d, 10000.0)
    norms = [(rng.standard_normal(d) + 0.5).astype(np.float32) for _ in range(2)] if qk_norm else [None, None]
    dev = cache.device
    qkv_b = _buf(dev, qkv.reshape(-1))
    nb_args = {"q_norm": _buf(dev, norms[0]), "k_norm": _buf(dev, norms[1])} if qk_norm else {}
    cache.append_decode(0, qkv_b, _buf(dev, inv), _buf(dev, np.array(positions, np.uint32)),
                        _buf(dev, tab.reshape(-1)), stride, rows, eps=EPS, neox=neox, **nb_args)
    got_qkv = qkv_b.copy_to_host().reshape(rows, -1)
    gk, gv = cache.pools_to_numpy(0)
    tol = 4e-6 if qk_norm else 2e-6
    want_k, want_v = kpool.copy(), vpool.copy()
    for b, p in enumerate(positions):
        q, k, v = rope_append_rows_oracle(qkv[b:b + 1], h, kvh, d, p, inv, neox, *norms, eps=EPS)
        np.testing.assert_allclose(got_qkv[b, :h * d].reshape(h, d), q[:, 0], rtol=0, atol=tol * np.abs(q).max())
        np.testing.assert_array_equal(got_qkv[b, h * d:], qkv[b, h * d:])  # K and V of qkv are only read
        want_k[tab[b, p // bs], :, p % bs] = k[:, 0]
        want_v[tab[b, p // bs], :, p % bs] = _round(v[:, 0], kv_dtype)
    if kv_dtype == "q8_0":  # K: the kernel's rotation differs from the oracle's in the last bits, so a code
        # may land one step (max|k| / 127 of its group) off; everything else is exact
        kq = _round(want_k, "q8_0")
        step = np.abs(want_k).reshape(*want_k.shape[:-1], d // 32, 32).max(-1, keepdims=True) / 127
        err = np.abs(gk - kq).reshape(step.shape[:-1] + (32,))
        assert (err <= step * 1.001 + 1e-6).all(), f"K codes off by more than one step: {(err / step).max()}"
        np.testing.assert_array_equal(gv, _round(want_v, "q8_0"))
        return
    ulp = {"f32": 2e-6, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}[kv_dtype]  # one rounding of the stored value
    np.testing.assert_allclose(gk, want_k, rtol=ulp, atol=tol * 4)
    np.testing.assert_array_equal(gv, want_v)


# ---- prefill ------------------------------------------------------------------------------------------

@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=st.sampled_from([(2, 1), (4, 2), (3, 3)]), d=st.sampled_from([32, 64]), bs=st.sampled_from([16, 32, 64]),
       kv_dtype=st.sampled_from(["f16", "f32", "bf16", "q8_0"]), cached=st.integers(0, 80), count=st.integers(1, 70),
       neox=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_append_rows_and_prefill_attention(hk, d, bs, kv_dtype, cached, count, neox, seed):
    """``cached`` positions already in the pool (a prefix hit), then a chunk of ``count`` tokens appended
    and attended causally through the same shuffled table."""
    h, kvh = hk
    rng = np.random.default_rng(seed)
    total = cached + count
    stride = -(-total // bs)
    nb = 1 + stride + 2
    tab = _tables(rng, [total], bs, nb, stride)[0]
    kpool = np.full((nb, kvh, bs, d), np.nan)
    vpool = np.full((nb, kvh, bs, d), np.nan)
    kc = _round(rng.standard_normal((kvh, cached, d)), kv_dtype)
    vc = _round(rng.standard_normal((kvh, cached, d)), kv_dtype)
    for p in range(cached):
        kpool[tab[p // bs], :, p % bs] = kc[:, p]
        vpool[tab[p // bs], :, p % bs] = vc[:, p]
    cache = _cache(h, kvh, d, nb, bs, kv_dtype, max_batch=1)
    _upload(cache, 0, kpool, vpool)
    dev = cache.device
    qkv = (rng.standard_normal((count, (h + 2 * kvh) * d))).astype(np.float32)
    inv = inv_freq_table(d, 10000.0)
    tb = _buf(dev, tab)
    q_out = cuda.GpuBuffer(h * count * d, device=dev)
    q_out.poison()
    cache.append_rows(0, _buf(dev, qkv.reshape(-1)), _buf(dev, inv), cached, count, q_out, tb, neox=neox)
    q, k, v = rope_append_rows_oracle(qkv, h, kvh, d, cached, inv, neox)
    got_q = q_out.copy_to_host().reshape(h, count, d)
    np.testing.assert_allclose(got_q, q, rtol=0, atol=2e-6 * np.abs(q).max())
    gk, gv = cache.pools_to_numpy(0)
    keys = np.concatenate([kc, _round(k, kv_dtype)], axis=1)
    values = np.concatenate([vc, _round(v, kv_dtype)], axis=1)
    got_k = np.stack([gk[tab[p // bs], :, p % bs] for p in range(total)], axis=1)
    got_v = np.stack([gv[tab[p // bs], :, p % bs] for p in range(total)], axis=1)
    if kv_dtype == "q8_0":  # one code step (max|k| / 127 of the group) where the rotations differ in the last bits
        step = np.abs(k).reshape(kvh, count, d // 32, 32).max(-1, keepdims=True) / 127
        err = np.abs(got_k[:, cached:] - keys[:, cached:]).reshape(step.shape[:-1] + (32,))
        assert (err <= step * 1.001 + 1e-6).all(), f"K codes off by more than one step: {(err / step).max()}"
        np.testing.assert_array_equal(got_k[:, :cached], keys[:, :cached])
    else:
        ulp = {"f32": 2e-6, "f16": 2.0 ** -10, "bf16": 2.0 ** -7}[kv_dtype]
        np.testing.assert_allclose(got_k, keys, rtol=ulp, atol=1e-5)
    np.testing.assert_array_equal(got_v, values)
    out = cuda.GpuBuffer(count * h * d, np.float16, device=dev)
    out.poison()
    cache.prefill_attention(0, q_out, out, count, cached, total, tb)
    ref = gqa_attention(got_q.astype(np.float64), got_k.astype(np.float64), got_v.astype(np.float64), causal=True,
                        q_offset=cached)
    got = out.copy_to_host().astype(np.float64).reshape(count, h, d).transpose(1, 0, 2)
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 4e-3, f"relative error {err:.2e}"  # f16 Q, K, V, P into the MMAs


# ---- assembly and argument checks ---------------------------------------------------------------------

@pytest.mark.parametrize("name,shape", tiered([
    ("paged_decode_attention", dict(head_dim=128, group=4, block_size=32, kv_dtype="f16", unroll=2)),
    ("paged_decode_attention", dict(head_dim=128, group=8, block_size=32, kv_dtype="f16", out_f16=True)),
    ("paged_decode_attention", dict(head_dim=128, group=8, block_size=32, kv_dtype="f32", unroll=4)),
    ("paged_decode_attention", dict(head_dim=64, group=8, block_size=16, kv_dtype="bf16", unroll=4)),
    ("paged_append_decode", dict(head_dim=128, block_size=32, kv_dtype="f16", qk_norm=True)),
    ("paged_append_rows", dict(head_dim=128, block_size=32, kv_dtype="bf16", neox=True)),
    ("paged_prefill_attention", dict(head_dim=128, group=4, block_size=32, kv_dtype="f16")),
    ("paged_prefill_attention", dict(head_dim=64, group=8, block_size=16, kv_dtype="f32")),
    ("paged_decode_attention", dict(head_dim=128, group=8, block_size=32, kv_dtype="q8_0", out_f16=True)),
    ("paged_decode_attention", dict(head_dim=128, group=4, block_size=32, kv_dtype="q8_0", unroll=4)),
    ("paged_decode_attention", dict(head_dim=96, group=8, block_size=16, kv_dtype="q8_0", unroll=2)),
    ("paged_decode_attention", dict(head_dim=256, group=8, block_size=32, kv_dtype="q8_0", unroll=2)),
    ("paged_decode_attention", dict(head_dim=128, group=8, block_size=32, kv_dtype="f16", unroll=2, lanes=16)),
    ("paged_decode_attention", dict(head_dim=128, group=8, block_size=32, kv_dtype="q8_0", unroll=4, lanes=16)),
    ("paged_decode_attention", dict(head_dim=128, group=4, block_size=32, kv_dtype="f16", unroll=2, lanes=8)),
    ("paged_decode_attention", dict(head_dim=128, group=4, block_size=32, kv_dtype="q8_0", unroll=4, lanes=8)),
    ("paged_decode_attention", dict(head_dim=128, group=8, block_size=32, kv_dtype="bf16", unroll=2, lanes=16)),
    ("paged_append_decode", dict(head_dim=128, block_size=32, kv_dtype="q8_0", qk_norm=True)),
    ("paged_append_decode", dict(head_dim=96, block_size=32, kv_dtype="q8_0", neox=True)),
    ("paged_append_rows", dict(head_dim=128, block_size=32, kv_dtype="q8_0", neox=True)),
    ("paged_prefill_attention", dict(head_dim=128, group=4, block_size=32, kv_dtype="q8_0")),
], {0}, unpack=True))
def test_assembles_without_spills(name, shape):
    _assemble_all(name, **shape)


def test_bad_arguments_raise_shape_errors():
    with pytest.raises(ShapeError, match="block_size"):
        _cache(4, 2, 64, 8, 48, "f16")
    with pytest.raises(ShapeError, match="kv_dtype"):
        _cache(4, 2, 64, 8, 16, "f8")
    with pytest.raises(ShapeError, match="head_dim"):
        _cache(4, 2, 40, 8, 16, "f16")
    with pytest.raises(ShapeError, match="multiple"):
        _cache(5, 2, 64, 8, 16, "f16")
    with pytest.raises(ShapeError, match="q8_0 pool needs head_dim a multiple of 32"):
        _cache(4, 2, 80, 8, 16, "q8_0")
    with pytest.raises(ShapeError, match="only a q8_0 pool has scales"):
        _cache(4, 2, 64, 8, 16, "f16").k_scales(0)
    cache = _cache(4, 2, 64, 8, 16, "f16", max_batch=2)
    dev = cache.device
    q, out = cuda.GpuBuffer(3 * 4 * 64, device=dev), cuda.GpuBuffer(3 * 4 * 64, device=dev)
    lens, tab = cuda.GpuBuffer(3, np.uint32, device=dev), cuda.GpuBuffer(6, np.uint32, device=dev)
    with pytest.raises(ShapeError, match="max_batch"):
        cache.decode_attention(0, q, out, lens, tab, 2, 3)
    with pytest.raises(ShapeError, match="block_tables"):
        cache.decode_attention(0, q, out, lens, tab, 4, 2)
    with pytest.raises(ShapeError, match="layer"):
        cache.decode_attention(1, q, out, lens, tab, 2, 2)
    with pytest.raises(ShapeError, match="q_norm and k_norm"):
        cache.append_decode(0, q, q, lens, tab, 2, 1, q_norm=q)
    with pytest.raises(ShapeError, match="causal"):
        cache.prefill_attention(0, q, out, 4, 3, 5, tab)
    with pytest.raises(ShapeError, match="block_table"):
        cache.prefill_attention(0, q, out, 2, 0, 2, [1, 2])


def test_quantize_q8_0_is_ggml_q8_0():
    """The oracle of the q8_0 pools: d = max|x| / 127 in f32, codes round(x / d) within [-127, 127] (the
    group's largest magnitude at +-127), scale f16(d), all-zero groups zero, idempotent on its own output;
    block_bytes counts 34 bytes per 32 values."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 3, 64)) * rng.uniform(0.01, 100, (5, 3, 1))).astype(np.float32)
    x[0, 0, :32] = 0
    codes, scales = quantize_q8_0(x)
    assert codes.dtype == np.int8 and scales.dtype == np.float16 and scales.shape == (5, 3, 2)
    g = x.reshape(5, 3, 2, 32).astype(np.float64)
    d = np.abs(g).max(-1) / 127
    np.testing.assert_allclose(scales.astype(np.float64), d, rtol=2.0 ** -11)
    c = codes.reshape(5, 3, 2, 32).astype(np.int64)
    assert np.abs(c).max() == 127 and (np.abs(c).max(-1)[d > 0] == 127).all() and not c[0, 0, 0].any()
    exact = np.where(d[..., None] > 0, g / np.where(d > 0, d, 1)[..., None], 0)
    assert np.abs(c - exact).max() <= 0.5 + 1e-4
    y = dequantize_q8_0(codes, scales)
    c2, s2 = quantize_q8_0(y)
    np.testing.assert_array_equal(c2, codes)
    np.testing.assert_array_equal(s2, scales)
    cache = _cache(8, 2, 64, 8, 16, "q8_0", max_batch=1)
    assert cache.block_bytes == 2 * 1 * 2 * 16 * 64 * 34 // 32
    assert _cache(8, 2, 64, 8, 16, "f16", max_batch=1).block_bytes == 2 * 2 * 16 * 64 * 2


def test_grid_is_independent_of_lengths():
    """The launch shape depends on the row count only: what a captured graph needs."""
    cache = _cache(8, 2, 64, 8, 16, "f16", max_batch=64)
    assert [cache.chunks_for(r) for r in (1, 8, 64)] == [cache.chunks_for(r) for r in (1, 8, 64)]
    assert cache.chunks_for(1) >= cache.chunks_for(64) >= 4
    assert catalog.spec("paged_decode_attention").grid
