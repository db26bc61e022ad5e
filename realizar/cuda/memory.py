"""GpuBuffer: a typed, sized device allocation with deterministic release."""

from __future__ import annotations

import weakref

import numpy as np

from realizar.cuda.device import Device, current_device
from realizar.cuda.stream import Stream
from realizar.errors import RealizarError, ShapeError


class BufferFreedError(RealizarError, RuntimeError):
    """A GpuBuffer was used after it was freed."""


class GpuBuffer:
    """``count`` elements of ``dtype`` in device memory.

    Freed by :meth:`free`, on leaving a ``with`` block, or by its finalizer when garbage collected.
    Element offsets (``*_at`` methods) are in elements, not bytes. ``device`` (default:
    :func:`current_device`) does the allocation and the copies; an EmulatedDevice works the same.
    """

    def __init__(self, count: int, dtype=np.float32, device: Device | None = None):
        count = int(count)
        if count <= 0:
            raise ShapeError(f"GpuBuffer needs a positive element count, got {count}")
        self.device = device or current_device()
        self.dtype = np.dtype(dtype)
        self.count = count
        self.nbytes = count * self.dtype.itemsize
        self._ptr = self.device.mem_alloc(self.nbytes)
        self._finalizer = weakref.finalize(self, self.device.mem_release, self._ptr)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, array: np.ndarray, stream: Stream | None = None, device: Device | None = None) -> "GpuBuffer":
        array = np.ascontiguousarray(array)
        buf = cls(array.size, array.dtype, device or (stream.device if stream is not None else None))
        buf.copy_from_host(array, stream=stream)
        return buf

    @classmethod
    def zeros(cls, count: int, dtype=np.float32, device: Device | None = None) -> "GpuBuffer":
        buf = cls(count, dtype, device)
        buf.fill_bytes(0)
        return buf

    # ---- identity and lifetime ------------------------------------------------------------
    @property
    def ptr(self) -> int:
        """The device address; raises once the buffer was freed."""
        if not self._finalizer.alive:
            raise BufferFreedError(f"use of a freed GpuBuffer ({self.count} x {self.dtype})")
        return self._ptr

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def free(self) -> None:
        if self._finalizer.alive:
            self._finalizer()

    close = free

    def __enter__(self) -> "GpuBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        state = f"0x{self._ptr:x}" if self.alive else "freed"
        return f"GpuBuffer({self.count} x {self.dtype}, {state})"

    # ---- host <-> device -------------------------------------------------------------------
    def _host_view(self, array: np.ndarray, offset: int, what: str) -> np.ndarray:
        array = np.asarray(array)
        if array.dtype != self.dtype:
            raise ShapeError(f"{what}: buffer holds {self.dtype}, array is {array.dtype}")
        if not array.flags.c_contiguous:
            raise ShapeError(f"{what}: the host array must be C-contiguous")
        if offset < 0 or offset + array.size > self.count:
            raise ShapeError(
                f"{what}: elements [{offset}, {offset + array.size}) do not fit a buffer of {self.count}"
            )
        return array

    def copy_from_host_at(self, array: np.ndarray, offset: int = 0, stream: Stream | None = None) -> None:
        """Copy ``array`` into elements ``[offset, offset + array.size)``; async when ``stream`` is given
        (then the host array must stay alive and unchanged until the stream reaches the copy)."""
        array = self._host_view(array, offset, "copy_from_host_at")
        if array.size == 0:
            return
        self.device.memcpy_htod(self.ptr + offset * self.dtype.itemsize, array.ctypes.data, array.nbytes, stream)

    def copy_from_host(self, array: np.ndarray, stream: Stream | None = None) -> None:
        array = np.asarray(array)
        if array.size != self.count:
            raise ShapeError(f"copy_from_host: buffer holds {self.count} elements, array has {array.size}")
        self.copy_from_host_at(array.reshape(-1), 0, stream)

    def copy_to_host_at(
        self, offset: int = 0, count: int | None = None, out: np.ndarray | None = None, stream: Stream | None = None
    ) -> np.ndarray:
        """Copy ``count`` elements starting at ``offset`` to a host array (``out`` if given)."""
        if count is None:
            count = (out.size if out is not None else self.count - offset)
        if out is None:
            out = np.empty(count, self.dtype)
        if out.size != count:
            raise ShapeError(f"copy_to_host_at: out has {out.size} elements, asked for {count}")
        out_view = self._host_view(out, offset, "copy_to_host_at")
        if count == 0:
            return out
        src = self.ptr + offset * self.dtype.itemsize
        self.device.memcpy_dtoh(out_view.ctypes.data, src, out_view.nbytes, stream)
        return out

    def copy_to_host(self, out: np.ndarray | None = None, stream: Stream | None = None) -> np.ndarray:
        return self.copy_to_host_at(0, self.count, out, stream)

    def to_numpy(self, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """A new host array with the buffer's contents (synchronous)."""
        host = self.copy_to_host()
        return host.reshape(shape) if shape is not None else host

    # ---- device-side ------------------------------------------------------------------------
    def copy_from(
        self, other: "GpuBuffer", count: int | None = None, src_offset: int = 0, dst_offset: int = 0,
        stream: Stream | None = None,
    ) -> None:
        """Device-to-device copy of ``count`` elements (same dtype) from ``other``."""
        if other.dtype != self.dtype:
            raise ShapeError(f"copy_from: dtype {other.dtype} into a {self.dtype} buffer")
        count = min(other.count - src_offset, self.count - dst_offset) if count is None else count
        if src_offset + count > other.count or dst_offset + count > self.count or min(src_offset, dst_offset) < 0:
            raise ShapeError(
                f"copy_from: {count} elements at src {src_offset} / dst {dst_offset} exceed "
                f"buffers of {other.count} / {self.count}"
            )
        size = count * self.dtype.itemsize
        src = other.ptr + src_offset * self.dtype.itemsize
        dst = self.ptr + dst_offset * self.dtype.itemsize
        self.device.memcpy_dtod(dst, src, size, stream)

    def fill_bytes(self, value: int, stream: Stream | None = None) -> None:
        """Set every byte to ``value`` (0xFF poisons float32 buffers with NaN)."""
        self.device.memset_d8(self.ptr, value, self.nbytes, stream)

    def poison(self, stream: Stream | None = None) -> None:
        """Fill with NaN (all-ones bytes) so unwritten outputs are caught by tests."""
        self.fill_bytes(0xFF, stream)


def is_buffer_arg(x) -> bool:
    """True for a device buffer (anything with ``ptr``, ``count`` and ``dtype``) or a
    ``(buffer, element offset)`` pair naming a slice of one."""
    if isinstance(x, tuple) and len(x) == 2:
        x = x[0]
    return hasattr(x, "ptr") and hasattr(x, "count") and hasattr(x, "dtype")


_DTYPES: dict = {}  # dtype spellings (np.float32, "float32", np.dtype) -> np.dtype, resolved once


def _as_dtype(dtype) -> np.dtype:
    try:
        return _DTYPES[dtype]
    except (KeyError, TypeError):
        resolved = np.dtype(dtype)
        try:
            _DTYPES[dtype] = resolved
        except TypeError:
            pass
        return resolved


def device_address(x, count: int, what: str, dtype=np.float32, align: int = 1) -> tuple[int, object]:
    """(device address, owning buffer) of a buffer or ``(buffer, element offset)`` holding at least
    ``count`` elements of ``dtype`` from the offset, aligned to ``align`` bytes; ShapeError otherwise.
    (Called for every operand of every launch: the common case, a GpuBuffer and an int offset, takes
    the shortest path through the same checks.)"""
    buf, off = (x if isinstance(x, tuple) else (x, 0))
    if type(buf) is not GpuBuffer and not is_buffer_arg(buf):
        raise ShapeError(f"{what} must be a GpuBuffer or (GpuBuffer, element offset), got {type(buf).__name__}")
    want = _as_dtype(dtype)
    if buf.dtype is not want and _as_dtype(buf.dtype) != want:
        raise ShapeError(f"{what} must hold {want}, got {buf.dtype}")
    if type(off) is not int and (isinstance(off, bool) or not isinstance(off, (int, np.integer))) or off < 0:
        raise ShapeError(f"{what}: element offset must be a non-negative integer, got {off!r}")
    if off + count > buf.count:
        raise ShapeError(f"{what} needs {count} elements from offset {off}; the buffer holds {buf.count}")
    addr = int(buf.ptr) + int(off) * want.itemsize
    if addr % align:
        raise ShapeError(f"{what} must be {align}-byte aligned (element offset {off})")
    return addr, buf
