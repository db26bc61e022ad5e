"""CPU tests of the decode attention kernels (incremental attention and flash decoding) on the PTX
emulator ``ptx_gen.emulator`` (memcheck-, barrier- and racecheck-like checks included):

* the generated PTX *runs* and matches the float64 oracle over drawn head layouts, lengths, chunk
  counts and kernel variants -- and a planted bug (an online-softmax rescale forced to 1, a combine
  counter never reset) is caught by the same data;
* single-launch flash decoding keeps its counters at zero across repeated calls (graph replays) and
  handles seq_len 0, 1 and chunk boundaries +-1 with NaN-poisoned outputs and partial buffers;
* a device-side seq_len past max_len is clamped.

Their ptxas, index-math and executor tests are in tests/test_attention_ptx.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.builder import Module
from ptx_gen.kernels.attention.decode_core import active_chunks, chunk_rows
from ptx_gen.kernels.attention.flash_decoding import GROUP_CHUNKS, fused_buffer_sizes
from realizar.models.attention import attention_with_cache_gqa
from ptx_gen.emulator import Memory, run
from tests.attention_ptx_cases import HEAD_DIMS, RTOL, _rel, heads, variants
from tests.helpers import examples


# ---- emulated runs against the float64 oracle --------------------------------------------------------

def _decode_data(rng, h, kvh, d, length, max_len, scale, late_spike):
    q = (rng.standard_normal((h, d)) * scale).astype(np.float32)
    kc = np.full((kvh, max_len, d), np.nan, np.float32)  # never-written rows are NaN: must not be read
    vc = np.full((kvh, max_len, d), np.nan, np.float32)
    kc[:, :length] = rng.standard_normal((kvh, length, d))
    vc[:, :length] = rng.standard_normal((kvh, length, d))
    if late_spike and length > 2:
        # a key aligned with its queries near the end: the running max jumps late, so every earlier
        # partial must be rescaled by exp(m_old - m_new)
        pos = length - 1 - int(rng.integers(0, min(3, length - 1)))
        group = h // kvh
        for g in range(kvh):
            kc[g, pos] = q[g * group] / np.linalg.norm(q[g * group]) * 4.0
    ref = attention_with_cache_gqa(q.astype(np.float64), kc[:, : length - 1].astype(np.float64),
                                   vc[:, : length - 1].astype(np.float64), kc[:, length - 1].astype(np.float64),
                                   vc[:, length - 1].astype(np.float64))
    return q, kc, vc, ref


def _run_decode(kind, ptx_src, q, kc, vc, length, max_len, indirect, nch=5, min_chunk=None, reduce_src=None,
                kvh=None, group=None):
    mem = Memory()
    h, d = q.shape
    pq, pk, pv, po = mem.alloc_array(q), mem.alloc_array(kc), mem.alloc_array(vc), mem.alloc(h * d * 4)
    sl = {"seq_len_ptr": mem.alloc_array(np.array([length], np.uint32))} if indirect else {"seq_len": length}
    if kind == "incremental":
        run(ptx_src.ptx, (kvh * ptx_src.meta["subgroups"],), (ptx_src.meta["block"],),
            {"q": pq, "k_cache": pk, "v_cache": pv, "out": po, "max_len": max_len, **sl}, mem)
    else:
        pacc, pml = mem.alloc(h * nch * d * 4), mem.alloc(h * nch * 8)
        run(ptx_src.ptx, (kvh * ptx_src.meta["subgroups"], nch), (ptx_src.meta["block"],),
            {"q": pq, "k_cache": pk, "v_cache": pv, "part_acc": pacc, "part_ml": pml, "max_len": max_len,
             "min_chunk": min_chunk or ptx_src.meta["quantum"], **sl}, mem)
        run(reduce_src.ptx, (h,), (reduce_src.meta["block"],),
            {"part_acc": pacc, "part_ml": pml, "out": po, "max_len": max_len, **sl}, mem)
    return mem.read(po, np.float32, h * d).reshape(h, d)


def _run_fused(src, q, kc, vc, lengths, max_len, nch, min_chunk, kvh, indirect=True, check_counters=True,
               grow_rows=0) -> list:
    """Single-launch flash decoding called once per entry of ``lengths`` on the same partial buffers
    and counters (as an executor or a graph replay reuses them); outputs and partials are NaN-poisoned
    before every call and the counters must be back at zero after it."""
    h, d = q.shape
    gx = kvh * src.meta["subgroups"]
    n_acc, n_ml, n_cnt = fused_buffer_sizes(h, gx, nch, d)
    mem = Memory()
    pq, pk, pv, po = mem.alloc_array(q), mem.alloc_array(kc), mem.alloc_array(vc), mem.alloc(h * d * 4)
    pacc, pml = mem.alloc(n_acc * 4), mem.alloc(n_ml * 4)
    cnt = mem.alloc_array(np.zeros(n_cnt, np.uint32))
    psl = mem.alloc(4)
    outs = []
    for length in lengths:
        for ptr, n in ((po, h * d), (pacc, n_acc), (pml, n_ml)):
            mem.fill(ptr, 0xFF, n * 4)
        mem.write_bytes(psl, np.array([length], np.uint32))
        sl = {"seq_len_ptr": psl} if indirect else {"seq_len": length}
        run(src.ptx, (gx, nch), (src.meta["block"],),
            {"q": pq, "k_cache": pk, "v_cache": pv, "out": po, "part_acc": pacc, "part_ml": pml, "counters": cnt,
             "max_len": max_len, "min_chunk": min_chunk, "grow_rows": grow_rows, **sl}, mem)
        counters = mem.read(cnt, np.uint32, n_cnt)
        assert not (check_counters and counters.any()), f"L={length}: counters left at {counters.tolist()}"
        outs.append(mem.read(po, np.float32, h * d).reshape(h, d).copy())
    return outs


def _ref_prefix(q, kc, vc, length):
    """The oracle over the first ``length`` rows of the caches (zeros for an empty sequence)."""
    if length == 0:
        return np.zeros(q.shape)
    k64, v64 = kc[:, :length].astype(np.float64), vc[:, :length].astype(np.float64)
    return attention_with_cache_gqa(q.astype(np.float64), k64[:, :-1], v64[:, :-1], k64[:, -1], v64[:, -1])

@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), length=st.integers(1, 300), slack=st.integers(0, 20),
       scale=st.floats(0.1, 30), late=st.booleans(), indirect=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_incremental_attention_emulated(hk, d, length, slack, scale, late, indirect, seed):
    h, kvh = hk
    rng = np.random.default_rng(seed)
    max_len = length + slack
    q, kc, vc, ref = _decode_data(rng, h, kvh, d, length, max_len, scale, late)
    src = catalog.emit("incremental_attention", target="sm_90", head_dim=d, group=h // kvh, indirect=indirect)
    got = _run_decode("incremental", src, q, kc, vc, length, max_len, indirect, kvh=kvh)
    assert _rel(got, ref) < RTOL


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), length=st.integers(1, 400), slack=st.integers(0, 20),
       nch=st.integers(1, 12), min_mult=st.integers(1, 3), scale=st.floats(0.1, 30), late=st.booleans(),
       indirect=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_flash_decoding_emulated(hk, d, length, slack, nch, min_mult, scale, late, indirect, seed):
    h, kvh = hk
    rng = np.random.default_rng(seed)
    max_len = length + slack
    q, kc, vc, ref = _decode_data(rng, h, kvh, d, length, max_len, scale, late)
    chunk = catalog.emit("flash_decoding_chunk", target="sm_90", head_dim=d, group=h // kvh, indirect=indirect)
    red = catalog.emit("flash_decoding_reduce", target="sm_90", head_dim=d, num_chunks=nch, indirect=indirect)
    got = _run_decode("flash", chunk, q, kc, vc, length, max_len, indirect, nch=nch,
                      min_chunk=chunk.meta["quantum"] * min_mult, reduce_src=red, kvh=kvh)
    assert _rel(got, ref) < RTOL


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), length=st.integers(1, 300), again=st.integers(0, 300),
       slack=st.integers(0, 20), nch=st.integers(1, 40), min_chunk=st.integers(1, 40),
       grow_rows=st.sampled_from([0, 0, 8, 64]), scale=st.floats(0.1, 30), late=st.booleans(),
       indirect=st.booleans(), opts=variants, seed=st.integers(0, 2**32 - 1))
def test_single_launch_flash_decoding_emulated(hk, d, length, again, slack, nch, min_chunk, grow_rows, scale, late,
                                               indirect, opts, seed):
    """Two calls on the same buffers: the drawn length, then another one (0 included)."""
    h, kvh = hk
    rng = np.random.default_rng(seed)
    max_len = length + slack
    again = min(again, max_len)
    q, kc, vc, ref = _decode_data(rng, h, kvh, d, length, max_len, scale, late)
    kc[:, length:] = rng.standard_normal((kvh, max_len - length, d))  # rows a second call may read
    vc[:, length:] = rng.standard_normal((kvh, max_len - length, d))
    src = catalog.emit("flash_decoding", target="sm_90", head_dim=d, group=h // kvh, indirect=indirect, **opts)
    first, second = _run_fused(src, q, kc, vc, [length, again], max_len, nch, min_chunk, kvh, indirect,
                               grow_rows=grow_rows)
    assert _rel(first, ref) < RTOL
    if again:
        assert _rel(second, _ref_prefix(q, kc, vc, again)) < RTOL
    else:
        assert np.array_equal(second, np.zeros_like(second))


def test_single_launch_flash_decoding_at_chunk_and_set_boundaries():
    """rows = 4 per chunk below L = 161 (40 chunks, min_chunk 4, no growth): one active chunk (no
    partials), one set of up to 16 chunks (one combine level), 17+ chunks (two levels, a one-chunk last
    set), the full grid, rows growing past it, a clamped length, and zero -- all on the same counters.
    Then the same lengths with chunks growing to 8 rows to stay in one set (up to L = 128)."""
    rng = np.random.default_rng(11)
    h, kvh, d, max_len, nch, min_chunk = 7, 1, 64, 170, 40, 4
    q = (rng.standard_normal((h, d)) * 4).astype(np.float32)
    kc = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    vc = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
    lengths = [1, 3, 4, 5, 63, 64, 65, 68, 69, 159, 160, 161, 170, 1000, 0, 2]
    assert [active_chunks(L, chunk_rows(L, nch, min_chunk)) for L in lengths[:12]] == \
        [1, 1, 1, 2, 16, 16, 17, 17, 18, 40, 40, 33]
    assert [active_chunks(L, chunk_rows(L, nch, min_chunk, 8, GROUP_CHUNKS)) for L in lengths[:12]] == \
        [1, 1, 1, 2, 16, 16, 13, 14, 14, 40, 40, 33]
    for opts, grow in (({}, 0), ({"scores": "butterfly", "prefetch": True}, 0), ({}, 8)):
        src = catalog.emit("flash_decoding", target="sm_90", head_dim=d, group=h, indirect=True, **opts)
        outs = _run_fused(src, q, kc, vc, lengths, max_len, nch, min_chunk, kvh, grow_rows=grow)
        for length, got in zip(lengths, outs):
            assert _rel(got, _ref_prefix(q, kc, vc, min(length, max_len))) < RTOL if length else \
                np.array_equal(got, np.zeros_like(got)), f"L={length} {opts}"


def test_a_counter_left_behind_is_caught():
    """Plant the bug the reset prevents (the last block of a set leaves its counter at the set size):
    the check after each call reports it, and the next call finds no last block and leaves the
    NaN-poisoned output."""
    src = catalog.emit("flash_decoding", target="sm_90", head_dim=32, group=2, indirect=True)
    lines = src.ptx.splitlines()
    resets = [i for i, x in enumerate(lines) if x.strip().startswith("st.global.u32") and x.strip().endswith(", 0;")]
    assert len(resets) == 2  # one per combine level
    broken = catalog.PtxKernel(src.name, src.entry, src.target, src.shape,
                               "\n".join(x for i, x in enumerate(lines) if i not in resets), src.params, src.launch, src.meta)
    rng = np.random.default_rng(2)
    q, kc, vc, ref = _decode_data(rng, 2, 1, 32, 30, 30, 2.0, False)
    assert _rel(_run_fused(src, q, kc, vc, [30, 30], 30, 8, 4, 1)[1], ref) < RTOL
    with pytest.raises(AssertionError, match="counters left"):
        _run_fused(broken, q, kc, vc, [30], 30, 8, 4, 1)
    first, second = _run_fused(broken, q, kc, vc, [30, 30], 30, 8, 4, 1, check_counters=False)
    assert _rel(first, ref) < RTOL and np.isnan(second).all()


def test_flash_decoding_zero_length_writes_zeros():
    rng = np.random.default_rng(0)
    q, kc, vc, _ = _decode_data(rng, 4, 2, 64, 5, 8, 1.0, False)
    chunk = catalog.emit("flash_decoding_chunk", target="sm_90", head_dim=64, group=2, indirect=True)
    red = catalog.emit("flash_decoding_reduce", target="sm_90", head_dim=64, num_chunks=3, indirect=True)
    got = _run_decode("flash", chunk, q, kc, vc, 0, 8, True, nch=3, reduce_src=red, kvh=2)
    assert np.array_equal(got, np.zeros_like(got))
    inc = catalog.emit("incremental_attention", target="sm_90", head_dim=64, group=2, indirect=False)
    got = _run_decode("incremental", inc, q, kc, vc, 0, 8, False, kvh=2)
    assert np.array_equal(got, np.zeros_like(got))


def test_device_seq_len_is_clamped_to_max_len():
    rng = np.random.default_rng(1)
    q, kc, vc, ref = _decode_data(rng, 2, 1, 32, 16, 16, 2.0, False)
    chunk = catalog.emit("flash_decoding_chunk", target="sm_90", head_dim=32, group=2, indirect=True)
    red = catalog.emit("flash_decoding_reduce", target="sm_90", head_dim=32, num_chunks=4, indirect=True)
    got = _run_decode("flash", chunk, q, kc, vc, 1000, 16, True, nch=4, reduce_src=red, kvh=1)
    assert _rel(got, ref) < RTOL  # a length past max_len reads max_len rows, never beyond


@pytest.mark.parametrize("scores", ["scatter", "butterfly"])
def test_the_data_catches_a_missing_rescale(monkeypatch, scores):
    """Plant the Rust original's bug (the rescale factor exp(m_old - m_new) forced to 1): the oracle
    test's data must fail it, while the real kernel passes on the same data."""
    import ptx_gen.kernels.attention.incremental_attention as ia
    from ptx_gen.builder import KernelBuilder

    real_ex2 = KernelBuilder.ex2

    def build(buggy: bool) -> catalog.PtxKernel:
        m = Module("sm_90")
        if buggy:
            calls = []

            def ex2(self, a):  # the first ex2 emitted is (head 0's / the lane's head's) alpha in the row loop
                calls.append(a)
                return self.mov(1.0, "f32") if len(calls) == 1 else real_ex2(self, a)

            monkeypatch.setattr(KernelBuilder, "ex2", ex2)
        k = ia.incremental_attention(m, head_dim=64, group=2, indirect=False, warps=1, unroll=1, scores=scores)
        monkeypatch.setattr(KernelBuilder, "ex2", real_ex2)
        return catalog.PtxKernel("t", k.name, "sm_90", (("buggy", buggy),), m.emit(), k.params,
                                 catalog.LaunchHints.from_meta("t", k.meta), dict(k.meta))

    rng = np.random.default_rng(5)
    q, kc, vc, ref = _decode_data(rng, 4, 2, 64, 90, 96, 3.0, True)
    good = _run_decode("incremental", build(False), q, kc, vc, 90, 96, False, kvh=2)
    bad = _run_decode("incremental", build(True), q, kc, vc, 90, 96, False, kvh=2)
    assert _rel(good, ref) < RTOL
    assert _rel(bad, ref) > 1e-2
