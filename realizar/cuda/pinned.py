"""Page-locked host memory and per-step device values for graph replays.

Values that change every token (position, seq_len, the input token) live in a small device buffer;
before each replay the host writes them into a pinned staging array and one async copy on the
graph's stream moves them over, so the graph itself never changes.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from realizar.cuda.driver import call, check, drv, release
from realizar.cuda.memory import GpuBuffer
from realizar.cuda.stream import Stream
from realizar.errors import ShapeError




class PinnedArray:
    """A NumPy array backed by ``cuMemAllocHost`` (page-locked) memory: truly async copies."""

    def __init__(self, count: int, dtype=np.uint32):
        self.dtype = np.dtype(dtype)
        nbytes = max(int(count), 1) * self.dtype.itemsize
        self._ptr = int(call("cuMemAllocHost", nbytes))
        self._finalizer = weakref.finalize(self, release, "cuMemFreeHost", self._ptr)
        raw = (ctypes.c_uint8 * nbytes).from_address(self._ptr)
        self.array = np.frombuffer(raw, dtype=self.dtype, count=int(count))

    def free(self) -> None:
        self.array = None
        self._finalizer()


class StepValues:
    """Named per-step scalars (u32 by default) mirrored in a device buffer.

        step = StepValues(("token", "pos", "seq_len"))
        step.set(token=42, pos=7, seq_len=8)
        step.upload(stream)          # async; then replay the graph on the same stream
        kernel args take step.device and read e.g. element step.index("pos")
    """

    def __init__(self, names: tuple[str, ...], dtype=np.uint32):
        if len(set(names)) != len(names) or not names:
            raise ShapeError(f"step value names must be unique and non-empty, got {names}")
        self.names = tuple(names)
        self._index = {n: i for i, n in enumerate(names)}
        self.host = PinnedArray(len(names), dtype)
        self.device = GpuBuffer(len(names), dtype)
        self.host.array[:] = 0
        self.device.copy_from_host(self.host.array)

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ShapeError(f"no step value {name!r}; have {self.names}") from None

    def pointer(self, name: str) -> int:
        """Device address of one value (kernels that read a single u32 take this)."""
        return self.device.ptr + self.index(name) * self.device.dtype.itemsize

    def set(self, **values: int) -> None:
        for name, value in values.items():
            self.host.array[self.index(name)] = value

    def get(self, name: str) -> int:
        return int(self.host.array[self.index(name)])

    def upload(self, stream: Stream | None = None) -> None:
        """Async copy of all values to the device. The pinned staging array must not be changed
        again until the stream has executed this copy (the next token's ``set`` comes after the
        host has read this token's result, which orders it)."""
        handle = stream.handle if stream is not None else drv.CUstream(0)
        check(drv.cuMemcpyHtoDAsync(self.device.ptr, self.host._ptr, self.device.nbytes, handle), "cuMemcpyHtoDAsync")

    def free(self) -> None:
        self.device.free()
        self.host.free()
