"""EmulatedDevice: the runtime's device surface, with memory and kernels on the CPU PTX emulator.

    dev = cuda.EmulatedDevice(sm_count=4)
    with cuda.GpuBuffer.from_numpy(x, device=dev) as dx, cuda.GpuBuffer(n, device=dev) as dy:
        k = cuda.module_cache(dev).get("vector_add", vec=4)
        cuda.launch(k, grid, k.meta["block"], k.args(dx, dx, dy, n))   # runs on ptx_gen.emulator
        y = dy.to_numpy()

Every launch runs to completion at once (streams and events impose no order beyond program order)
with the emulator's memcheck, barrier checks and (unless ``racecheck=False``) racecheck, whose
findings raise :class:`ptx_gen.emulator.EmulatorError`. ``REALIZAR_DEVICE=emulate`` makes
:func:`realizar.cuda.current_device` return one process-wide instance (:func:`default_emulated_device`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from ptx_gen.emulator import EmulatorError, Memory, run
from ptx_gen.emulator.parse import parse
from ptx_gen.target import Target
from realizar.cuda.module import CompiledKernel
from realizar.errors import ShapeError

__all__ = ["EmulatedDevice", "EmulatedKernel", "default_emulated_device"]

# CU_DEVICE_ATTRIBUTE_* values of an H100 SXM (sm_90); other targets override the lines that differ
_SM90_ATTRIBUTES = {
    "MAX_THREADS_PER_BLOCK": 1024, "MAX_BLOCK_DIM_X": 1024, "MAX_BLOCK_DIM_Y": 1024, "MAX_BLOCK_DIM_Z": 64,
    "MAX_GRID_DIM_X": 2**31 - 1, "MAX_GRID_DIM_Y": 65535, "MAX_GRID_DIM_Z": 65535,
    "MAX_SHARED_MEMORY_PER_BLOCK": 48 * 1024, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 227 * 1024,
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 228 * 1024, "TOTAL_CONSTANT_MEMORY": 64 * 1024, "WARP_SIZE": 32,
    "MAX_REGISTERS_PER_BLOCK": 65536, "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048, "MAX_BLOCKS_PER_MULTIPROCESSOR": 32,
    "CLOCK_RATE": 1_980_000, "MEMORY_CLOCK_RATE": 2_619_000, "GLOBAL_MEMORY_BUS_WIDTH": 5120,
    "L2_CACHE_SIZE": 50 * 1024 * 1024, "ECC_ENABLED": 1, "CONCURRENT_KERNELS": 1, "INTEGRATED": 0,
    "UNIFIED_ADDRESSING": 1, "COOPERATIVE_LAUNCH": 1, "CAN_MAP_HOST_MEMORY": 1,
}
_TARGET_ATTRIBUTES = {
    "sm_80": {"MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 163 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 164 * 1024,
              "L2_CACHE_SIZE": 40 * 1024 * 1024},
    "sm_86": {"MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 99 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 100 * 1024,
              "MAX_THREADS_PER_MULTIPROCESSOR": 1536, "MAX_BLOCKS_PER_MULTIPROCESSOR": 16},
    "sm_89": {"MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 99 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 100 * 1024,
              "MAX_THREADS_PER_MULTIPROCESSOR": 1536, "MAX_BLOCKS_PER_MULTIPROCESSOR": 24},
}
# The emulator does not allocate registers; occupancy assumes this many per thread (a full-size kernel).
_ASSUMED_REGISTERS = 128
_RESERVED_SMEM_PER_BLOCK = 1024  # shared memory the hardware reserves per resident block


@dataclass
class EmulatedKernel(CompiledKernel):
    """A catalog kernel "loaded" on an EmulatedDevice: launches run its PTX on the emulator."""

    device: "EmulatedDevice | None" = None
    static_shared: int = 0

    @property
    def launcher(self):
        return self.device.launch_kernel

    def ensure_dynamic_shared(self, nbytes: int) -> None:
        limit = self.device.max_shared_per_block_optin - self.static_shared
        if nbytes > limit:
            raise ShapeError(f"kernel {self.name}: {nbytes} bytes of dynamic shared memory exceed the "
                             f"{limit} a block may opt into on {self.device.target}")


def _host_available() -> int:
    """The host's available physical memory in bytes (80 GiB where the system does not say)."""
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return 80 << 30


class EmulatedDevice:
    """The surface of :class:`realizar.cuda.Device` (``sm_count``, ``target``, ``name``, ``memory_info()``,
    ``synchronize()``, ``attribute()``, ``occupancy()``, ``set_shared_carveout()``...) backed by a
    :class:`ptx_gen.emulator.Memory`; ``launches`` lists every launch run, as
    ``(kernel name, grid, block, shared bytes, {parameter: value})``. The attributes are an H100 SXM's
    (or the ``target``'s); ``attributes`` overrides some, e.g. an H200's memory clock and bus width.
    ``free_bytes``: the memory it reports (its buffers live in host memory), by default an eighth of the host's
    available memory, at most 80 GiB, so that what sizes itself by the free memory (the KV pool) fits the host."""

    emulated = True
    ordinal = 0

    def __init__(self, sm_count: int = 132, target: str = "sm_90", free_bytes: int | None = None,
                 racecheck: bool = True, attributes: dict[str, int] | None = None):
        self.sm_count = int(sm_count)
        self.target = Target(target) if isinstance(target, str) else target
        self.name = f"emulated {self.target.sm}"
        self.total_memory = int(free_bytes if free_bytes is not None else min(80 << 30, _host_available() // 8))
        self.racecheck = racecheck
        self.memory = Memory()
        self.launches: list[tuple] = []
        self._attributes = {**_SM90_ATTRIBUTES, **_TARGET_ATTRIBUTES.get(self.target.sm.rstrip("a"), {}),
                            "MULTIPROCESSOR_COUNT": self.sm_count,
                            "COMPUTE_CAPABILITY_MAJOR": self.target.compute_capability[0],
                            "COMPUTE_CAPABILITY_MINOR": self.target.compute_capability[1], **(attributes or {})}
        self._capturing: set[int] = set()  # id() of streams being captured
        self._host: dict[int, np.ndarray] = {}  # "pinned" host allocations by address

    # ---- the Device surface --------------------------------------------------------------------
    @property
    def compute_capability(self) -> tuple[int, int]:
        return self.target.compute_capability

    @property
    def max_shared_per_block_optin(self) -> int:
        return self._attributes["MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"]

    @property
    def max_shared_per_sm(self) -> int:
        return self._attributes["MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"]

    def make_current(self) -> None:
        pass

    def attribute(self, attr: str) -> int:
        """A ``CU_DEVICE_ATTRIBUTE_*`` value by its suffix, from a table of plausible values."""
        try:
            return self._attributes[attr]
        except KeyError:
            raise AttributeError(f"the emulated device has no value for attribute {attr!r}") from None

    def memory_info(self) -> tuple[int, int]:
        used = sum(self.memory.allocs.values())
        return max(0, self.total_memory - used), self.total_memory

    def synchronize(self) -> None:
        pass  # every operation has completed when its call returns

    def occupancy(self, kernel, threads: int, dyn_smem: int = 0) -> int:
        """Resident blocks per SM from the thread, block, register (``_ASSUMED_REGISTERS`` per thread, or
        fewer where a block of ``threads`` could not launch with that many) and shared-memory limits."""
        a = self._attributes
        warps = -(-int(threads) // 32)
        by_threads = a["MAX_THREADS_PER_MULTIPROCESSOR"] // (32 * warps)
        regs = min(_ASSUMED_REGISTERS, a["MAX_REGISTERS_PER_BLOCK"] // (32 * warps))  # a launchable block fits
        by_regs = a["MAX_REGISTERS_PER_MULTIPROCESSOR"] // (regs * 32 * warps)
        smem = getattr(kernel, "static_shared", 0) + int(dyn_smem) + _RESERVED_SMEM_PER_BLOCK
        by_smem = a["MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"] // smem
        return max(0, min(a["MAX_BLOCKS_PER_MULTIPROCESSOR"], by_threads, by_regs, by_smem))

    def set_shared_carveout(self, kernel, percent: int) -> None:
        """A cache preference changes no result: only checked."""
        if not 0 <= int(percent) <= 100:
            raise ValueError(f"shared-memory carveout must be a percentage, got {percent}")

    def __repr__(self) -> str:
        return f"EmulatedDevice({self.target.sm}, {self.sm_count} SMs)"

    # ---- memory ------------------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        return self.memory.alloc(nbytes)

    def mem_release(self, ptr: int) -> None:
        if ptr in self.memory.allocs:  # finalizers never raise
            self.memory.free(ptr)

    @staticmethod
    def _host_bytes(ptr: int, nbytes: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def memcpy_htod(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self.memory.write_bytes(dst, self._host_bytes(src, nbytes))

    def memcpy_dtoh(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self._host_bytes(dst, nbytes)[:] = self.memory.read_bytes(src, nbytes)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self.memory.write_bytes(dst, self.memory.read_bytes(src, nbytes))

    def memset_d8(self, ptr: int, value: int, nbytes: int, stream=None) -> None:
        self.memory.fill(ptr, int(value), nbytes)

    def host_alloc(self, nbytes: int) -> int:
        buf = np.zeros(nbytes, np.uint8)
        self._host[buf.ctypes.data] = buf
        return buf.ctypes.data

    def host_release(self, ptr: int) -> None:
        self._host.pop(ptr, None)

    # ---- streams and events: everything has completed already ---------------------------------------
    def stream_create(self):
        return object()

    def stream_release(self, handle) -> None:
        pass

    def null_stream(self):
        return None

    def stream_synchronize(self, handle) -> None:
        pass

    def stream_query(self, handle) -> bool:
        return True

    def stream_wait(self, handle, event_handle) -> None:
        pass

    def event_create(self, timing: bool):
        return [0.0]  # the host time of the last record

    def event_release(self, handle) -> None:
        pass

    def event_record(self, handle, stream=None) -> None:
        handle[0] = time.perf_counter()

    def event_synchronize(self, handle) -> None:
        pass

    def event_elapsed_ms(self, start, end) -> float:
        """Host time between the records (the emulator's speed, not a GPU's)."""
        return (end[0] - start[0]) * 1e3

    # ---- kernels -----------------------------------------------------------------------------------
    def load_kernel(self, source, cache) -> EmulatedKernel:
        kern = parse(source.ptx)  # rejects PTX the emulator cannot read, as a JIT would at load
        return EmulatedKernel(source, None, None, "", device=self, static_shared=kern.static_shared)

    def launch_kernel(self, kernel, grid, block, shared_bytes: int, stream, args) -> None:
        """Run one launch (``realizar.cuda.launch`` validated it); record only while ``stream`` is captured."""
        if stream is not None and id(stream) in self._capturing:
            return
        params = {p.name: args.get(p.name) for p in args.params}
        self.launches.append((kernel.name, tuple(grid), tuple(block), shared_bytes, dict(params)))
        run(kernel.source.ptx, grid, block, params, self.memory, shared_bytes, racecheck=self.racecheck)

    def begin_capture(self, stream) -> None:
        if id(stream) in self._capturing:
            raise EmulatorError("the stream is already being captured")
        self._capturing.add(id(stream))

    def end_capture(self, stream) -> None:
        self._capturing.discard(id(stream))


_default: EmulatedDevice | None = None
_default_lock = threading.Lock()


def default_emulated_device() -> EmulatedDevice:
    """The process-wide EmulatedDevice that ``REALIZAR_DEVICE=emulate`` selects."""
    global _default
    with _default_lock:
        if _default is None:
            _default = EmulatedDevice()
        return _default
