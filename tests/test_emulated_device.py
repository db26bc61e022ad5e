"""realizar.cuda on an EmulatedDevice: buffers, module cache, launches, streams, events, pinned step
values, stream capture and recorded graphs, and REALIZAR_DEVICE=emulate."""

from __future__ import annotations

import numpy as np
import pytest

from ptx_gen.emulator import EmulatorError
from realizar import cuda


@pytest.fixture
def dev():
    return cuda.EmulatedDevice(sm_count=4)


def _vector_add(dev, n, rng):
    a, b = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    k = cuda.module_cache(dev).get("vector_add", vec=1)
    da, db = cuda.GpuBuffer.from_numpy(a, device=dev), cuda.GpuBuffer.from_numpy(b, device=dev)
    out = cuda.GpuBuffer(n, device=dev)
    return k, da, db, out, a + b


def test_device_surface(dev):
    assert dev.sm_count == 4 and dev.target.sm == "sm_90" and "emulated" in dev.name
    assert dev.attribute("MULTIPROCESSOR_COUNT") == 4
    assert dev.max_shared_per_block_optin == dev.attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN") == 227 * 1024
    with pytest.raises(AttributeError, match="NO_SUCH"):
        dev.attribute("NO_SUCH")
    free, total = dev.memory_info()
    buf = cuda.GpuBuffer(1 << 20, np.uint8, device=dev)
    assert dev.memory_info()[0] == free - (1 << 20) and dev.memory_info()[1] == total
    buf.free()
    k = cuda.module_cache(dev).get("vector_add", vec=4)
    assert dev.occupancy(k, 128) == 4 and dev.occupancy(k, 1024) == 1
    assert dev.occupancy(k, 128, dyn_smem=100 * 1024) == 2  # shared memory limits it
    dev.set_shared_carveout(k, 50)
    with pytest.raises(ValueError):
        dev.set_shared_carveout(k, 150)
    assert cuda.module_cache(dev) is cuda.module_cache(dev) is not cuda.module_cache(cuda.EmulatedDevice())


def test_buffers_copies_and_launch(dev):
    rng = np.random.default_rng(0)
    k, da, db, out, want = _vector_add(dev, 300, rng)
    out.poison()
    assert np.isnan(out.to_numpy()).all()
    cuda.launch(k, 2, k.meta["block"], k.args(da, db, out, 300))
    assert np.array_equal(out.to_numpy(), want)
    copy = cuda.GpuBuffer(300, device=dev)
    copy.copy_from(out)
    assert np.array_equal(copy.copy_to_host_at(10, 5), want[10:15])
    assert dev.launches[-1][0] == "vector_add"
    small = cuda.GpuBuffer(100, device=dev)  # too small for n=300: memcheck reports it
    with pytest.raises(EmulatorError, match="out-of-bounds"):
        cuda.launch(k, 2, k.meta["block"], k.args(da, db, small, 300))
    da.free()
    with pytest.raises(cuda.BufferFreedError):
        da.ptr


def test_streams_events_and_step_values(dev):
    s = cuda.Stream(dev)
    start, end = cuda.Event(device=dev).record(s), cuda.Event(device=dev)
    step = cuda.StepValues(("pos", "len"), ring=2, device=dev)
    for i in range(5):
        step.set(pos=i, len=i + 7)
        step.upload(s)
        assert step.device.to_numpy().tolist() == [i, i + 7]
    end.record(s)
    s.synchronize()
    assert s.query() and start.elapsed_ms(end) >= 0
    assert cuda.Stream.null(dev).device is dev


@pytest.mark.parametrize("how", ["capture", "record"])
def test_graphs_replay_the_launches(dev, how):
    rng = np.random.default_rng(1)
    k, da, db, out, want = _vector_add(dev, 256, rng)
    s = cuda.Stream(dev)
    out.fill_bytes(0)
    args = k.args(da, db, out, 256)
    ctx = cuda.capture(s) if how == "capture" else cuda.record_graph()
    n = len(dev.launches)
    with ctx as rec:
        cuda.launch(k, 1, 256, args, stream=s)
    ran = len(dev.launches) - n
    assert ran == (0 if how == "capture" else 1)  # a capture records without running
    assert rec.graph.num_kernels == rec.graph.node_count() == 1
    out.fill_bytes(0)
    exe = rec.graph.instantiate()
    exe.launch(s)
    assert np.array_equal(out.to_numpy(), want)
    report = cuda.ab_check(exe, lambda: out.fill_bytes(0), s)
    assert report.identical
    out.free()
    with pytest.raises(cuda.BufferFreedError):
        exe.launch(s)


def test_realizar_device_emulate_selects_the_process_wide_device(monkeypatch):
    import realizar.cuda.emulated as emulated

    monkeypatch.setattr(emulated, "_default", None)
    monkeypatch.setenv("REALIZAR_DEVICE", "emulate")
    d = cuda.current_device()
    assert isinstance(d, cuda.EmulatedDevice) and cuda.current_device() is d
    assert cuda.GpuBuffer(4).device is d
    monkeypatch.setenv("REALIZAR_DEVICE", "tpu")
    with pytest.raises(ValueError, match="REALIZAR_DEVICE"):
        cuda.current_device()


def test_emulated_memory_fits_the_host():
    """Its buffers are host memory: by default it reports an eighth of the host's available memory (at most
    80 GiB), so a KV pool sized as a share of the free memory cannot exhaust the host; a given size is kept."""
    from realizar.cuda.emulated import _host_available

    dev = cuda.EmulatedDevice()
    assert 0 < dev.total_memory <= min(80 << 30, _host_available() // 4)  # (the host's memory moves meanwhile)
    assert cuda.EmulatedDevice(free_bytes=1 << 30).memory_info() == (1 << 30, 1 << 30)
