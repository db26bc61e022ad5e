"""CPU tests of the attention kernels and the CudaExecutor.

* every kernel variant assembles with ptxas for sm_80 and sm_90 over drawn shapes, without spills;
* the index math (chunk split, lane mapping, reduce-scatter permutation, causal key range) covers
  every position exactly once;
* the generated prefill and KV-append PTX *runs* on the emulator ``ptx_gen.emulator`` (memcheck-,
  barrier- and racecheck-like checks included) and matches the float64 oracle, and a planted missing
  barrier is caught (the decode kernels' emulated runs are in tests/test_flash_decoding_ptx.py);
* the executor validates its arguments before touching a GPU, and runs end to end on an EmulatedDevice.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.kernels.attention.decode_core import (active_chunks, choose_lanes as _choose_lanes, chunk_rows, decode_layout,
                                                   loop_registers)
from ptx_gen.kernels.attention.flash_decoding import GROUP_CHUNKS
from ptx_gen.kernels.attention.flash_attention import prefill_tiles
from ptx_gen.ptxas import assemble
from realizar import cuda
from realizar.errors import CacheStateError, ContextOverflowError, ShapeError
from realizar.gpu.executor import AttentionConfig, CudaExecutor
from realizar.models.attention import attention_with_cache_gqa, gqa_attention
from tests.attention_cases import prefill_case
from ptx_gen.emulator import EmulatorError, Memory, run
from tests.attention_ptx_cases import HEAD_DIMS, RTOL, _rel, heads, variants
from tests.helpers import examples

TARGETS = ("sm_80", "sm_90")


# ---- ptxas over drawn shapes -------------------------------------------------------------------------

def _assemble_clean(name: str, **shape) -> None:
    for target in TARGETS:
        pk = catalog.emit(name, target=target, **shape)
        rep = assemble(pk.ptx, target)[0]
        assert not rep.spills, f"{name} {shape} spills on {target}: {rep.log}"
        assert rep.registers <= 255
        assert rep.shared_bytes <= 48 * 1024, f"{name} {shape}: {rep.shared_bytes} bytes of static shared memory"


@settings(max_examples=examples(12), deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), group=st.integers(1, 16), indirect=st.booleans(), opts=variants)
def test_decode_kernels_assemble(d, group, indirect, opts):
    _assemble_clean("incremental_attention", head_dim=d, group=group, indirect=indirect, **opts)
    _assemble_clean("flash_decoding_chunk", head_dim=d, group=group, indirect=indirect, **opts)
    _assemble_clean("flash_decoding", head_dim=d, group=group, indirect=indirect, **opts)


@pytest.mark.parametrize("d, group", [(64, 7), (128, 7), (128, 4)])
def test_default_decode_kernels_fit_four_blocks_per_sm(d, group):
    """The benchmark shapes: <= 128 registers (four 4-warp blocks per SM) and the register estimate
    behind the unroll choice within a few registers of ptxas."""
    pk = catalog.emit("flash_decoding", target="sm_90", head_dim=d, group=group)
    rep = assemble(pk.ptx, "sm_90")[0]
    assert rep.registers <= 128 and not rep.spills
    chunk = assemble(catalog.emit("flash_decoding_chunk", target="sm_90", head_dim=d, group=group).ptx, "sm_90")[0]
    assert abs(loop_registers(pk.meta["layout"]) - chunk.registers) <= 12


@settings(max_examples=examples(8), deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), chunks=st.integers(1, 256), indirect=st.booleans())
def test_reduce_and_append_assemble(d, chunks, indirect):
    _assemble_clean("flash_decoding_reduce", head_dim=d, num_chunks=chunks, indirect=indirect)
    _assemble_clean("kv_append", head_dim=d, indirect=indirect)


@settings(max_examples=examples(6), deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), group=st.integers(1, 8), causal=st.booleans(), tokens_f16=st.booleans())
def test_flash_attention_assembles(d, group, causal, tokens_f16):
    name = "flash_attention_tokens_f16" if tokens_f16 else "flash_attention"
    _assemble_clean(name, head_dim=d, group=group, causal=causal)
    pk = catalog.emit(name, target="sm_90", head_dim=d, group=group, causal=causal)
    assert pk.launch.dyn_smem <= 227 * 1024  # dynamic shared memory, opt-in limit of sm_90


def test_generator_rejects_bad_shapes():
    with pytest.raises(ValueError, match="head_dim"):
        catalog.emit("incremental_attention", head_dim=30, group=1)
    with pytest.raises(ValueError, match="head_dim"):
        catalog.emit("flash_decoding_chunk", head_dim=512, group=1)
    with pytest.raises(ValueError, match="divide"):
        catalog.emit("incremental_attention", head_dim=64, group=6, heads_per_block=4)
    with pytest.raises(ValueError, match="num_chunks"):
        catalog.emit("flash_decoding_reduce", head_dim=64, num_chunks=0)
    with pytest.raises(ValueError, match="% 8"):
        catalog.emit("flash_attention", head_dim=36, group=1)


# ---- index math ---------------------------------------------------------------------------------------

@given(seq_len=st.one_of(st.integers(0, 1 << 20), st.integers(0, 3000)), nch=st.integers(1, 4096),
       min_chunk=st.integers(1, 512), grow_rows=st.sampled_from([0, 16, 64, 128]))
def test_chunks_partition_the_sequence(seq_len, nch, min_chunk, grow_rows):
    rows = chunk_rows(seq_len, nch, min_chunk, grow_rows, GROUP_CHUNKS)
    assert rows >= max(1, min_chunk)
    assert nch * rows >= seq_len  # the static grid always covers the sequence
    nact = active_chunks(seq_len, rows)
    assert nact <= nch and (nact == 0) == (seq_len == 0)
    sizes = [min((c + 1) * rows, seq_len) - c * rows for c in range(nact)]
    assert sum(sizes) == seq_len and all(x >= 1 for x in sizes)  # active chunks are never empty
    grown = -(-seq_len // GROUP_CHUNKS)
    if grown <= grow_rows:  # short: one combine set, chunks no longer than that needs
        assert nact <= GROUP_CHUNKS and rows <= max(-(-seq_len // nch), min_chunk, grown)
    else:  # as short as the grid and min_chunk allow
        assert rows == max(-(-seq_len // nch), min_chunk, 1)


@pytest.mark.parametrize("T", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("V", [1, 2, 4, 8, 16, 32, 64])
def test_reduce_scatter_permutation(T, V):
    """The scatter layout's invariant, simulated: lane j stores index s ^ M(j) in slot s; after the
    keep-first-half shuffle levels (then plain butterflies) its slot e holds the group-wide sum of index
    M(j) + e, with M(j) = (j >> drop) << log2(E) as the kernel computes it."""
    lt, lv = T.bit_length() - 1, V.bit_length() - 1
    levels = min(lt, lv)
    E = V >> levels
    drop = lt - levels
    M = [(j >> drop) << (E.bit_length() - 1) for j in range(T)]
    part = np.random.default_rng(T * 100 + V).standard_normal((T, V))
    vals = [[part[j][s ^ M[j]] for s in range(V)] for j in range(T)]
    off = T // 2
    while len(vals[0]) > E:
        h = len(vals[0]) // 2
        vals = [[vals[j][x] + vals[j ^ off][x + h] for x in range(h)] for j in range(T)]
        off //= 2
    while off >= 1:
        vals = [[v + vals[j ^ off][x] for x, v in enumerate(vals[j])] for j in range(T)]
        off //= 2
    total = part.sum(0)
    for j in range(T):
        assert np.allclose(vals[j], total[M[j]:M[j] + E])
    assert sorted({M[j] + e for j in range(T) for e in range(E)}) == list(range(V))  # every index somewhere


@pytest.mark.parametrize("d", list(range(4, 257, 4)))
def test_lane_mapping_covers_each_chunk_once(d):
    nc = d // 4
    t, c = _choose_lanes(nc)
    seen = sorted(ci * t + j for ci in range(c) for j in range(t) if ci * t + j < nc)
    assert seen == list(range(nc))
    assert 32 % t == 0 and (c <= 3 or c == -(-nc // 32))


@given(sq=st.integers(1, 700), extra=st.integers(0, 700), d=st.sampled_from(HEAD_DIMS))
def test_causal_key_range_covers_every_visible_key(sq, extra, d):
    r, kc, ty, bq, bk, dp, bkp, smem = prefill_tiles(d, None, 4, 16)
    sk, off = sq + extra, extra
    for q0 in range(0, sq, bq):
        kend = min(off + min(q0 + bq, sq), sk)
        last_row = min(q0 + bq, sq) - 1
        assert kend == off + last_row + 1  # the last query row of the tile sees exactly keys < kend
    assert (dp // 4) % 2 == 1 and (r * bkp) % 32 in (8, 24)


def test_layout_defaults():
    lay = decode_layout(128, 4)
    assert (lay.lanes_per_row, lay.chunks_per_lane, lay.heads_per_block) == (32, 1, 4)
    assert decode_layout(80, 7).heads_per_block == 1  # 12 floats per head per lane: one head per block
    assert decode_layout(64, 16).subgroups == 2
    for d, g in ((64, 7), (128, 7), (128, 4)):  # the benchmark shapes: scatter scores, 4 rows per lane group
        lay = decode_layout(d, g)
        assert lay.scatter and lay.unroll == 4 and lay.l2_prefetch == 0 and not lay.prefetch
    assert decode_layout(128, 7, prefetch=True).unroll == 2  # register double-buffering halves the unroll
    assert not decode_layout(8, 8).scatter  # 8 heads cannot scatter over 2-lane groups: butterfly
    with pytest.raises(ValueError, match="scatter"):
        decode_layout(8, 8, scores="scatter")
    with pytest.raises(ValueError, match="power-of-two"):
        decode_layout(64, 4, unroll=3, scores="scatter")
    with pytest.raises(ValueError, match="l2_prefetch"):
        decode_layout(64, 4, l2_prefetch=-1)


# ---- emulated runs against the float64 oracle --------------------------------------------------------

@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), sq=st.integers(1, 140), extra=st.integers(0, 80),
       slack=st.integers(0, 9), causal=st.booleans(), scale=st.floats(0.1, 20), seed=st.integers(0, 2**32 - 1))
def test_flash_attention_emulated(hk, d, sq, extra, slack, causal, scale, seed):
    h, kvh = hk
    if h * sq * d > 120_000:  # keep the emulated launch small
        sq = max(1, 120_000 // (h * d))
    rng = np.random.default_rng(seed)
    sk = sq + extra
    stride = sk + slack
    q, k, v, ref = prefill_case(rng, h, kvh, d, sq, sk, slack, scale, causal)
    src = catalog.emit("flash_attention", target="sm_90", head_dim=d, group=h // kvh, causal=causal)
    mem = Memory()
    pq, pk, pv, po = mem.alloc_array(q), mem.alloc_array(k), mem.alloc_array(v), mem.alloc(q.nbytes)
    run(src.ptx, (-(-sq // src.meta["block_q"]), h), (src.meta["block"],),
        {"q": pq, "k": pk, "v": pv, "out": po, "seq_q": sq, "seq_k": sk, "q_offset": sk - sq, "kv_stride": stride},
        mem, shared_bytes=src.launch.dyn_smem)
    got = mem.read(po, np.float32, q.size).reshape(q.shape)
    assert _rel(got, ref) < RTOL


def _f16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    def ordered(x):
        bits = np.asarray(x, np.float16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), sq=st.sampled_from([1, 2, 7, 63, 64, 65, 130]), extra=st.integers(0, 80),
       slack=st.integers(0, 9), causal=st.booleans(), scale=st.floats(0.1, 20), seed=st.integers(0, 2**32 - 1))
def test_flash_attention_tokens_f16_emulated(hk, d, sq, extra, slack, causal, scale, seed):
    """The token-major f16 output ``out[i, h * D + j]`` is the f32 kernel's ``out[h, i, j]`` rounded to
    nearest (within 1 ulp) and within f16 rounding of the float64 oracle, queries continuing after
    ``extra`` cached positions (q_offset > 0) included."""
    h, kvh = hk
    if h * sq * d > 120_000:  # keep the emulated launch small
        h, kvh = 1, 1
    rng = np.random.default_rng(seed)
    sk = sq + extra
    q, k, v, ref = prefill_case(rng, h, kvh, d, sq, sk, slack, scale, causal)
    outs = {}
    for name, shape in (("flash_attention", (h, sq, d)), ("flash_attention_tokens_f16", (sq, h * d))):
        src = catalog.emit(name, target="sm_90", head_dim=d, group=h // kvh, causal=causal)
        dtype = np.float16 if name.endswith("f16") else np.float32
        mem = Memory()
        pq, pk, pv = mem.alloc_array(q), mem.alloc_array(k), mem.alloc_array(v)
        po = mem.alloc_array(np.full(shape, np.nan, dtype))
        params = {"q": pq, "k": pk, "v": pv, "out": po, "seq_q": sq, "seq_k": sk, "q_offset": extra,
                  "kv_stride": sk + slack}
        run(src.ptx, (-(-sq // src.meta["block_q"]), h), (src.meta["block"],), params, mem,
            shared_bytes=src.launch.dyn_smem)
        outs[name] = mem.read(po, dtype, q.size).reshape(shape)
    got = outs["flash_attention_tokens_f16"]
    assert np.isfinite(got).all()
    want16 = outs["flash_attention"].transpose(1, 0, 2).reshape(sq, h * d).astype(np.float16)
    assert _f16_ulps(got, want16).max() <= 1
    ref_t = ref.transpose(1, 0, 2).reshape(sq, h * d)
    err = np.abs(got.astype(np.float64) - ref_t)
    assert (err <= 2.0**-11 * np.abs(ref_t) + 2.0**-24 + RTOL * np.abs(ref_t).max()).all()


@settings(max_examples=examples(10), deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), kvh=st.integers(1, 4), count=st.integers(1, 5), pos=st.integers(0, 12),
       indirect=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_kv_append_emulated(d, kvh, count, pos, indirect, seed):
    rng = np.random.default_rng(seed)
    max_len = 10
    knew = rng.standard_normal((kvh, count, d)).astype(np.float32)
    vnew = rng.standard_normal((kvh, count, d)).astype(np.float32)
    init = rng.standard_normal((2, kvh, max_len, d)).astype(np.float32)
    src = catalog.emit("kv_append", target="sm_90", head_dim=d, indirect=indirect)
    mem = Memory()
    pk, pv = mem.alloc_array(init[0]), mem.alloc_array(init[1])
    pkn, pvn = mem.alloc_array(knew), mem.alloc_array(vnew)
    p = {"pos_ptr": mem.alloc_array(np.array([pos], np.uint32))} if indirect else {"pos": pos}
    grid = (-(-count * d // 4 // src.meta["block"]), kvh)
    run(src.ptx, grid, (src.meta["block"],), {"k_cache": pk, "v_cache": pv, "k_new": pkn, "v_new": pvn,
                                              "count": count, "max_len": max_len, **p}, mem)
    want_k, want_v = init[0].copy(), init[1].copy()
    n = max(0, min(count, max_len - pos))  # rows past max_len are dropped, never written out of bounds
    want_k[:, pos:pos + n] = knew[:, :n]
    want_v[:, pos:pos + n] = vnew[:, :n]
    assert np.array_equal(mem.read(pk, np.float32, want_k.size).reshape(want_k.shape), want_k)
    assert np.array_equal(mem.read(pv, np.float32, want_v.size).reshape(want_v.shape), want_v)


def _paged(rng, seq: np.ndarray, block_size: int, table: np.ndarray | None = None, extra_blocks: int = 2):
    """``seq [KVH, L, D]`` scattered into a pool ``[blocks, KVH, block_size, D]`` through a block table
    (default: a random one; block 0 and unused blocks hold random values): (pool, table)."""
    kvh, length, d = seq.shape
    n = -(-length // block_size)
    if table is None:
        table = rng.permutation(np.arange(1, n + 1 + extra_blocks))[:n].astype(np.uint32)
    pool = rng.standard_normal((n + 1 + extra_blocks, kvh, block_size, d)).astype(np.float32)
    padded = np.zeros((kvh, n * block_size, d), np.float32)
    padded[:, :length] = seq
    pool[table] = padded.reshape(kvh, n, block_size, d).transpose(1, 0, 2, 3)
    return pool, table


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=heads, d=st.sampled_from(HEAD_DIMS), bs=st.sampled_from([16, 32, 64]), sq=st.integers(1, 100),
       extra=st.integers(0, 80), causal=st.booleans(), scale=st.floats(0.1, 20), seed=st.integers(0, 2**32 - 1))
def test_flash_attention_paged_emulated(hk, d, bs, sq, extra, causal, scale, seed):
    """K/V read through a shuffled block table: the same attention as the float64 oracle."""
    h, kvh = hk
    if h * sq * d > 120_000:  # keep the emulated launch small
        sq = max(1, 120_000 // (h * d))
    rng = np.random.default_rng(seed)
    sk = sq + extra
    q, k, v, ref = prefill_case(rng, h, kvh, d, sq, sk, 0, scale, causal)
    kpool, table = _paged(rng, k, bs)
    vpool, _ = _paged(rng, v, bs, table)
    src = catalog.emit("flash_attention", target="sm_90", head_dim=d, group=h // kvh, causal=causal, block_size=bs)
    mem = Memory()
    po = mem.alloc_array(np.full(q.shape, np.nan, np.float32))
    run(src.ptx, (-(-sq // src.meta["block_q"]), h), (src.meta["block"],),
        {"q": mem.alloc_array(q), "k": mem.alloc_array(kpool), "v": mem.alloc_array(vpool), "out": po,
         "seq_q": sq, "seq_k": sk, "q_offset": extra, "n_kv": kvh, "block_table": mem.alloc_array(table)},
        mem, shared_bytes=src.launch.dyn_smem)
    assert _rel(mem.read(po, np.float32, q.size).reshape(q.shape), ref) < RTOL


@settings(max_examples=examples(10), deadline=None)
@given(d=st.sampled_from(HEAD_DIMS), kvh=st.integers(1, 4), bs=st.sampled_from([16, 32, 64]), count=st.integers(1, 40),
       pos=st.integers(0, 100), indirect=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_kv_append_paged_emulated(d, kvh, bs, count, pos, indirect, seed):
    """Rows pos .. pos + count - 1 land in block table[row // bs], row % bs; rows whose block is past the
    table's entries and every other pool row are untouched."""
    rng = np.random.default_rng(seed)
    stride = 3  # table entries: positions past 3 * bs are dropped
    table = rng.permutation(np.arange(1, 6))[:stride].astype(np.uint32)
    pools = rng.standard_normal((2, 6, kvh, bs, d)).astype(np.float32)
    new = rng.standard_normal((2, kvh, count, d)).astype(np.float32)
    src = catalog.emit("kv_append", target="sm_90", head_dim=d, indirect=indirect, block_size=bs)
    mem = Memory()
    pk, pv = mem.alloc_array(pools[0]), mem.alloc_array(pools[1])
    p = {"pos_ptr": mem.alloc_array(np.array([pos], np.uint32))} if indirect else {"pos": pos}
    grid = (-(-count * d // 4 // src.meta["block"]), kvh)
    run(src.ptx, grid, (src.meta["block"],), {"k_pool": pk, "v_pool": pv, "k_new": mem.alloc_array(new[0]),
                                              "v_new": mem.alloc_array(new[1]), "count": count,
                                              "block_table": mem.alloc_array(table), "table_stride": stride,
                                              "n_kv": kvh, **p}, mem)
    want = pools.copy()
    for r in range(count):
        row = pos + r
        if row // bs < stride:
            want[:, table[row // bs], :, row % bs] = new[:, :, r]
    assert np.array_equal(mem.read(pk, np.float32, want[0].size).reshape(want[0].shape), want[0])
    assert np.array_equal(mem.read(pv, np.float32, want[1].size).reshape(want[1].shape), want[1])


def test_emulator_catches_a_missing_barrier():
    src = catalog.emit("flash_attention", target="sm_90", head_dim=32, group=1, causal=True)
    lines = src.ptx.splitlines()
    first_bar = next(i for i, line in enumerate(lines) if "bar.sync" in line)
    broken = "\n".join(line for i, line in enumerate(lines) if i != first_bar)
    mem = Memory()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 40, 32)).astype(np.float32)
    ptrs = [mem.alloc_array(x) for _ in range(3)]
    with pytest.raises(EmulatorError, match="race"):
        run(broken, (1, 1), (src.meta["block"],), {"q": ptrs[0], "k": ptrs[1], "v": ptrs[2], "out": mem.alloc(x.nbytes),
                                                   "seq_q": 40, "seq_k": 40, "q_offset": 0, "kv_stride": 40},
            mem, shared_bytes=src.launch.dyn_smem)


# ---- the executor: validation without a GPU, then end to end on the emulator --------------------------

@pytest.mark.parametrize("args, match", [
    ((2, 6, 4, 64, 128), "multiple of num_kv_heads"),
    ((2, 8, 0, 64, 128), "num_kv_heads"),
    ((0, 8, 2, 64, 128), "num_layers"),
    ((2, 8, 2, 60, 128), "head_dim"),
    ((2, 8, 2, 512, 128), "head_dim"),
    ((2, 8, 2, 64, 0), "max_len"),
    ((2, 8, 2, 64, 1.5), "max_len"),
    ((2, True, 2, 64, 16), "num_heads"),
])
def test_constructor_validates_before_touching_the_gpu(args, match):
    with pytest.raises(ShapeError, match=match):
        CudaExecutor(*args)
    with pytest.raises(ShapeError, match=match):
        AttentionConfig(*args)


@pytest.mark.skipif(cuda.is_available(), reason="checks the no-GPU path")
def test_valid_config_without_gpu_reports_no_gpu():
    with pytest.raises(cuda.CudaUnavailableError):
        CudaExecutor(2, 8, 2, 64, 128)


@pytest.fixture
def emu():
    """An emulated device: the executor's real kernels and argument packing run on the CPU."""
    return cuda.EmulatedDevice()


def _buffer(dev, count, dtype=np.float32):
    return cuda.GpuBuffer(count, dtype, device=dev)


def _caches(ex: CudaExecutor, layer: int):
    return ex.cache_to_numpy(layer)


def test_executor_decode_prefill_and_bookkeeping(emu):
    rng = np.random.default_rng(3)
    h, kvh, d, max_len = 6, 2, 48, 40
    ex = CudaExecutor(3, h, kvh, d, max_len, num_chunks=4, device=emu)
    # prefill 13 tokens on layer 1, then decode 5 more with flash_attention_cached
    s = 13
    q = rng.standard_normal((h, s, d)).astype(np.float32) * 4
    k = rng.standard_normal((kvh, s, d)).astype(np.float32)
    v = rng.standard_normal((kvh, s, d)).astype(np.float32)
    y = ex.prefill(1, q, k, v)
    assert ex.lengths == (0, s, 0)
    assert _rel(y, gqa_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), True)) < RTOL
    ks, vs = [k], [v]
    for step in range(5):
        qt = (rng.standard_normal((h, d)) * 4).astype(np.float32)
        kt, vt = rng.standard_normal((2, kvh, d)).astype(np.float32)
        out = np.full((h, d), np.nan, np.float32)
        n = ex.flash_attention_cached(1, qt, kt, vt, out)
        assert n == s + step + 1 == ex.lengths[1]
        kall, vall = np.concatenate(ks, 1), np.concatenate(vs, 1)
        ref = attention_with_cache_gqa(qt.astype(np.float64), kall.astype(np.float64), vall.astype(np.float64),
                                       kt.astype(np.float64), vt.astype(np.float64))
        assert _rel(out, ref) < RTOL
        assert _rel(ex.incremental_attention_gpu(1, qt), ref) < RTOL
        ks.append(kt[:, None])
        vs.append(vt[:, None])
    kc, vc = _caches(ex, 1)
    assert np.array_equal(kc, np.concatenate(ks, 1)) and np.array_equal(vc, np.concatenate(vs, 1))
    # attend over a prefix, truncate, reset
    qt = rng.standard_normal((h, d)).astype(np.float32)
    pref = attention_with_cache_gqa(qt.astype(np.float64), kc[:, :9].astype(np.float64), vc[:, :9].astype(np.float64),
                                    kc[:, 9].astype(np.float64), vc[:, 9].astype(np.float64))
    assert _rel(ex.incremental_attention_gpu(1, qt, seq_len=10), pref) < RTOL
    ex.truncate(1, 10)
    assert ex.lengths[1] == 10
    ex.truncate(None, 0)
    assert ex.lengths == (0, 0, 0)
    ex.set_length(2, 7)
    ex.reset()
    assert ex.lengths == (0, 0, 0)


def test_executor_device_resident_flash_decoding(emu):
    rng = np.random.default_rng(4)
    h, kvh, d, max_len = 8, 2, 64, 64
    ex = CudaExecutor(1, h, kvh, d, max_len, num_chunks=3, min_chunk=4, block_size=16, device=emu)
    assert ex.decode_launches == 1
    def G(count, dtype=np.float32):
        return _buffer(emu, count, dtype)

    pos = G(2, np.uint32)  # [position, seq_len] as a graph's step values would hold them
    qb, ob, kb, vb = G(h * d), G(h * d), G(kvh * d), G(kvh * d)
    kall = np.zeros((kvh, 0, d), np.float32)
    vall = np.zeros((kvh, 0, d), np.float32)
    for t in range(20):
        qt = (rng.standard_normal((h, d)) * 5).astype(np.float32)
        kt, vt = rng.standard_normal((2, kvh, d)).astype(np.float32)
        pos.copy_from_host(np.array([t, t + 1], np.uint32))
        qb.copy_from_host(qt.reshape(-1))
        kb.copy_from_host(kt.reshape(-1))
        vb.copy_from_host(vt.reshape(-1))
        ob.poison()
        n_launch = len(emu.launches)
        ex.append_kv(0, kb, vb, position=(pos, 0))
        ex.flash_decoding(0, qb, ob, seq_len=(pos, 1))
        assert len(emu.launches) == n_launch + 1 + ex.decode_launches
        ref = attention_with_cache_gqa(qt.astype(np.float64), kall.astype(np.float64), vall.astype(np.float64),
                                       kt.astype(np.float64), vt.astype(np.float64))
        assert _rel(ob.to_numpy((h, d)), ref) < RTOL
        kall = np.concatenate([kall, kt[:, None]], 1)
        vall = np.concatenate([vall, vt[:, None]], 1)
    # fixed launch shapes and cached argument packs: a graph of these launches never changes
    shapes = {(name, grid, block) for name, grid, block, _, _ in emu.launches[-20 * (1 + ex.decode_launches):]}
    assert len(shapes) == 1 + ex.decode_launches
    assert ex.lengths == (0,)  # device-positioned appends do not touch the host length
    ex.set_length(0, 20)
    out = np.empty((h, d), np.float32)
    ex.flash_attention_cached(0, qt, kt, vt, out)
    assert ex.lengths == (21,)


def test_executor_flash_decoding_graphed(emu):
    """The first call of a set of operands captures a graph, the next ones replay it with the length read
    from the device: every replay matches the oracle, one graph per operands."""
    rng = np.random.default_rng(5)
    h, kvh, d, max_len = 4, 2, 64, 96
    ex = CudaExecutor(1, h, kvh, d, max_len, block_size=16, device=emu)
    k, v = rng.standard_normal((2, kvh, max_len, d)).astype(np.float32)
    ex.append_kv(0, k, v)
    qb, ob, lb = _buffer(emu, h * d), _buffer(emu, h * d), _buffer(emu, 1, np.uint32)
    stream = cuda.Stream(emu)
    for length in (1, 17, 50, 96):
        qt = (rng.standard_normal((h, d)) * 4).astype(np.float32)
        qb.copy_from_host(qt.reshape(-1))
        lb.copy_from_host(np.array([length], np.uint32))
        ob.poison()
        ex.flash_decoding_graphed(0, qb, ob, lb, stream=stream)
        stream.synchronize()
        ref = attention_with_cache_gqa(qt.astype(np.float64), k[:, :length - 1].astype(np.float64),
                                       v[:, :length - 1].astype(np.float64), k[:, length - 1].astype(np.float64),
                                       v[:, length - 1].astype(np.float64))
        assert _rel(ob.to_numpy((h, d)), ref) < RTOL
    graphs = ex._graphs[id(stream)][1]
    assert len(graphs) == 1
    ex.flash_decoding_graphed(0, qb, _buffer(emu, h * d), lb, stream=stream)  # new operands: a second graph
    assert len(graphs) == 2


def test_executor_argument_errors(emu):
    ex = CudaExecutor(2, 4, 2, 32, 8, num_chunks=2, device=emu)
    q = np.zeros((4, 32), np.float32)
    kv = np.zeros((2, 32), np.float32)
    out = np.empty((4, 32), np.float32)
    with pytest.raises(ShapeError, match=r"layer must be an integer in \[0, 2\)"):
        ex.flash_attention_cached(2, q, kv, kv, out)
    with pytest.raises(ShapeError, match=r"q must have shape \(4, 32\)"):
        ex.flash_attention_cached(0, np.zeros((4, 16), np.float32), kv, kv, out)
    with pytest.raises(ShapeError, match="k must have shape"):
        ex.flash_attention_cached(0, q, np.zeros((4, 32), np.float32), kv, out)
    with pytest.raises(ShapeError, match="out must be"):
        ex.flash_attention_cached(0, q, kv, kv, np.empty((4, 32), np.float64))
    with pytest.raises(CacheStateError, match="uninitialised"):
        ex.incremental_attention_gpu(1, q)
    for _ in range(8):
        ex.flash_attention_cached(0, q, kv, kv, out)
    with pytest.raises(ContextOverflowError, match="max_len 8"):
        ex.flash_attention_cached(0, q, kv, kv, out)
    with pytest.raises(ContextOverflowError, match="max_len is 8"):
        ex.prefill(1, np.zeros((4, 9, 32)), np.zeros((2, 9, 32)), np.zeros((2, 9, 32)))
    with pytest.raises(ShapeError, match="seq_len >= 3"):
        ex.flash_attention_multi_head(np.zeros((4, 3, 32)), np.zeros((2, 2, 32)), np.zeros((2, 2, 32)))
    with pytest.raises(CacheStateError, match="holds only 8"):
        ex.truncate(0, 9)
    with pytest.raises(CacheStateError, match="hole"):
        ex.append_kv(1, kv, kv, position=3)
    with pytest.raises(CacheStateError, match="holds 8 positions, asked to attend over 9"):
        ex.incremental_attention_gpu(0, q, seq_len=9)
    qb, ob = _buffer(emu, 4 * 32), _buffer(emu, 4 * 31)
    with pytest.raises(ShapeError, match="out needs 128 elements"):
        ex.flash_decoding(0, qb, ob, seq_len=3)
    with pytest.raises(ShapeError, match="seq_len must hold uint32"):
        ex.flash_decoding(0, qb, _buffer(emu, 128), seq_len=_buffer(emu, 1))
    with pytest.raises(ShapeError, match="16-byte aligned"):
        ex.flash_decoding(0, (_buffer(emu, 130), 1), _buffer(emu, 128), seq_len=3)
    with pytest.raises(ShapeError, match="GpuBuffer"):
        ex.flash_decoding(0, q, ob, seq_len=3)
    assert ex.lengths == (8, 0)  # failed calls changed nothing


def test_executor_multi_head_matches_oracle(emu):
    rng = np.random.default_rng(9)
    ex = CudaExecutor(1, 4, 1, 80, 16, device=emu)
    for causal in (True, False):
        q = rng.standard_normal((4, 21, 80)).astype(np.float32) * 3
        k = rng.standard_normal((1, 30, 80)).astype(np.float32)
        v = rng.standard_normal((1, 30, 80)).astype(np.float32)
        y = ex.flash_attention_multi_head(q, k, v, causal=causal)
        ref = gqa_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=causal)
        assert _rel(y, ref) < RTOL


@pytest.mark.full
def test_sanitize_cases_and_benchmark_run_on_the_emulator(monkeypatch):
    """The device scripts' control flow (argument packing, graph capture, table rows) on the CPU."""
    import tools.bench_attention as bench
    import tools.sanitize_attention as sanitize

    import realizar.cuda.emulated as emulated

    dev = cuda.EmulatedDevice(sm_count=4)  # few chunks: a small emulated grid
    monkeypatch.setattr(emulated, "_default", dev)
    monkeypatch.setenv("REALIZAR_DEVICE", "emulate")  # the tools allocate on cuda.current_device()
    monkeypatch.setattr(bench, "call", lambda *args: None)

    class NoTorch:
        torch = None

        def time(self, *args, **kwargs):
            return None

    sanitize.cases(cuda.module_cache(), np.random.default_rng(0), small=True)
    rows = bench.bench_decode(dev, cuda.Stream(dev), 1e6, 1, NoTorch(), [40], [(4, 2, 64)], calls=2)
    assert len(rows) == 3 and rows[-1].startswith("| 4/2/64 | 40 |")
    rows = bench.bench_tuning(dev, cuda.Stream(dev), 1e6, 1, [(4, 2, 64)], [33], calls=1)
    assert len(rows) == 2 + len(bench.TUNE_VARIANTS) and "**best**" in "".join(rows)
    rows = bench.bench_prefill(dev, cuda.Stream(dev), 1, NoTorch(), [(2, 1, 32)], [20])
    assert len(rows) == 3 and rows[-1].startswith("| 2/1/32 | 20 |")
