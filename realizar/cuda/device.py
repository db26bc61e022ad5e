"""Devices and their primary contexts."""

from __future__ import annotations

import threading
from functools import cached_property

from ptx_gen.target import Target
from realizar.cuda.driver import call, drv, ensure_initialized


class Device:
    """One CUDA device with its retained primary context, made current on creation."""

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

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory."""
        self.make_current()
        free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        self.make_current()
        call("cuCtxSynchronize")

    def __repr__(self) -> str:
        major, minor = self.compute_capability
        return f"Device({self.ordinal}: {self.name}, sm_{major}{minor}, {self.sm_count} SMs)"


def current_device() -> Device:
    """Device 0, initialising the driver and its primary context on first use."""
    return Device(0)
