"""CudaExecutor on the GPU: decode and prefill against the float64 oracle, device-resident flash
decoding captured in a CUDA graph and replayed with the position from a device buffer, bookkeeping
and typed errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar import cuda
from realizar.errors import CacheStateError, ContextOverflowError, ShapeError
from realizar.gpu.executor import CudaExecutor
from realizar.models.attention import attention_with_cache_gqa, gqa_attention
from tests.helpers import assert_close, examples

pytestmark = pytest.mark.gpu

RTOL = 1e-5


def _decode_ref(q, kall, vall, k, v):
    return attention_with_cache_gqa(q.astype(np.float64), kall.astype(np.float64), vall.astype(np.float64),
                                    k.astype(np.float64), v.astype(np.float64))


@settings(max_examples=examples(12), deadline=None)
@given(shape=st.sampled_from([(14, 2, 64), (9, 3, 64), (28, 4, 128), (32, 8, 128), (8, 8, 80), (6, 1, 256),
                              (12, 4, 48), (4, 2, 96), (16, 16, 32)]),
       prefill_len=st.integers(1, 300), steps=st.integers(1, 6), scale=st.floats(0.1, 30.0),
       seed=st.integers(0, 2**32 - 1))
def test_prefill_then_decode_matches_oracle(device, shape, prefill_len, steps, scale, seed):
    h, kvh, d = shape
    rng = np.random.default_rng(seed)
    max_len = prefill_len + steps + int(rng.integers(0, 50))
    with CudaExecutor(2, h, kvh, d, max_len, device) as ex:
        q = (rng.standard_normal((h, prefill_len, d)) * scale).astype(np.float32)
        k = rng.standard_normal((kvh, prefill_len, d)).astype(np.float32)
        v = rng.standard_normal((kvh, prefill_len, d)).astype(np.float32)
        y = ex.prefill(1, q, k, v)
        assert_close(y, gqa_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), True),
                     RTOL, "prefill")
        assert ex.lengths == (0, prefill_len)
        kall, vall = k, v
        out = np.full((h, d), np.nan, np.float32)
        for step in range(steps):
            qt = (rng.standard_normal((h, d)) * scale).astype(np.float32)
            kt, vt = rng.standard_normal((2, kvh, d)).astype(np.float32)
            n = ex.flash_attention_cached(1, qt, kt, vt, out)
            assert n == prefill_len + step + 1
            ref = _decode_ref(qt, kall, vall, kt, vt)
            assert_close(out, ref, RTOL, f"decode step {step}")
            assert_close(ex.incremental_attention_gpu(1, qt), ref, RTOL, "incremental")
            kall = np.concatenate([kall, kt[:, None]], 1)
            vall = np.concatenate([vall, vt[:, None]], 1)
        kc, vc = ex.cache_to_numpy(1)
        assert np.array_equal(kc, kall) and np.array_equal(vc, vall)
        # stateless multi-head attention over the whole sequence agrees with the cache contents
        qs = rng.standard_normal((h, min(5, kall.shape[1]), d)).astype(np.float32)
        full = ex.flash_attention_multi_head(qs, kall, vall, causal=True)
        assert_close(full, gqa_attention(qs.astype(np.float64), kall.astype(np.float64), vall.astype(np.float64), True),
                     RTOL, "multi-head")


@pytest.mark.parametrize("block_size", [16, 64])
def test_graph_captured_decode_replays_with_device_position(device, block_size):
    h, kvh, d, max_len = 28, 4, 128, 4096
    rng = np.random.default_rng(0)
    stream = cuda.Stream()
    with CudaExecutor(1, h, kvh, d, max_len, device, block_size=block_size) as ex:
        prompt = 700
        k0 = rng.standard_normal((kvh, prompt, d)).astype(np.float32)
        v0 = rng.standard_normal((kvh, prompt, d)).astype(np.float32)
        ex.append_kv(0, k0, v0)
        step = cuda.StepValues(("pos", "seq_len"))
        qb, ob, kb, vb = cuda.GpuBuffer(h * d), cuda.GpuBuffer(h * d), cuda.GpuBuffer(kvh * d), cuda.GpuBuffer(kvh * d)
        with cuda.capture(stream) as cap:
            ex.append_kv(0, kb, vb, position=(step.device, step.index("pos")), stream=stream)
            ex.flash_decoding(0, qb, ob, seq_len=(step.device, step.index("seq_len")), stream=stream)
        exe = cap.graph.instantiate()
        assert cap.graph.num_kernels == 1 + ex.decode_launches == 2
        kall, vall = k0, v0
        for t in range(prompt, prompt + 12):
            qt = (rng.standard_normal((h, d)) * 6).astype(np.float32)
            kt, vt = rng.standard_normal((2, kvh, d)).astype(np.float32)
            qb.copy_from_host(qt.reshape(-1))
            kb.copy_from_host(kt.reshape(-1))
            vb.copy_from_host(vt.reshape(-1))
            ob.poison()
            step.set(pos=t, seq_len=t + 1)
            exe.replay(stream, step)
            stream.synchronize()
            assert_close(ob.to_numpy((h, d)), _decode_ref(qt, kall, vall, kt, vt), RTOL, f"replay at {t}")
            kall = np.concatenate([kall, kt[:, None]], 1)
            vall = np.concatenate([vall, vt[:, None]], 1)
        assert ex.lengths == (prompt,)  # device-side appends: the host learns the length from the caller
        ex.set_length(0, prompt + 12)
        kc, _ = ex.cache_to_numpy(0)
        assert np.array_equal(kc, kall)
        for b in (qb, ob, kb, vb):
            b.free()
        step.free()


def test_flash_decoding_graphed_replays_one_graph_per_operands(device):
    """flash_decoding_graphed: the first call captures, later calls with the same operands replay the graph
    with the length read from the device; split-KV and one-pass agree with the oracle at every length."""
    h, kvh, d, max_len = 32, 8, 128, 2048
    rng = np.random.default_rng(3)
    stream = cuda.Stream()
    with CudaExecutor(1, h, kvh, d, max_len, device) as ex:
        k = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
        v = rng.standard_normal((kvh, max_len, d)).astype(np.float32)
        ex.append_kv(0, k, v)
        qb, ob, lb = cuda.GpuBuffer(h * d), cuda.GpuBuffer(h * d), cuda.GpuBuffer(1, np.uint32)
        for length in (1, 31, 700, 2048):
            qt = (rng.standard_normal((h, d)) * 4).astype(np.float32)
            qb.copy_from_host(qt.reshape(-1))
            lb.copy_from_host(np.array([length], np.uint32))
            ob.poison()
            ex.flash_decoding_graphed(0, qb, ob, lb, stream=stream)
            stream.synchronize()
            ref = _decode_ref(qt, k[:, :length - 1], v[:, :length - 1], k[:, length - 1], v[:, length - 1])
            assert_close(ob.to_numpy((h, d)), ref, RTOL, f"graphed L={length}")
            assert_close(ex.incremental_attention_gpu(0, qt, seq_len=length), ref, RTOL, f"one-pass L={length}")
        graphs = ex._graphs[id(stream)][1]
        assert len(graphs) == 1  # one set of operands: one graph, replayed
        for b in (qb, ob, lb):
            b.free()


def test_flash_decoding_at_long_context(device):
    h, kvh, d = 32, 8, 128
    length = 32768
    rng = np.random.default_rng(1)
    with CudaExecutor(1, h, kvh, d, length, device) as ex:
        k = rng.standard_normal((kvh, length - 1, d)).astype(np.float32)
        v = rng.standard_normal((kvh, length - 1, d)).astype(np.float32)
        ex.append_kv(0, k, v)
        qt = (rng.standard_normal((h, d)) * 5).astype(np.float32)
        kt, vt = rng.standard_normal((2, kvh, d)).astype(np.float32)
        out = np.empty((h, d), np.float32)
        assert ex.flash_attention_cached(0, qt, kt, vt, out) == length
        assert_close(out, _decode_ref(qt, k, v, kt, vt), RTOL, "L=32768")
        with pytest.raises(ContextOverflowError, match="max_len 32768"):
            ex.flash_attention_cached(0, qt, kt, vt, out)


def test_truncate_reset_and_errors(device):
    h, kvh, d = 8, 2, 64
    rng = np.random.default_rng(2)
    with CudaExecutor(3, h, kvh, d, 64, device) as ex:
        q = rng.standard_normal((h, d)).astype(np.float32)
        kv = rng.standard_normal((2, kvh, d)).astype(np.float32)
        out = np.empty((h, d), np.float32)
        with pytest.raises(CacheStateError, match="uninitialised"):
            ex.incremental_attention_gpu(0, q)
        for _ in range(10):
            ex.flash_attention_cached(0, q, kv[0], kv[1], out)
        ex.truncate(0, 4)
        assert ex.lengths == (4, 0, 0)
        ex.flash_attention_cached(0, q, kv[0], kv[1], out)
        assert ex.lengths[0] == 5
        with pytest.raises(ShapeError, match="layer"):
            ex.flash_attention_cached(3, q, kv[0], kv[1], out)
        with pytest.raises(ShapeError, match=r"q must have shape \(8, 64\)"):
            ex.flash_attention_cached(0, q[:4], kv[0], kv[1], out)
        with pytest.raises(ContextOverflowError):
            ex.prefill(1, np.zeros((h, 65, d)), np.zeros((kvh, 65, d)), np.zeros((kvh, 65, d)))
        with pytest.raises(ShapeError, match="seq_len must hold uint32"):
            with cuda.GpuBuffer(h * d) as qb, cuda.GpuBuffer(h * d) as ob, cuda.GpuBuffer(1) as bad:
                ex.flash_decoding(0, qb, ob, seq_len=bad)
        ex.reset()
        assert ex.lengths == (0, 0, 0)
    with pytest.raises(ShapeError, match="multiple of num_kv_heads"):
        CudaExecutor(1, 6, 4, 64, 16, device)
