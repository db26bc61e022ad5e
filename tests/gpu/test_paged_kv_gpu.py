"""PagedKVCache on the GPU at real shapes (32 query / 8 KV heads, head_dim 128, block 32) against the float64
oracle: decode attention of up to 64 rows of mixed lengths up to 4096 through shuffled block tables (NaN in
every pool row no sequence owns, NaN-poisoned outputs, f32 and f16 outputs, f16/f32/bf16 pools), the batched
decode append, and a prefill chunk after cached positions on tensor cores. ``-s`` prints event timings of
decode_attention."""

from __future__ import annotations

import numpy as np
import pytest

from ptx_gen.kernels.elementwise.rope import inv_freq_table
from realizar import cuda
from realizar.models.attention import gqa_attention
from tests.layer_oracles import rope_append_rows_oracle
from tests.test_paged_kv_ptx import _encode, _round, _tables

pytestmark = pytest.mark.gpu

H, KVH, D, BS = 32, 8, 128, 32


@pytest.fixture(scope="module")
def dev():
    if not cuda.is_available():
        pytest.skip("no CUDA GPU")
    return cuda.current_device()


def _case(rng, lengths, kv_dtype, scale=3.0, nan=True):
    stride = max(-(-max(n, 1) // BS) for n in lengths)
    nb = 1 + sum(-(-max(n, 1) // BS) for n in lengths) + 3
    tab = _tables(rng, lengths, BS, nb, stride)
    fill = np.nan if nan else 0.0
    kpool = np.full((nb, KVH, BS, D), fill, np.float32)
    vpool = np.full((nb, KVH, BS, D), fill, np.float32)
    keys, vals = [], []
    for b, n in enumerate(lengths):
        kk = _round(rng.standard_normal((KVH, n, D), np.float32), kv_dtype).astype(np.float32)
        vv = _round(rng.standard_normal((KVH, n, D), np.float32), kv_dtype).astype(np.float32)
        p = np.arange(n)
        kpool[tab[b, p // BS], :, p % BS] = kk.transpose(1, 0, 2)
        vpool[tab[b, p // BS], :, p % BS] = vv.transpose(1, 0, 2)
        keys.append(kk)
        vals.append(vv)
    q = (rng.standard_normal((len(lengths), H, D)) * scale).astype(np.float32)
    return q, kpool, vpool, tab, stride, nb, keys, vals


def _cache(dev, nb, kv_dtype, rows, **kw):
    from realizar.gpu.paged_kv import PagedKVCache
    return PagedKVCache(1, H, KVH, D, nb, BS, kv_dtype, device=dev, max_batch=max(rows, 1), **kw)


def _upload(cache, kpool, vpool):
    if cache.kv_dtype == "q8_0":
        cache.pools_from_numpy(0, kpool, vpool)
        return
    cache.k_pool(0).copy_from_host(_encode(kpool, cache.kv_dtype).reshape(-1))
    cache.v_pool(0).copy_from_host(_encode(vpool, cache.kv_dtype).reshape(-1))


def _ref(q, keys, vals, lengths):
    out = []
    for b, n in enumerate(lengths):
        if n == 0:
            out.append(np.zeros((H, D)))
        else:
            out.append(gqa_attention(q[b][:, None].astype(np.float64), keys[b].astype(np.float64),
                                     vals[b].astype(np.float64), causal=False)[:, 0])
    return np.stack(out)


@pytest.mark.parametrize("kv_dtype,out_f16,seed,lanes,prefetch,ring,unroll,scatter", [
    ("f16", False, 0, 0, False, 0, None, False), ("f16", True, 1, 0, False, 0, None, False),
    ("f32", False, 2, 0, False, 0, None, False), ("bf16", False, 3, 0, False, 0, None, False),
    ("q8_0", True, 4, 0, False, 0, None, False), ("f16", True, 5, 16, False, 0, None, False),
    ("q8_0", False, 6, 16, False, 0, None, False), ("f16", True, 7, 16, True, 0, None, False),
    ("q8_0", False, 8, 0, True, 0, None, False),
    # the ring of bulk copies (sm_90), with its scores reduce-scattered too
    ("f16", True, 9, 16, False, 3, 2, False), ("f16", False, 10, 16, False, 4, 4, False),
    ("bf16", True, 11, 0, False, 2, 2, False), ("f32", False, 12, 0, False, 6, 1, False),
    ("f16", True, 13, 16, False, 2, 4, False), ("f16", True, 14, 16, False, 2, 2, True),
    ("f16", False, 15, 16, False, 3, 4, True), ("bf16", True, 16, 16, False, 4, 2, True),
    ("f32", False, 17, 8, False, 2, 1, True)])
def test_decode_attention_mixed_batch(dev, kv_dtype, out_f16, seed, lanes, prefetch, ring, unroll, scatter):
    if ring and dev.target.compute_capability < (9, 0):
        pytest.skip(f"the ring's bulk copies need sm_90, this GPU is {dev.target.sm}")
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(1, 4097, 56)] + [1, 2, 31, 32, 33, 4096, 4095, 0]
    rng.shuffle(lengths)
    q, kpool, vpool, tab, stride, nb, keys, vals = _case(rng, lengths, kv_dtype)
    cache = _cache(dev, nb, kv_dtype, len(lengths), decode_lanes=lanes, decode_prefetch=prefetch, decode_ring=ring,
                   decode_unroll=unroll, decode_scatter=scatter)
    assert cache.decode_scatter == scatter
    _upload(cache, kpool, vpool)
    rows = len(lengths)
    ob = cuda.GpuBuffer(rows * H * D, np.float16 if out_f16 else np.float32, device=dev)
    qb, lb, tb = (cuda.GpuBuffer.from_numpy(x, device=dev) for x in
                  (q.reshape(-1), np.array(lengths, np.uint32), tab.reshape(-1)))
    ref = _ref(q, keys, vals, lengths)
    for _ in range(2):  # twice: the combine counters are back at zero
        ob.poison()
        cache.decode_attention(0, qb, ob, lb, tb, stride, rows, out_f16=out_f16)
        got = ob.copy_to_host().astype(np.float64).reshape(rows, H, D)
        assert np.isfinite(got).all()
        tol = 2e-3 if out_f16 else 2e-5
        np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())
    cache.close()


@pytest.mark.parametrize("kv_dtype", ["f16", "q8_0"])
def test_append_decode_real_shape(dev, kv_dtype):
    rng = np.random.default_rng(7)
    rows = 64
    positions = [int(x) for x in rng.integers(0, 4096, rows)]
    stride = 4096 // BS
    nb = 1 + rows * stride
    tab = _tables(rng, [4096] * rows, BS, nb, stride)
    cache = _cache(dev, nb, kv_dtype, rows)
    qkv = (rng.standard_normal((rows, (H + 2 * KVH) * D)) * 2).astype(np.float32)
    inv = inv_freq_table(D, 500000.0)
    qkv_b = cuda.GpuBuffer.from_numpy(qkv.reshape(-1), device=dev)
    cache.append_decode(0, qkv_b, cuda.GpuBuffer.from_numpy(inv, device=dev),
                        cuda.GpuBuffer.from_numpy(np.array(positions, np.uint32), device=dev),
                        cuda.GpuBuffer.from_numpy(tab.reshape(-1), device=dev), stride, rows)
    got_qkv = qkv_b.copy_to_host().reshape(rows, -1)
    gk, gv = cache.pools_to_numpy(0)
    for b, p in enumerate(positions):
        q, k, v = rope_append_rows_oracle(qkv[b:b + 1], H, KVH, D, p, inv, False)
        np.testing.assert_allclose(got_qkv[b, :H * D].reshape(H, D), q[:, 0], rtol=0, atol=4e-6 * np.abs(q).max())
        if kv_dtype == "q8_0":  # K within one code step (the rotations differ in the last bits), V exact
            step = np.abs(k[:, 0]).reshape(KVH, D // 32, 32).max(-1, keepdims=True) / 127
            err = np.abs(gk[tab[b, p // BS], :, p % BS] - _round(k[:, 0], "q8_0")).reshape(KVH, D // 32, 32)
            assert (err <= step * 1.001 + 1e-6).all()
        else:
            np.testing.assert_allclose(gk[tab[b, p // BS], :, p % BS], k[:, 0], rtol=2.0 ** -10, atol=1e-5)
        np.testing.assert_array_equal(gv[tab[b, p // BS], :, p % BS], _round(v[:, 0], kv_dtype))
    cache.close()


@pytest.mark.parametrize("cached,count,kv_dtype", [(0, 1000, "f16"), (700, 300, "f16"), (64, 129, "bf16"),
                                                            (700, 300, "q8_0")])
def test_prefill_after_cached_positions(dev, cached, count, kv_dtype):
    rng = np.random.default_rng(cached + count)
    total = cached + count
    stride = -(-total // BS)
    nb = stride + 5
    tab = _tables(rng, [total], BS, nb, stride)[0]
    cache = _cache(dev, nb, kv_dtype, 1)
    kc = _round(rng.standard_normal((KVH, cached, D)), kv_dtype)
    vc = _round(rng.standard_normal((KVH, cached, D)), kv_dtype)
    kpool = np.full((nb, KVH, BS, D), np.nan, np.float32)
    vpool = np.full((nb, KVH, BS, D), np.nan, np.float32)
    p = np.arange(cached)
    kpool[tab[p // BS], :, p % BS] = kc.transpose(1, 0, 2)
    vpool[tab[p // BS], :, p % BS] = vc.transpose(1, 0, 2)
    _upload(cache, kpool, vpool)
    qkv = rng.standard_normal((count, (H + 2 * KVH) * D)).astype(np.float32)
    inv = inv_freq_table(D, 10000.0)
    tb = cuda.GpuBuffer.from_numpy(tab, device=dev)
    q_out = cuda.GpuBuffer(H * count * D, device=dev)
    out = cuda.GpuBuffer(count * H * D, np.float16, device=dev)
    out.poison()
    cache.append_rows(0, cuda.GpuBuffer.from_numpy(qkv.reshape(-1), device=dev),
                      cuda.GpuBuffer.from_numpy(inv, device=dev), cached, count, q_out, tb)
    cache.prefill_attention(0, q_out, out, count, cached, total, tb)
    q, k, v = rope_append_rows_oracle(qkv, H, KVH, D, cached, inv, False)
    keys = np.concatenate([kc, _round(k, kv_dtype)], axis=1)
    values = np.concatenate([vc, _round(v, kv_dtype)], axis=1)
    ref = gqa_attention(q_out.copy_to_host().reshape(H, count, D).astype(np.float64), keys, values, causal=True,
                        q_offset=cached)
    got = out.copy_to_host().astype(np.float64).reshape(count, H, D).transpose(1, 0, 2)
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 4e-3, f"relative error {err:.2e}"
    cache.close()


def test_decode_timings(dev):
    """Event-timed medians (printed with -s): paged decode attention, f16 and q8_0 pools, f16 output, at
    B=64 L=256, B=1 L=4096 and B=64 L=4096 for lanes per row (0: the kernel's default) x unroll. Bytes: the K/V rows read (q8_0: codes + scales)."""
    from realizar.cuda.bench import median_us
    from realizar.gpu.paged_kv import kv_bytes_per_row
    stream = cuda.Stream(dev)
    rng = np.random.default_rng(11)
    results = {}
    for rows, length in ((64, 256), (1, 4096), (64, 4096)):
        lengths = [length] * rows
        stride = length // BS
        nb = 1 + rows * stride
        tab = _tables(rng, lengths, BS, nb, stride)
        q = (rng.standard_normal((rows, H, D)) * 3).astype(np.float32)
        qb, lb, tb = (cuda.GpuBuffer.from_numpy(x, device=dev) for x in
                      (q.reshape(-1), np.array(lengths, np.uint32), tab.reshape(-1)))
        ob = cuda.GpuBuffer(rows * H * D, np.float16, device=dev)
        n = nb * KVH * BS * D
        for kv_dtype in ("f16", "q8_0"):
            cache = _cache(dev, nb, kv_dtype, rows)
            for pool in (cache.k_pool(0), cache.v_pool(0)):  # finite contents, a repeating random pattern
                if kv_dtype == "f16":
                    pool.copy_from_host(np.resize(rng.standard_normal(1 << 20).astype(np.float16), n))
                else:
                    pool.copy_from_host(np.resize(rng.integers(-127, 128, 1 << 20).astype(np.int8), n))
            if kv_dtype == "q8_0":
                for sc in (cache.k_scales(0), cache.v_scales(0)):
                    sc.copy_from_host(np.full(n // 32, 0.02, np.float16))
            for lanes, unroll in ((0, 2), (0, 4), (16, 2), (16, 4), (8, 2), (8, 4)):
                cache.decode_lanes, cache.decode_unroll = lanes, unroll

                def run(cache=cache, qb=qb, ob=ob, lb=lb, tb=tb, stride=stride, rows=rows):
                    for _ in range(20):
                        cache.decode_attention(0, qb, ob, lb, tb, stride, rows, out_f16=True, stream=stream)
                us = median_us(run, stream, 20, 5)
                kv_bytes = 2 * rows * length * KVH * kv_bytes_per_row(D, kv_dtype)
                results[f"paged {kv_dtype} B={rows} L={length} lanes={lanes} unroll={unroll}"] = (us, kv_bytes / us / 1e3)
            cache.close()
    for name, (us, gbs) in results.items():
        print(f"{name}: {us:.2f} us  ({gbs:.0f} GB/s of K/V)")
    assert all(us > 0 for us, _ in results.values())
