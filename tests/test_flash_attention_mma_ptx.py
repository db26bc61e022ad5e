"""CPU tests of the tensor-core prefill attention ``flash_attention_mma``: ptxas without spills for every
head size, the emulated kernel against the float64 oracle over hypothesis shapes (GQA groups, causal or
not, queries continuing after cached positions, a KV row stride past seq_k), NaN-poisoned outputs, and
the emulator's ``ldmatrix.trans``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.builder import Module
from ptx_gen.emulator import Memory, run
from ptx_gen.kernels.attention.flash_attention_mma import HEAD_DIMS
from tests.attention_cases import prefill_case
from tests.layer_kernels_ptx_cases import _assemble_all
from tests.helpers import examples


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_assembles_without_spills(d):
    _assemble_all("flash_attention_mma", head_dim=d, group=4, causal=True)


def test_refuses_other_head_sizes():
    for d in (8, 40, 256):
        with pytest.raises(ValueError, match="head_dim"):
            catalog.emit("flash_attention_mma", head_dim=d)


def _run(q, k, v, sq, sk, q_offset, stride, causal, group):
    h, d = q.shape[0], q.shape[2]
    src = catalog.emit("flash_attention_mma", target="sm_90", head_dim=d, group=group, causal=causal)
    mem = Memory()
    pq, pk, pv = mem.alloc_array(q), mem.alloc_array(k), mem.alloc_array(v)
    po = mem.alloc_array(np.full((sq, h * d), np.nan, np.float16))
    params = {"q": pq, "k": pk, "v": pv, "out": po, "seq_q": sq, "seq_k": sk, "q_offset": q_offset,
              "kv_stride": stride, "num_heads": h}
    run(src.ptx, (-(-sq // src.meta["block_q"]), h), (src.meta["block"],), params, mem,
        shared_bytes=src.launch.dyn_smem)
    return mem.read(po, np.float16, sq * h * d).reshape(sq, h, d).transpose(1, 0, 2).astype(np.float64)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hk=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]), d=st.sampled_from(HEAD_DIMS),
       sq=st.sampled_from([1, 2, 7, 63, 64, 65, 130]), extra=st.integers(0, 80), slack=st.integers(0, 9),
       causal=st.booleans(), scale=st.floats(0.1, 8), seed=st.integers(0, 2**32 - 1))
def test_matches_oracle(hk, d, sq, extra, slack, causal, scale, seed):
    h, kvh = hk
    if h * sq * d > 60_000:  # keep the emulated launch small
        h, kvh = 1, 1
    rng = np.random.default_rng(seed)
    sk = sq + extra
    q, k, v, ref = prefill_case(rng, h, kvh, d, sq, sk, slack, scale, causal)
    got = _run(q, k, v, sq, sk, extra, sk + slack, causal, h // kvh)
    assert np.isfinite(got).all(), "unwritten (NaN-poisoned) outputs"
    # f16 operands (Q, K, V, P) with f32 accumulation: error ~ 2^-11 of the values' scale
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err < 4e-3, f"relative error {err:.2e}"


def test_long_causal_prefill_after_cached_tokens():
    rng = np.random.default_rng(1)
    q, k, v, ref = prefill_case(rng, 2, 1, 64, 150, 150 + 70, 3, 2.0, True)
    got = _run(q, k, v, 150, 220, 70, 223, True, 2)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 4e-3


def test_emulated_ldmatrix_trans():
    m = Module("sm_90")
    kern = m.kernel("t", [("src", "u64"), ("dst", "u64")])
    lane = kern.and_(kern.tid(), 31)
    buf = kern.shared_array("t_buf", "u8", 512)
    kern.store("shared", "b32", kern.add(buf, kern.shl(lane, 4)),
               list(kern.load("global", "b32", kern.add(kern.global_ptr("src"), kern.cvt(kern.shl(lane, 4), "u64")), vec=4)))
    kern.bar_sync()
    regs = kern.ldmatrix_x4(kern.add(buf, kern.shl(lane, 4)), trans=True)
    for i, r in enumerate(regs):
        kern.store("global", "b32", kern.add(kern.global_ptr("dst"), kern.cvt(kern.shl(kern.add(lane, 32 * i), 2), "u64")), r)
    kern.ret()
    mats = np.arange(4 * 64, dtype=np.uint16).reshape(4, 8, 8)  # matrix j, row r, column c
    mem = Memory()
    src, dst = mem.alloc_array(mats.reshape(-1)), mem.alloc(4 * 32 * 4)
    run(m.emit(), grid=(1,), block=(32,), params=dict(src=src, dst=dst), memory=mem)
    got = mem.read(dst, np.uint16, 4 * 32 * 2).reshape(4, 32, 2)
    lane_ids = np.arange(32)
    for j in range(4):
        np.testing.assert_array_equal(got[j, :, 0], mats[j, 2 * (lane_ids % 4), lane_ids // 4])
        np.testing.assert_array_equal(got[j, :, 1], mats[j, 2 * (lane_ids % 4) + 1, lane_ids // 4])
