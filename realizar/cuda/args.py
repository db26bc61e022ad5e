"""Kernel arguments packed once into ctypes storage, updatable in place, reusable across launches.

``cuLaunchKernel`` and graph kernel nodes take ``void**``: an array of pointers, one per
parameter, each pointing at that parameter's value. :class:`KernelArgs` owns both the values and
the pointer array, so a launch passes a single integer address and graph nodes can keep pointing at
the same storage for as long as the KernelArgs lives.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

from ptx_gen.builder import Param
from realizar.errors import ShapeError

_CTYPES = {
    "u64": ctypes.c_uint64,
    "s64": ctypes.c_int64,
    "b64": ctypes.c_uint64,
    "u32": ctypes.c_uint32,
    "s32": ctypes.c_int32,
    "b32": ctypes.c_uint32,
    "f32": ctypes.c_float,
    "f64": ctypes.c_double,
    "u16": ctypes.c_uint16,
    "s16": ctypes.c_int16,
}


def _slot(param: Param) -> Any:
    """ctypes storage for one parameter: its scalar type, or ``param.array`` bytes (a tensor map by value)."""
    return (ctypes.c_char * param.array)() if param.array else _CTYPES[param.type.name]()


def _as_value(param: Param, value: Any) -> Any:
    """Buffers become their device address; everything else must suit the parameter type."""
    if param.array:
        if not isinstance(value, (bytes, bytearray)) or len(value) != param.array:
            raise ShapeError(f"parameter {param.name} takes {param.array} bytes (a tensor map), got "
                             f"{type(value).__name__}{f' of {len(value)}' if isinstance(value, (bytes, bytearray)) else ''}")
        return bytes(value)
    ptr = getattr(value, "ptr", None)
    if ptr is not None:
        if param.type.bits != 64:
            raise ShapeError(f"parameter {param.name} is {param.type}, but a device buffer was passed")
        return int(ptr)
    if param.type.is_float:
        return float(value)
    if isinstance(value, float) and not value.is_integer():
        raise ShapeError(f"parameter {param.name} is {param.type}, got non-integer {value!r}")
    value = int(value)
    bits = param.type.bits
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if param.type.kind == "signed" else (0, (1 << bits) - 1)
    if not lo <= value <= hi:
        raise ShapeError(f"parameter {param.name} ({param.type}) out of range: {value}")
    return value


class KernelArgs:
    """Packed arguments for one kernel signature."""

    def __init__(self, params: Sequence[Param], *values: Any, **named: Any):
        self.params = tuple(params)
        self._index = {p.name: i for i, p in enumerate(self.params)}
        try:
            self._slots = [_slot(p) for p in self.params]
        except KeyError as exc:
            raise ShapeError(f"unsupported kernel parameter type {exc}") from None
        self._pointers = (ctypes.c_void_p * max(len(self.params), 1))(
            *[ctypes.addressof(s) for s in self._slots]
        )
        self.buffers: dict[str, Any] = {}  # GpuBuffers referenced, for lifetime checks in graphs
        if len(values) > len(self.params):
            raise ShapeError(f"{len(values)} arguments for {len(self.params)} parameters")
        given = dict(zip((p.name for p in self.params), values))
        overlap = set(given) & set(named)
        if overlap:
            raise ShapeError(f"arguments given twice: {sorted(overlap)}")
        given.update(named)
        missing = [p.name for p in self.params if p.name not in given]
        if missing:
            raise ShapeError(f"missing kernel arguments {missing}; signature {self.signature}")
        for name, value in given.items():
            self.set(name, value)

    @property
    def signature(self) -> str:
        return "(" + ", ".join(f"{p.name}: {p.type}" for p in self.params) + ")"

    def set(self, name: str, value: Any) -> None:
        """Update one argument in place (a graph node built from these args sees it only after
        :meth:`GraphExec.update_kernel_args`; the next eager launch sees it at once)."""
        try:
            i = self._index[name]
        except KeyError:
            raise ShapeError(f"no kernel parameter {name!r}; signature {self.signature}") from None
        v = _as_value(self.params[i], value)
        if self.params[i].array:
            self._slots[i].raw = v
        else:
            self._slots[i].value = v
        if getattr(value, "ptr", None) is not None:
            self.buffers[name] = value
        else:
            self.buffers.pop(name, None)

    def get(self, name: str) -> Any:
        i = self._index[name]
        return bytes(self._slots[i].raw) if self.params[i].array else self._slots[i].value

    @property
    def address(self) -> int:
        """The ``void**`` address handed to the driver."""
        return ctypes.addressof(self._pointers)

    def snapshot(self) -> bytes:
        """The raw bytes of every argument value, in order (for recording and comparisons)."""
        return b"".join(bytes(s) for s in self._slots)

    def copy(self) -> "KernelArgs":
        """Independent storage holding the same values (recorded graph nodes own a copy)."""
        dup = KernelArgs.__new__(KernelArgs)
        dup.params, dup._index = self.params, self._index
        dup._slots = [_slot(p) for p in self.params]
        for p, mine, theirs in zip(self.params, self._slots, dup._slots):
            if p.array:
                theirs.raw = mine.raw
            else:
                theirs.value = mine.value
        dup._pointers = (ctypes.c_void_p * max(len(self.params), 1))(
            *[ctypes.addressof(s) for s in dup._slots]
        )
        dup.buffers = dict(self.buffers)
        return dup

    def __repr__(self) -> str:
        vals = ", ".join(f"{p.name}=<{p.array} bytes>" if p.array else
                         f"{p.name}={s.value:#x}" if p.type.bits == 64 and p.type.is_int else f"{p.name}={s.value}"
                         for p, s in zip(self.params, self._slots))
        return f"KernelArgs({vals})"
