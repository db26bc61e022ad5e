"""Page-locked host memory and per-step device values for graph replays.

Values that change every token (position, seq_len, the input token) live in a small device buffer;
before each replay the host writes them into a pinned staging array and one async copy on the
graph's stream moves them over, so the graph itself never changes.
"""

from __future__ import annotations

import ctypes
import weakref

import numpy as np

from realizar.cuda.device import Device, current_device
from realizar.cuda.memory import GpuBuffer
from realizar.cuda.stream import Stream
from realizar.errors import ShapeError


class PinnedArray:
    """A NumPy array backed by ``cuMemAllocHost`` (page-locked) memory: truly async copies."""

    def __init__(self, count: int, dtype=np.uint32, device: Device | None = None):
        self.dtype = np.dtype(dtype)
        self.device = device or current_device()
        nbytes = max(int(count), 1) * self.dtype.itemsize
        self._ptr = self.device.host_alloc(nbytes)
        self._finalizer = weakref.finalize(self, self.device.host_release, self._ptr)
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

    ``dest=(buffer, offset)``: the values are elements ``offset ..`` of an existing u32 buffer (a
    larger per-step buffer whose other parts are uploaded otherwise); ``device`` is then None.

    The pinned staging area is a ring of ``ring`` slots: each upload copies from the current slot and
    moves on to the next, so the host may set the next step's values while earlier copies are still
    queued. Before a slot is reused the stream is synchronised once (every ``ring`` uploads).
    """

    def __init__(self, names: tuple[str, ...], dtype=np.uint32, ring: int = 256, device: Device | None = None,
                 dest: tuple[GpuBuffer, int] | None = None):
        if len(set(names)) != len(names) or not names:
            raise ShapeError(f"step value names must be unique and non-empty, got {names}")
        if ring < 1:
            raise ShapeError(f"ring must be at least 1, got {ring}")
        self.names = tuple(names)
        self._index = {n: i for i, n in enumerate(names)}
        self._n = len(names)
        self.ring = ring
        self.host = PinnedArray(ring * self._n, dtype, device)
        self.host.array[:] = 0
        if dest is None:
            self.device = GpuBuffer(self._n, dtype, self.host.device)
            self._dest = self.device.ptr
            self.device.copy_from_host(self.host.array[: self._n])
        else:  # values [offset, offset + n) of a buffer that holds more (its owner frees it)
            buf, offset = dest
            if buf.dtype != np.dtype(dtype) or not 0 <= offset <= buf.count - self._n:
                raise ShapeError(f"step values of {self._n} {np.dtype(dtype)} do not fit {buf!r} at {offset}")
            self.device = None
            self._dest = buf.ptr + offset * buf.dtype.itemsize
        self._nbytes = self._n * self.host.dtype.itemsize
        self._slot = 0
        self._uploads = 0

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ShapeError(f"no step value {name!r}; have {self.names}") from None

    def pointer(self, name: str) -> int:
        """Device address of one value (kernels that read a single u32 take this)."""
        return self._dest + self.index(name) * self.host.dtype.itemsize

    def _current(self) -> np.ndarray:
        return self.host.array[self._slot * self._n:(self._slot + 1) * self._n]

    def set(self, **values: int) -> None:
        cur = self._current()
        for name, value in values.items():
            cur[self.index(name)] = value

    def get(self, name: str) -> int:
        return int(self._current()[self.index(name)])

    def upload(self, stream: Stream | None = None) -> None:
        """Async copy of the current values to the device; later ``set`` calls write the next slot."""
        dev = self.host.device
        src = self.host._ptr + self._slot * self._nbytes
        dev.memcpy_htod(self._dest, src, self._nbytes, stream if stream is not None else Stream.null(dev))
        self._uploads += 1
        nxt = (self._slot + 1) % self.ring
        if nxt == 0:  # about to overwrite slots whose copies may still be queued
            if stream is not None:
                stream.synchronize()
            else:
                dev.stream_synchronize(dev.null_stream())
        self.host.array[nxt * self._n:(nxt + 1) * self._n] = self._current()
        self._slot = nxt

    def free(self) -> None:
        if self.device is not None:
            self.device.free()
        self.host.free()
