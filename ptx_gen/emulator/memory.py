"""Emulated global memory: one byte heap whose allocations are separated by unallocated guard gaps,
so that an access past the end of a buffer is caught (memcheck) instead of reading a neighbour."""

from __future__ import annotations

import numpy as np


class EmulatorError(AssertionError):
    """A kernel did something a GPU would reject or a sanitizer would report."""


HEAP_BASE = 0x7F0000000000
GUARD = 256


class Memory:
    """Global memory: allocations in one byte heap with unallocated guard gaps between them."""

    def __init__(self) -> None:
        self.heap = np.zeros(1 << 16, np.uint8)
        self.valid = np.zeros(1 << 16, bool)
        self.top = GUARD
        self.allocs: dict[int, int] = {}  # address -> size

    def alloc(self, nbytes: int) -> int:
        nbytes = max(int(nbytes), 1)
        start = (self.top + 255) // 256 * 256
        end = start + nbytes
        if end + GUARD > self.heap.size:
            size = max(self.heap.size * 2, end + GUARD + (1 << 16))
            heap, valid = np.zeros(size, np.uint8), np.zeros(size, bool)
            heap[: self.heap.size] = self.heap
            valid[: self.valid.size] = self.valid
            self.heap, self.valid = heap, valid
        self.heap[start:end] = 0xFF  # fresh memory is garbage (NaN as float32)
        self.valid[start:end] = True
        self.top = end + GUARD
        addr = HEAP_BASE + start
        self.allocs[addr] = nbytes
        return addr

    def free(self, addr: int) -> None:
        size = self.allocs.pop(addr)
        off = addr - HEAP_BASE
        self.valid[off : off + size] = False

    def alloc_array(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        addr = self.alloc(array.nbytes)
        self.write_bytes(addr, array.view(np.uint8).reshape(-1))
        return addr

    def _span(self, addr: int, nbytes: int) -> slice:
        off = addr - HEAP_BASE
        if off < 0 or off + nbytes > self.heap.size or not self.valid[off : off + nbytes].all():
            raise EmulatorError(f"host access to unallocated memory {addr:#x} (+{nbytes})")
        return slice(off, off + nbytes)

    def write_bytes(self, addr: int, data: np.ndarray) -> None:
        data = np.asarray(data).view(np.uint8).reshape(-1)
        self.heap[self._span(addr, data.size)] = data

    def read_bytes(self, addr: int, nbytes: int) -> np.ndarray:
        return self.heap[self._span(addr, nbytes)].copy()

    def read(self, addr: int, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        return self.read_bytes(addr, dtype.itemsize * count).view(dtype)

    def fill(self, addr: int, value: int, nbytes: int) -> None:
        self.heap[self._span(addr, nbytes)] = value & 0xFF

    # device side (vectorised over threads)
    def _offsets(self, addrs: np.ndarray, nbytes: int, where: str) -> np.ndarray:
        off = addrs.astype(np.int64) - HEAP_BASE
        if (addrs % nbytes).any():
            bad = addrs[(addrs % nbytes) != 0][0]
            raise EmulatorError(f"{where}: misaligned {nbytes}-byte global access at {int(bad):#x}")
        idx = off[:, None] + np.arange(nbytes)[None, :]
        inside = (idx >= 0) & (idx < self.heap.size)
        ok = inside.all(axis=1)
        ok[ok] = self.valid[idx[ok]].all(axis=1)
        if not ok.all():
            bad = int(addrs[~ok][0])
            raise EmulatorError(f"{where}: out-of-bounds global access of {nbytes} bytes at {bad:#x} "
                                f"({self.describe(bad)})")
        return idx

    def describe(self, addr: int) -> str:
        best = None
        for a, s in self.allocs.items():
            if a <= addr < a + s + GUARD or (best is None or abs(addr - a) < abs(addr - best[0])):
                best = (a, s)
        if best is None:
            return "no allocations"
        a, s = best
        return f"nearest allocation {a:#x}..{a + s:#x}, offset {addr - a:+d}"

    def gather(self, addrs: np.ndarray, nbytes: int, where: str) -> np.ndarray:
        return self.heap[self._offsets(addrs, nbytes, where)]

    def scatter(self, addrs: np.ndarray, data: np.ndarray, where: str) -> None:
        self.heap[self._offsets(addrs, data.shape[1], where)] = data

