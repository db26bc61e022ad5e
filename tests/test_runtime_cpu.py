"""CPU tests of realizar.cuda: the no-GPU path, error formatting and argument packing."""

from __future__ import annotations

import ctypes
import struct

import pytest

from ptx_gen.catalog import emit
from realizar import cuda
from realizar.cuda.args import KernelArgs
from realizar.cuda.driver import CudaError, check, drv
from realizar.errors import RealizarError, ShapeError

no_gpu = pytest.mark.skipif(cuda.is_available(), reason="checks the no-GPU path")


@no_gpu
def test_no_gpu_is_reported_cleanly():
    assert cuda.is_available() is False
    assert "driver" in cuda.unavailable_reason().lower()
    with pytest.raises(cuda.CudaUnavailableError, match="no GPU available"):
        cuda.current_device()
    with pytest.raises(cuda.CudaUnavailableError):
        cuda.GpuBuffer(16)


def test_driver_errors_carry_call_name_and_string():
    err = drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError) as info:
        check((err, None), "cuMemAlloc")
    e = info.value
    assert isinstance(e, RealizarError)
    assert e.call == "cuMemAlloc" and e.code == int(err)
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(e) and "cuMemAlloc failed" in str(e)


def test_check_unpacks_values():
    ok = drv.CUresult.CUDA_SUCCESS
    assert check((ok, 5), "x") == 5
    assert check((ok, 1, 2), "x") == (1, 2)
    assert check((ok,), "x") is None


class _FakeBuffer:
    ptr = 0xDEAD0000


def test_kernel_args_pack_in_place():
    params = emit("axpy", vec=4).params
    args = KernelArgs(params, _FakeBuffer(), 0x1000, 2.5, 77)
    assert args.snapshot() == struct.pack("<QQfI", 0xDEAD0000, 0x1000, 2.5, 77)
    address = args.address
    args.set("n", 78)
    assert args.address == address  # same storage, updated in place
    pointers = (ctypes.c_void_p * 4).from_address(address)
    assert ctypes.c_uint32.from_address(pointers[3]).value == 78
    assert args.buffers == {"x": args.buffers["x"]}
    dup = args.copy()
    dup.set("n", 5)
    assert args.get("n") == 78 and dup.get("n") == 5 and dup.address != args.address


@pytest.mark.parametrize("bad,match", [
    (dict(n=-1), "out of range"), (dict(n=1 << 32), "out of range"), (dict(n=1.5), "non-integer"),
])
def test_kernel_args_validate_values(bad, match):
    params = emit("axpy", vec=4).params
    base = dict(x=1, y=2, alpha=1.0, n=3)
    with pytest.raises(ShapeError, match=match):
        KernelArgs(params, **{**base, **bad})


def test_kernel_args_signature_errors():
    params = emit("axpy", vec=4).params
    with pytest.raises(ShapeError, match="missing kernel arguments"):
        KernelArgs(params, 1, 2)
    with pytest.raises(ShapeError, match="given twice"):
        KernelArgs(params, 1, 2, 1.0, 3, n=4)
    with pytest.raises(ShapeError, match="no kernel parameter"):
        KernelArgs(params, 1, 2, 1.0, 3).set("m", 1)
    with pytest.raises(ShapeError, match="device buffer"):
        KernelArgs(emit("row_sum").params, 1, 2, _FakeBuffer())


def test_releases_during_capture_are_deferred(monkeypatch):
    from realizar.cuda import driver

    calls = []

    class FakeDriver:
        def cuMemFree(self, handle):
            calls.append(handle)

    monkeypatch.setattr(driver, "drv", FakeDriver())
    driver.begin_capture_scope()
    driver.release("cuMemFree", 1)
    driver.begin_capture_scope()
    driver.release("cuMemFree", 2)
    driver.end_capture_scope()
    assert calls == []  # still inside the outer capture
    driver.end_capture_scope()
    assert calls == [1, 2]
    driver.release("cuMemFree", 3)
    assert calls == [1, 2, 3]


def test_host_to_device_copy_without_a_stream_has_landed_when_it_returns(monkeypatch):
    """The stream-less copy waits for its DMA (a plain cuMemcpyHtoD from pageable memory may return before
    the bytes land, and kernels on the non-blocking streams do not wait for it); with a stream it is one
    asynchronous copy on that stream."""
    import realizar.cuda.device as device_mod

    calls = []
    monkeypatch.setattr(device_mod, "call", lambda name, *args: calls.append((name, args)))
    dev = object.__new__(device_mod.Device)
    dev.memcpy_htod(0x1000, 0x2000, 64)
    assert [name for name, _ in calls] == ["cuMemcpyHtoDAsync", "cuStreamSynchronize"]
    assert calls[0][1][:3] == (0x1000, 0x2000, 64) and int(calls[0][1][3]) == 0 == int(calls[1][1][0])
    calls.clear()

    class FakeStream:
        handle = "s7"

    dev.memcpy_htod(0x1000, 0x2000, 64, FakeStream())
    assert calls == [("cuMemcpyHtoDAsync", (0x1000, 0x2000, 64, "s7"))]
