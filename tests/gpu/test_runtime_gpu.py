"""GPU tests of the foundation: demo kernels vs NumPy, JIT errors, buffer offsets, async copies, events."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.catalog import PtxKernel, emit
from realizar import cuda
from realizar.errors import ShapeError
from tests.helpers import examples, random_array

pytestmark = pytest.mark.gpu


def _blocks(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))


@settings(max_examples=examples(30), deadline=None)
@given(n=st.integers(1, 70_000), vec=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**32 - 1))
def test_vector_add_matches_numpy(kernels, n, vec, seed):
    rng = np.random.default_rng(seed)
    a, b = random_array(rng, n), random_array(rng, n, scale=3.0)
    k = kernels.get("vector_add", vec=vec)
    block = k.meta["block"]
    with cuda.GpuBuffer.from_numpy(a) as da, cuda.GpuBuffer.from_numpy(b) as db, cuda.GpuBuffer(n) as out:
        out.poison()
        cuda.launch(k, _blocks(n, block * vec), block, k.args(da, db, out, n))
        got = out.to_numpy()
    np.testing.assert_array_equal(got, a + b)  # one float32 add: exact


@settings(max_examples=examples(30), deadline=None)
@given(n=st.integers(1, 50_000), vec=st.sampled_from([1, 4]), alpha=st.floats(-4, 4).filter(lambda x: abs(x) > 1e-3),
       seed=st.integers(0, 2**32 - 1))
def test_axpy_matches_float64_oracle(kernels, n, vec, alpha, seed):
    rng = np.random.default_rng(seed)
    x, y = random_array(rng, n), random_array(rng, n)
    k = kernels.get("axpy", vec=vec)
    with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer.from_numpy(y) as dy:
        cuda.launch(k, _blocks(n, k.meta["block"] * vec), k.meta["block"], k.args(dx, dy, alpha, n))
        got = dy.to_numpy()
    expected = np.float32(alpha) * x.astype(np.float64) + y.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@settings(max_examples=examples(25), deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 5000), block=st.sampled_from([32, 128, 256, 1024]),
       seed=st.integers(0, 2**32 - 1))
def test_row_sum_matches_float64_oracle(kernels, rows, cols, block, seed):
    rng = np.random.default_rng(seed)
    x = random_array(rng, (rows, cols))
    k = kernels.get("row_sum", block=block)
    with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer(rows) as out:
        out.poison()
        cuda.launch(k, rows, block, k.args(dx, out, cols))
        got = out.to_numpy()
    expected = x.astype(np.float64).sum(axis=1)
    tol = 1e-6 * np.sqrt(cols) * np.abs(x).max(axis=1) + 1e-6
    assert np.all(np.isfinite(got))
    assert np.all(np.abs(got - expected) <= tol), np.max(np.abs(got - expected) - tol)


def test_kernels_compile_once_per_shape(device):
    cache = cuda.ModuleCache(device)
    k1 = cache.get("vector_add", vec=2)
    k2 = cache.get("vector_add", vec=2)
    k3 = cache.get("vector_add", vec=4)
    assert k1 is k2 and k3 is not k1 and cache.loads == 2


def test_broken_ptx_raises_with_jit_log(device):
    good = emit("vector_add", target=device.target.sm, vec=1)
    broken_text = good.ptx.replace("add.f32", "add.f99", 1)
    broken = PtxKernel("broken_add", good.entry, good.target, (("case", 1),), broken_text, good.params, good.launch)
    with pytest.raises(cuda.JitError) as info:
        cuda.ModuleCache(device).load(broken)
    err = info.value
    assert "f99" in err.log or "syntax" in err.log.lower() or "error" in err.log.lower(), err.log
    assert err.ptx_path.read_text() == broken_text
    assert "cuModuleLoadDataEx" in str(err) and err.name.startswith("CUDA_ERROR")


def test_buffer_offsets_and_async_copies(device):
    rng = np.random.default_rng(7)
    host = random_array(rng, 1000)
    stream = cuda.Stream()
    with cuda.GpuBuffer(1000) as buf:
        buf.poison()
        buf.copy_from_host_at(host[:400], 0)
        buf.copy_from_host_at(host[400:], 400, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(buf.copy_to_host_at(250, 500), host[250:750])
        out = np.full(1000, np.nan, np.float32)
        buf.copy_to_host(out, stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(out, host)
        with cuda.GpuBuffer(300) as other:
            other.copy_from(buf, count=300, src_offset=600)
            np.testing.assert_array_equal(other.to_numpy(), host[600:900])
        with pytest.raises(ShapeError, match="do not fit"):
            buf.copy_from_host_at(host, 1)  # does not fit
    with pytest.raises(cuda.BufferFreedError):
        _ = buf.ptr


def test_events_time_a_kernel(kernels):
    n = 1 << 24
    k = kernels.get("vector_add", vec=4)
    stream = cuda.Stream()
    start, end = cuda.Event(), cuda.Event()
    with cuda.GpuBuffer(n) as a, cuda.GpuBuffer(n) as b, cuda.GpuBuffer(n) as out:
        a.fill_bytes(0x3F)
        b.fill_bytes(0x3F)
        args = k.args(a, b, out, n)
        start.record(stream)
        for _ in range(5):
            cuda.launch(k, _blocks(n, 1024), 256, args, stream=stream)
        end.record(stream)
        end.synchronize()
        ms = start.elapsed_ms(end)
    assert 0 < ms < 1000


def test_launch_errors_are_typed(kernels):
    k = kernels.get("vector_add", vec=1)
    with cuda.GpuBuffer(4) as a:
        with pytest.raises(ShapeError, match="1024"):
            cuda.launch(k, 1, 2048, k.args(a, a, a, 4))
        with pytest.raises(ShapeError, match="missing kernel arguments"):
            k.args(a, a)


def test_disk_cubin_cache_skips_the_jit(device, tmp_path):
    first = cuda.ModuleCache(device, disk_dir=tmp_path)
    k = first.get("row_sum", block=64)
    files = list(tmp_path.glob("row_sum-*.cubin"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    second = cuda.ModuleCache(device, disk_dir=tmp_path)
    k2 = second.get("row_sum", block=64)
    x = np.arange(1, 65, dtype=np.float32).reshape(1, 64)
    for kernel in (k, k2):
        with cuda.GpuBuffer.from_numpy(x) as dx, cuda.GpuBuffer(1) as out:
            out.poison()
            cuda.launch(kernel, 1, 64, kernel.args(dx, out, 64))
            assert out.to_numpy()[0] == x.sum()
