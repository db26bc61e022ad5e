"""The decode kernel's ring of bulk copies (:mod:`ptx_gen.kernels.attention.paged_decode_ring`) on an emulated sm_90
against the float64 oracle: rows of mixed lengths through shuffled tables, pools NaN wherever no sequence owns a row
(so a copied piece's rows past a length must read as zeros), every ring depth, stages of part of a block, of one and
of several, chunks combined, outputs NaN-poisoned; ptxas on sm_90 without spills at the shapes the runtime picks; the
runtime's default and its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.attention.paged_decode_ring import RING_STAGES, ring_bytes, scatter_applies
from ptx_gen.ptxas import assemble
from realizar import cuda
from realizar.errors import ShapeError
from realizar.gpu import paged_kv
from realizar.gpu.paged_kv import PagedKVCache, default_decode_ring
from tests.helpers import examples
from tests.test_paged_kv_ptx import HEADS, _decode_case, _run_decode, _upload


def _ring_cache(h, kvh, d, nb, bs, kv_dtype, target="sm_90", **kw) -> PagedKVCache:
    dev = cuda.EmulatedDevice(sm_count=2, target=target)
    return PagedKVCache(1, h, kvh, d, nb, bs, kv_dtype, device=dev, **kw)


def _ring_against_oracle(h, kvh, d, bs, kv_dtype, out_f16, lengths, scale, seed, entry: str, **kw) -> None:
    """One launch of the ring (``kw``: PagedKVCache's knobs) on rows of ``lengths`` against the float64 oracle, its
    kernel's entry containing ``entry``; a ring deeper than the shared memory must be refused as such."""
    rng = np.random.default_rng(seed)
    q, kpool, vpool, tab, stride, nb, ref = _decode_case(rng, h, kvh, d, bs, kv_dtype, lengths, scale)
    try:
        cache = _ring_cache(h, kvh, d, nb, bs, kv_dtype, max_batch=4, **kw)
    except ShapeError as exc:  # (a ring deeper than the shared memory)
        assert "shared memory" in str(exc)
        return
    assert entry in cache._decode_kernel(out_f16).source.entry
    assert ("_sc" in cache._decode_kernel(out_f16).source.entry) == cache.decode_scatter
    _upload(cache, 0, kpool, vpool)
    got, = _run_decode(cache, q, tab, stride, lengths, out_f16)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs or a NaN pool row read"
    tol = 2e-3 if out_f16 else 2e-5
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=st.sampled_from(HEADS), d=st.sampled_from([32, 64, 96, 128]), bs=st.sampled_from([16, 32, 64]),
       kv_dtype=st.sampled_from(["f16", "f32", "bf16"]), out_f16=st.booleans(), unroll=st.sampled_from([1, 2, 4]),
       lanes=st.sampled_from([0, 8, 16]), stages=st.sampled_from(RING_STAGES),
       lengths=st.lists(st.one_of(st.integers(1, 40), st.integers(60, 300)), min_size=1, max_size=3),
       min_chunk=st.sampled_from([None, 16, 64]), scale=st.floats(0.2, 8), seed=st.integers(0, 2**32 - 1),
       scatter=st.sampled_from([None, False]))
def test_ring_matches_oracle(hk, d, bs, kv_dtype, out_f16, unroll, lanes, stages, lengths, min_chunk, scale, seed,
                             scatter):
    """The ring at its default scores (reduce-scattered where the shape takes it) and with every dot reduced on its
    own."""
    h, kvh = hk
    lanes = 0 if d % (4 * max(lanes, 1)) else lanes
    _ring_against_oracle(h, kvh, d, bs, kv_dtype, out_f16, lengths, scale, seed, f"_r{stages}", decode_unroll=unroll,
                         min_chunk=min_chunk, decode_lanes=lanes, decode_ring=stages, decode_scatter=scatter)


@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("stages,bs,unroll", [(2, 16, 4), (3, 32, 2), (4, 64, 1)])
def test_ring_many_chunks_and_refills(stages, bs, unroll, scatter):
    """A long row over several chunks whose stages outnumber the ring (refills), one position, an empty row (zeros), a
    row ending one position into a block; the same launch twice on the same counters."""
    rng = np.random.default_rng(stages)
    lengths = [700, 1, 0, 33]
    q, kpool, vpool, tab, stride, nb, ref = _decode_case(rng, 8, 2, 64, bs, "f16", lengths, 3.0)
    cache = _ring_cache(8, 2, 64, nb, bs, "f16", max_batch=4, num_chunks=3, min_chunk=16, decode_unroll=unroll,
                        decode_lanes=16, decode_ring=stages, decode_scatter=scatter)
    assert cache.decode_scatter == scatter
    _upload(cache, 0, kpool, vpool)
    first, second = _run_decode(cache, q, tab, stride, lengths, False, repeats=2)
    np.testing.assert_array_equal(first, second)
    assert not first[2].any()
    np.testing.assert_allclose(first, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("shape", [
    dict(head_dim=128, group=4, block_size=32, kv_dtype="f16", out_f16=True, unroll=2, lanes=16, ring=3),
    dict(head_dim=128, group=4, block_size=32, kv_dtype="f16", out_f16=True, unroll=2, lanes=16, ring=4),
    dict(head_dim=128, group=4, block_size=32, kv_dtype="f16", out_f16=True, unroll=4, lanes=16, ring=4),
    dict(head_dim=64, group=3, block_size=32, kv_dtype="bf16", out_f16=True, unroll=2, ring=4),
    dict(head_dim=128, group=1, block_size=16, kv_dtype="f32", unroll=2, ring=2),
    dict(head_dim=128, group=4, block_size=32, kv_dtype="f16", out_f16=True, unroll=2, lanes=16, ring=2, scatter=True),
    dict(head_dim=128, group=8, block_size=32, kv_dtype="f16", out_f16=True, unroll=2, lanes=16, ring=2, scatter=True),
])
def test_ring_assembles_without_spills(shape):
    k = catalog.emit("paged_decode_attention", target="sm_90", **shape)
    (rep,) = assemble(k.ptx, "sm_90")
    assert not rep.spills, f"{shape} spills: {rep.log}"
    e = 4 if shape["kv_dtype"] == "f32" else 2
    assert k.meta["dyn_smem"] >= shape["ring"] * 2 * k.meta["rows_per_step"] * shape["head_dim"] * e


def test_ring_refusals():
    with pytest.raises(ValueError, match="sm_90"):
        catalog.emit("paged_decode_attention", target="sm_80", ring=3)
    with pytest.raises(ValueError, match="takes K/V of"):
        catalog.emit("paged_decode_attention", target="sm_90", kv_dtype="q8_0", ring=3)
    with pytest.raises(ValueError, match="ring stages"):
        catalog.emit("paged_decode_attention", target="sm_90", ring=7)
    with pytest.raises(ValueError, match="prefetch"):
        catalog.emit("paged_decode_attention", target="sm_90", ring=3, prefetch=True)
    for kw in (dict(ring=0), dict(ring=2, group=3), dict(ring=2, group=4, unroll=4, lanes=8)):
        with pytest.raises(ValueError, match="scatter"):
            catalog.emit("paged_decode_attention", target="sm_90", head_dim=128, scatter=True, **kw)
    for kw, target in [(dict(kv_dtype="q8_0"), "sm_90"), ({}, "sm_80"), (dict(decode_prefetch=True), "sm_90")]:
        kv = kw.pop("kv_dtype", "f16")
        with pytest.raises(ShapeError, match="decode_ring"):
            _ring_cache(4, 2, 64, 8, 16, kv, target=target, decode_ring=3, **kw)
    with pytest.raises(ShapeError, match="shared memory"):  # (8 x 2 x 16 rows of 256 f32)
        _ring_cache(4, 1, 256, 8, 64, "f32", decode_ring=8, decode_unroll=4)


def test_default_ring_by_target_and_pool(monkeypatch):
    """The ring where it can run (sm_90, a head size it is the default for, a pool type it takes, shared memory
    enough), else the register pass."""
    monkeypatch.setattr(paged_kv, "DECODE_RING_STAGES", 3)
    t90, t80 = cuda.EmulatedDevice(target="sm_90").target, cuda.EmulatedDevice(target="sm_80").target
    assert default_decode_ring(t90, "f16", 128, 4, 32, 2, 16, 227 * 1024) == 3
    monkeypatch.setattr(paged_kv, "DECODE_RING_MIN_HEAD_DIM", 128)
    assert default_decode_ring(t90, "f16", 64, 4, 32, 2, 16, 227 * 1024) == 0
    assert _ring_cache(4, 2, 64, 8, 16, "f16").decode_ring == 0
    monkeypatch.setattr(paged_kv, "DECODE_RING_MIN_HEAD_DIM", 64)
    assert default_decode_ring(t80, "f16", 128, 4, 32, 2, 16, 163 * 1024) == 0
    assert default_decode_ring(t90, "q8_0", 128, 4, 32, 2, 16, 227 * 1024) == 0
    assert default_decode_ring(t90, "f16", 128, 4, 32, 2, 16, 16 * 1024) == 0  # (3 x 8 KB and the barriers)
    assert ring_bytes(3, 128, 4, 32, "f16", 16, 4) > 16 * 1024
    cache = _ring_cache(4, 2, 64, 8, 16, "f16")
    assert cache.decode_ring == 3 and cache.decode_unroll == paged_kv.DECODE_RING_UNROLL
    assert _ring_cache(4, 2, 64, 8, 16, "q8_0").decode_ring == 0
    assert _ring_cache(4, 2, 64, 8, 16, "f16", target="sm_80").decode_ring == 0
    assert _ring_cache(4, 2, 64, 8, 16, "f16", decode_prefetch=True).decode_ring == 0
    monkeypatch.setattr(paged_kv, "DECODE_RING_STAGES", 0)
    assert _ring_cache(4, 2, 64, 8, 16, "f16").decode_ring == 0


def test_default_scatter_where_the_shape_takes_it(monkeypatch):
    """Reduce-scattered scores by default on the ring at a power-of-two group whose heads x unroll fit the lanes of a
    row; never on the register pass or a group of 3; off with DECODE_RING_SCATTER."""
    assert _ring_cache(32, 8, 128, 8, 32, "f16", decode_lanes=16, decode_ring=2, decode_unroll=2).decode_scatter
    assert not _ring_cache(32, 8, 128, 8, 32, "f16", decode_ring=0).decode_scatter
    assert not _ring_cache(6, 2, 64, 8, 16, "f16", decode_lanes=16, decode_ring=2).decode_scatter
    assert not _ring_cache(32, 2, 128, 8, 32, "f16", decode_lanes=16, decode_ring=2, decode_unroll=4).decode_scatter
    assert scatter_applies(128, 4, 16, 4) and not scatter_applies(128, 16, 16, 2) and not scatter_applies(96, 2, 16, 1)
    monkeypatch.setattr(paged_kv, "DECODE_RING_SCATTER", False)
    assert not _ring_cache(32, 8, 128, 8, 32, "f16", decode_lanes=16, decode_ring=2, decode_unroll=2).decode_scatter


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=st.sampled_from([(8, 2), (4, 1), (2, 2), (8, 1), (16, 4), (4, 2), (16, 1)]), d=st.sampled_from([64, 128, 256]),
       bs=st.sampled_from([16, 32, 64]), kv_dtype=st.sampled_from(["f16", "f32", "bf16"]), out_f16=st.booleans(),
       unroll=st.sampled_from([1, 2, 4]), lanes=st.sampled_from([8, 16, 32]), stages=st.sampled_from((2, 3, 4)),
       lengths=st.lists(st.one_of(st.integers(1, 40), st.integers(60, 300)), min_size=1, max_size=3),
       min_chunk=st.sampled_from([None, 16, 64]), scale=st.floats(0.2, 8), seed=st.integers(0, 2**32 - 1))
def test_ring_scatter_matches_oracle(hk, d, bs, kv_dtype, out_f16, unroll, lanes, stages, lengths, min_chunk, scale,
                                     seed):
    """The ring with its scores reduce-scattered (each lane one head's softmax, probabilities through the exchange
    buffer) against the float64 oracle, wherever the shape takes it."""
    h, kvh = hk
    assume(d % (4 * lanes) == 0)
    if not scatter_applies(d, h // kvh, lanes, unroll):
        with pytest.raises(ShapeError, match="decode_scatter|shared memory"):  # (a ring too deep fails first)
            _ring_cache(h, kvh, d, 8, bs, kv_dtype, decode_unroll=unroll, decode_lanes=lanes, decode_ring=stages,
                        decode_scatter=True)
        return
    _ring_against_oracle(h, kvh, d, bs, kv_dtype, out_f16, lengths, scale, seed, f"_r{stages}_sc",
                         decode_unroll=unroll, min_chunk=min_chunk, decode_lanes=lanes, decode_ring=stages,
                         decode_scatter=True)
