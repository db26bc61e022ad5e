"""Devices and their primary contexts.

A device object is also the one place buffers, streams, events, module caches and launches go for
their few low-level operations (allocate, copy, set, load a module, create a stream...), so that the
same runtime works on :class:`realizar.cuda.EmulatedDevice`, which implements them on the CPU.
"""

from __future__ import annotations

import os
import threading
from functools import cached_property

from ptx_gen.target import Target
from realizar.cuda.driver import call, drv, ensure_initialized, release


class Device:
    """One CUDA device with its retained primary context, made current on creation."""

    emulated = False
    _instances: dict[int, "Device"] = {}
    _lock = threading.Lock()

    def __new__(cls, ordinal: int = 0) -> "Device":
        with cls._lock:
            if ordinal not in cls._instances:
                ensure_initialized()
                count = call("cuDeviceGetCount")
                if not 0 <= ordinal < count:
                    raise ValueError(f"device ordinal {ordinal} out of range: {count} device(s) present")
                inst = super().__new__(cls)
                inst.ordinal = ordinal
                inst.handle = call("cuDeviceGet", ordinal)
                inst.context = call("cuDevicePrimaryCtxRetain", inst.handle)
                cls._instances[ordinal] = inst
            dev = cls._instances[ordinal]
        dev.make_current()
        return dev

    def make_current(self) -> None:
        call("cuCtxSetCurrent", self.context)

    def attribute(self, attr: str) -> int:
        """A ``CU_DEVICE_ATTRIBUTE_*`` value, by its suffix (e.g. ``"MULTIPROCESSOR_COUNT"``)."""
        enum = getattr(drv.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attr}")
        return int(call("cuDeviceGetAttribute", enum, self.handle))

    @cached_property
    def name(self) -> str:
        raw = call("cuDeviceGetName", 256, self.handle)
        return raw.split(b"\0", 1)[0].decode()

    @cached_property
    def pci_bus_id(self) -> str:
        """``domain:bus:device.function`` (hex), the same in every process whatever ``CUDA_VISIBLE_DEVICES`` says:
        which physical GPU this is."""
        raw = call("cuDeviceGetPCIBusId", 16, self.handle)
        return raw.split(b"\0", 1)[0].decode()

    @cached_property
    def compute_capability(self) -> tuple[int, int]:
        return self.attribute("COMPUTE_CAPABILITY_MAJOR"), self.attribute("COMPUTE_CAPABILITY_MINOR")

    @cached_property
    def target(self) -> Target:
        """The PTX target kernels are generated for on this device."""
        return Target.from_compute_capability(*self.compute_capability)

    @cached_property
    def sm_count(self) -> int:
        return self.attribute("MULTIPROCESSOR_COUNT")

    @cached_property
    def total_memory(self) -> int:
        return int(call("cuDeviceTotalMem", self.handle))

    @cached_property
    def max_shared_per_block_optin(self) -> int:
        return self.attribute("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")

    @cached_property
    def max_shared_per_sm(self) -> int:
        return self.attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        self.make_current()
        free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        self.make_current()
        call("cuCtxSynchronize")

    def occupancy(self, kernel, threads: int, dyn_smem: int = 0) -> int:
        """Blocks of ``kernel`` (a CompiledKernel) one SM holds at once with ``threads`` threads per
        block and ``dyn_smem`` bytes of dynamic shared memory (the driver's occupancy calculator)."""
        return int(call("cuOccupancyMaxActiveBlocksPerMultiprocessor", kernel.function, int(threads), int(dyn_smem)))

    def set_shared_carveout(self, kernel, percent: int) -> None:
        """Prefer ``percent`` of the SM's maximum shared memory as shared (the rest is L1) for ``kernel``."""
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        call("cuFuncSetAttribute", kernel.function, attr, int(percent))

    # ---- low-level operations that GpuBuffer, Stream, Event, PinnedArray and ModuleCache delegate --
    # (addresses are ints; ``stream`` is a Stream or None for the legacy default stream)
    def mem_alloc(self, nbytes: int) -> int:
        return int(call("cuMemAlloc", nbytes))

    def mem_release(self, ptr: int) -> None:
        """Free device memory; from finalizers too (deferred while a stream capture is running)."""
        release("cuMemFree", ptr)

    def memcpy_htod(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        """Asynchronous on ``stream``; without one, on the default stream and waited for, so the bytes are on
        the device when it returns and work issued afterwards on any stream reads them. (A plain
        ``cuMemcpyHtoD`` from pageable memory returns once the bytes are staged, before the DMA lands, and
        the non-blocking streams do not wait for the default stream: a kernel issued right after could read
        the old contents.)"""
        call("cuMemcpyHtoDAsync", dst, src, nbytes, stream.handle if stream is not None else drv.CUstream(0))
        if stream is None:
            call("cuStreamSynchronize", drv.CUstream(0))

    def memcpy_dtoh(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        if stream is None:
            call("cuMemcpyDtoH", dst, src, nbytes)
        else:
            call("cuMemcpyDtoHAsync", dst, src, nbytes, stream.handle)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        """Asynchronous on ``stream``; without one, on the default stream and waited for."""
        call("cuMemcpyDtoDAsync", dst, src, nbytes, stream.handle if stream is not None else drv.CUstream(0))
        if stream is None:
            call("cuStreamSynchronize", drv.CUstream(0))

    def memset_d8(self, ptr: int, value: int, nbytes: int, stream=None) -> None:
        """Asynchronous on ``stream``; without one, on the default stream and waited for."""
        call("cuMemsetD8Async", ptr, int(value) & 0xFF, nbytes, stream.handle if stream is not None else drv.CUstream(0))
        if stream is None:
            call("cuStreamSynchronize", drv.CUstream(0))

    def host_alloc(self, nbytes: int) -> int:
        """Page-locked host memory."""
        return int(call("cuMemAllocHost", nbytes))

    def host_release(self, ptr: int) -> None:
        release("cuMemFreeHost", ptr)

    def stream_create(self):
        return call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)

    def stream_release(self, handle) -> None:
        release("cuStreamDestroy", handle)

    def null_stream(self):
        return drv.CUstream(0)

    def stream_synchronize(self, handle) -> None:
        call("cuStreamSynchronize", handle)

    def stream_query(self, handle) -> bool:
        status = drv.cuStreamQuery(handle)[0]
        if status == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        call("cuStreamQuery", handle)  # raises on real errors
        return True

    def stream_wait(self, handle, event_handle) -> None:
        call("cuStreamWaitEvent", handle, event_handle, 0)

    def event_create(self, timing: bool):
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return call("cuEventCreate", flags)

    def event_release(self, handle) -> None:
        release("cuEventDestroy", handle)

    def event_record(self, handle, stream=None) -> None:
        call("cuEventRecord", handle, stream.handle if stream is not None else drv.CUstream(0))

    def event_synchronize(self, handle) -> None:
        call("cuEventSynchronize", handle)

    def event_elapsed_ms(self, start, end) -> float:
        return float(call("cuEventElapsedTime", start, end))

    def load_kernel(self, source, cache):
        """Load ``source`` (a catalog PtxKernel) through ``cache``'s JIT/cubin path."""
        from realizar.cuda.module import CompiledKernel

        self.make_current()
        module, info = cache._load_module(source)
        function = call("cuModuleGetFunction", module, source.entry.encode())
        return CompiledKernel(source, function, module, info)

    def __repr__(self) -> str:
        major, minor = self.compute_capability
        return f"Device({self.ordinal}: {self.name}, sm_{major}{minor}, {self.sm_count} SMs)"


def current_device():
    """Device 0, initialising the driver and its primary context on first use; with
    ``REALIZAR_DEVICE=emulate`` the process-wide :class:`~realizar.cuda.EmulatedDevice` instead."""
    choice = os.environ.get("REALIZAR_DEVICE", "")
    if choice == "emulate":
        from realizar.cuda.emulated import default_emulated_device

        return default_emulated_device()
    if choice not in ("", "cuda", "gpu"):
        raise ValueError(f"REALIZAR_DEVICE={choice!r}: expected 'emulate', 'cuda' or unset")
    return Device(0)
