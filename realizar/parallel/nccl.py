"""NCCL's C API through ctypes: communicators, all-reduce / all-gather on a stream, group calls.

The library is ``libnccl.so.2`` from NVIDIA's NCCL wheel (``pip install "realizar[multigpu]"``, which
pulls ``nvidia-nccl-cu13``: the CUDA 13 build that matches cuda-python 13; ``nvidia-nccl-cu12`` is the
CUDA 12 build of the same library). It is found, in this order, at the path in ``REALIZAR_NCCL_LIBRARY``,
in the wheel's ``nvidia/nccl/lib`` directory (located through the import system, without importing
anything), then by the dynamic loader's own search (a system-wide NCCL). :func:`load` says which.

**One process drives all N GPUs** (``ncclCommInitAll``, or ``ncclCommInitRank`` N times in a group with
one unique id), rather than one process per GPU. Why:

* realizar is one Python process with one scheduler, tokenizer and HTTP server; with one process
  per GPU, every request, sampled token and cancellation would have to cross processes each step.
* The decode step is a CUDA graph per GPU: launching N graphs from one thread costs N graph launches
  (microseconds each), which the GIL does not serialize in any way that matters at that rate.
* The sharded weights are cut from one memory-mapped GGUF file, read once.

What it costs: every collective that touches several communicators from this one thread must be
issued between :meth:`Nccl.group_start` and :meth:`Nccl.group_end` (use ``with nccl.group():``), or
NCCL may wait for a peer call that the same thread has not issued yet, a deadlock; and a crash of
one GPU's work takes the whole process down, as it would take down the TP group anyway.

Errors are :class:`NcclError`, carrying the call, the ``ncclResult_t`` code and its name,
``ncclGetErrorString``'s text and, where NCCL has one, ``ncclGetLastError``'s detail. Communicators are
released by :meth:`Communicator.destroy` (or ``with``), not by a finalizer: ``ncclCommDestroy`` waits
for outstanding work and must not run at interpreter shutdown in arbitrary order.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from realizar.errors import RealizarError

__all__ = [
    "NCCL_UNIQUE_ID_BYTES", "UniqueId", "Result", "DataType", "RedOp", "NcclError", "NcclUnavailableError",
    "Nccl", "Communicator", "SIGNATURES", "find_library", "load", "data_type",
]

LIBRARY_ENV = "REALIZAR_NCCL_LIBRARY"
SONAME = "libnccl.so.2"
NCCL_UNIQUE_ID_BYTES = 128


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes made by rank 0 and handed to every rank (passed by value)."""

    _fields_ = [("internal", ctypes.c_ubyte * NCCL_UNIQUE_ID_BYTES)]

    def to_bytes(self) -> bytes:
        return bytes(self.internal)

    @classmethod
    def from_bytes(cls, data: bytes) -> "UniqueId":
        if len(data) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an ncclUniqueId is {NCCL_UNIQUE_ID_BYTES} bytes, got {len(data)}")
        uid = cls()
        ctypes.memmove(uid.internal, data, NCCL_UNIQUE_ID_BYTES)
        return uid


class Result(enum.IntEnum):
    """``ncclResult_t``."""

    ncclSuccess = 0
    ncclUnhandledCudaError = 1
    ncclSystemError = 2
    ncclInternalError = 3
    ncclInvalidArgument = 4
    ncclInvalidUsage = 5
    ncclRemoteError = 6
    ncclInProgress = 7
    ncclTimeout = 8


class DataType(enum.IntEnum):
    """``ncclDataType_t``."""

    ncclInt8 = 0
    ncclUint8 = 1
    ncclInt32 = 2
    ncclUint32 = 3
    ncclInt64 = 4
    ncclUint64 = 5
    ncclFloat16 = 6
    ncclFloat32 = 7
    ncclFloat64 = 8
    ncclBfloat16 = 9


class RedOp(enum.IntEnum):
    """``ncclRedOp_t`` (the built-in reductions)."""

    ncclSum = 0
    ncclProd = 1
    ncclMax = 2
    ncclMin = 3
    ncclAvg = 4


_NUMPY_TYPES = {
    np.dtype(np.int8): DataType.ncclInt8, np.dtype(np.uint8): DataType.ncclUint8,
    np.dtype(np.int32): DataType.ncclInt32, np.dtype(np.uint32): DataType.ncclUint32,
    np.dtype(np.int64): DataType.ncclInt64, np.dtype(np.uint64): DataType.ncclUint64,
    np.dtype(np.float16): DataType.ncclFloat16, np.dtype(np.float32): DataType.ncclFloat32,
    np.dtype(np.float64): DataType.ncclFloat64,
}  # fmt: skip


def data_type(dtype: Any) -> DataType:
    """The NCCL type of a :class:`DataType`, a NumPy dtype, or ``"bf16"`` (NumPy has no bfloat16)."""
    if isinstance(dtype, DataType):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in ("bf16", "bfloat16"):
        return DataType.ncclBfloat16
    try:
        return _NUMPY_TYPES[np.dtype(dtype)]
    except (KeyError, TypeError):
        raise NcclError.invalid(f"NCCL has no data type for {dtype!r}") from None


# The C prototypes (nccl.h), as ctypes: name -> (restype, argtypes). ncclComm_t and cudaStream_t are
# opaque pointers; enums are C ints; ncclUniqueId goes by value to ncclCommInitRank.
_comm = ctypes.c_void_p
SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "ncclGetVersion": (ctypes.c_int, (ctypes.POINTER(ctypes.c_int),)),
    "ncclGetUniqueId": (ctypes.c_int, (ctypes.POINTER(UniqueId),)),
    "ncclCommInitRank": (ctypes.c_int, (ctypes.POINTER(_comm), ctypes.c_int, UniqueId, ctypes.c_int)),
    "ncclCommInitAll": (ctypes.c_int, (ctypes.POINTER(_comm), ctypes.c_int, ctypes.POINTER(ctypes.c_int))),
    "ncclCommDestroy": (ctypes.c_int, (_comm,)),
    "ncclCommFinalize": (ctypes.c_int, (_comm,)),
    "ncclCommCount": (ctypes.c_int, (_comm, ctypes.POINTER(ctypes.c_int))),
    "ncclCommCuDevice": (ctypes.c_int, (_comm, ctypes.POINTER(ctypes.c_int))),
    "ncclCommUserRank": (ctypes.c_int, (_comm, ctypes.POINTER(ctypes.c_int))),
    "ncclAllReduce": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     ctypes.c_int, _comm, ctypes.c_void_p)),
    "ncclAllGather": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     _comm, ctypes.c_void_p)),
    "ncclGroupStart": (ctypes.c_int, ()),
    "ncclGroupEnd": (ctypes.c_int, ()),
    "ncclGetErrorString": (ctypes.c_char_p, (ctypes.c_int,)),
    "ncclGetLastError": (ctypes.c_char_p, (_comm,)),
}


class NcclError(RealizarError, RuntimeError):
    """An NCCL call failed: ``call``, ``code`` (``ncclResult_t``), ``name`` (e.g. ``ncclInvalidArgument``),
    ``description`` (``ncclGetErrorString``) and ``detail`` (``ncclGetLastError``, may be empty)."""

    def __init__(self, call: str, code: int, description: str, detail: str = ""):
        self.call, self.code, self.description, self.detail = call, int(code), description, detail
        try:
            self.name = Result(self.code).name
        except ValueError:
            self.name = f"ncclResult {self.code}"
        msg = f"{call} failed: {self.name} ({self.code}): {description}"
        super().__init__(msg + (f" [{detail}]" if detail else ""))

    @classmethod
    def invalid(cls, message: str) -> "NcclError":
        """An argument refused before reaching NCCL (reported as ``ncclInvalidArgument``)."""
        return cls("argument check", Result.ncclInvalidArgument, message)


class NcclUnavailableError(RealizarError, RuntimeError):
    """``libnccl.so.2`` cannot be found or loaded here (``reason`` says where it was looked for)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"NCCL is not available: {reason}")


# ----------------------------------------------------------------------------------------------
# Finding and loading the library
# ----------------------------------------------------------------------------------------------


def _wheel_library() -> Path | None:
    """``nvidia/nccl/lib/libnccl.so.2`` of an installed NCCL wheel, found without importing it."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "lib" / SONAME
        if candidate.is_file():
            return candidate
    return None


def find_library() -> tuple[str, str]:
    """``(what to dlopen, where it came from)``: the ``REALIZAR_NCCL_LIBRARY`` path, the wheel's
    library, or the bare soname for the dynamic loader to search."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return env, f"${LIBRARY_ENV}"
    wheel = _wheel_library()
    if wheel is not None:
        return str(wheel), "the nvidia-nccl wheel"
    return SONAME, "the dynamic loader's search path"


_lock = threading.Lock()
_loaded: dict[str, "Nccl"] = {}


def load() -> "Nccl":
    """The process's :class:`Nccl` over the library :func:`find_library` names (loaded once);
    :class:`NcclUnavailableError` when it cannot be loaded."""
    path, origin = find_library()
    with _lock:
        if path not in _loaded:
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                hint = "" if origin.startswith("$") else ' (pip install "realizar[multigpu]")'
                raise NcclUnavailableError(f"cannot load {path} from {origin}: {e}{hint}") from None
            _loaded[path] = Nccl(lib, path=path, origin=origin)
        return _loaded[path]


# ----------------------------------------------------------------------------------------------
# The binding
# ----------------------------------------------------------------------------------------------


def _address(obj: Any, what: str) -> int | None:
    """A device pointer or stream as an integer: an int, ``None`` (the null stream), or anything with
    ``.ptr`` (realizar's DeviceBuffer and Stream)."""
    if obj is None:
        return None
    ptr = getattr(obj, "ptr", obj)
    if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)) or ptr < 0:
        raise NcclError.invalid(f"{what} must be an address (an int >= 0 or an object with .ptr), got {obj!r}")
    return int(ptr)


def _count(n: Any, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise NcclError.invalid(f"{what} must be an integer >= 0, got {n!r}")
    return int(n)


class Communicator:
    """One rank's ``ncclComm_t``. ``destroy()`` (or leaving a ``with`` block) frees it once."""

    def __init__(self, nccl: "Nccl", handle: int):
        self.nccl, self.handle = nccl, int(handle)

    @property
    def alive(self) -> bool:
        return self.handle != 0

    def _h(self) -> int:
        if not self.handle:
            raise NcclError("communicator use", Result.ncclInvalidUsage, "this communicator was destroyed")
        return self.handle

    @property
    def count(self) -> int:
        return self.nccl._int_out("ncclCommCount", self._h())

    @property
    def device(self) -> int:
        return self.nccl._int_out("ncclCommCuDevice", self._h())

    @property
    def rank(self) -> int:
        return self.nccl._int_out("ncclCommUserRank", self._h())

    def destroy(self) -> None:
        if self.handle:
            h, self.handle = self.handle, 0
            self.nccl._call("ncclCommDestroy", h)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"Communicator(0x{self.handle:x})" if self.handle else "Communicator(destroyed)"


class Nccl:
    """The NCCL functions of one loaded library. ``lib`` is what ``ctypes.CDLL`` returned (or any object
    with the same function attributes); every function gets its :data:`SIGNATURES` prototype."""

    def __init__(self, lib: Any, path: str = "", origin: str = ""):
        self.lib, self.path, self.origin = lib, path, origin
        self._fns: dict[str, Any] = {}
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(lib, name, None)
            if fn is None:
                if name in ("ncclGetLastError", "ncclCommFinalize"):  # NCCL < 2.13 / 2.14: optional
                    continue
                raise NcclUnavailableError(f"{path or lib} has no {name}: not an NCCL 2 library")
            fn.restype, fn.argtypes = restype, argtypes
            self._fns[name] = fn

    # -- errors --------------------------------------------------------------------------------------

    def error_string(self, code: int) -> str:
        s = self._fns["ncclGetErrorString"](int(code))
        return s.decode(errors="replace") if s else "unknown NCCL error"

    def last_error(self, comm: int | None = None) -> str:
        fn = self._fns.get("ncclGetLastError")
        s = fn(comm) if fn is not None else None
        return s.decode(errors="replace") if s else ""

    def _call(self, name: str, *args: Any, comm: int | None = None) -> None:
        code = self._fns[name](*args)
        if code != Result.ncclSuccess:
            raise NcclError(name, code, self.error_string(code), self.last_error(comm))

    def _int_out(self, name: str, comm: int) -> int:
        out = ctypes.c_int()
        self._call(name, comm, ctypes.byref(out), comm=comm)
        return out.value

    # -- the API ---------------------------------------------------------------------------------------

    def version(self) -> tuple[int, int, int]:
        """``(major, minor, patch)`` of the loaded library (``ncclGetVersion``; works without a GPU)."""
        v = ctypes.c_int()
        self._call("ncclGetVersion", ctypes.byref(v))
        code = v.value
        if code < 10000:  # NCCL <= 2.8 coded X*1000 + Y*100 + Z
            return code // 1000, code % 1000 // 100, code % 100
        return code // 10000, code % 10000 // 100, code % 100

    def unique_id(self) -> UniqueId:
        """A fresh ``ncclUniqueId`` (rank 0 makes it; every rank passes it to :meth:`comm_init_rank`)."""
        uid = UniqueId()
        self._call("ncclGetUniqueId", ctypes.byref(uid))
        return uid

    def comm_init_rank(self, nranks: int, uid: UniqueId, rank: int) -> Communicator:
        """``ncclCommInitRank``: this rank's communicator of ``nranks`` on the current CUDA device. From one
        thread for several ranks, issue the calls inside :meth:`group`."""
        nranks, rank = _count(nranks, "nranks"), _count(rank, "rank")
        if not 0 <= rank < nranks:
            raise NcclError.invalid(f"rank {rank} is outside 0..{nranks - 1}")
        if not isinstance(uid, UniqueId):
            raise NcclError.invalid(f"the unique id must be a UniqueId, got {type(uid).__name__}")
        comm = ctypes.c_void_p()
        self._call("ncclCommInitRank", ctypes.byref(comm), nranks, uid, rank)
        return Communicator(self, comm.value or 0)

    def comm_init_all(self, devices: Sequence[int]) -> list[Communicator]:
        """``ncclCommInitAll``: one communicator per CUDA device ordinal in ``devices``, rank i on
        ``devices[i]``, all driven by this process."""
        devs = [_count(d, "a device ordinal") for d in devices]
        if not devs:
            raise NcclError.invalid("ncclCommInitAll needs at least one device")
        if len(set(devs)) != len(devs):
            raise NcclError.invalid(f"devices must be distinct, got {devs}")
        comms = (ctypes.c_void_p * len(devs))()
        self._call("ncclCommInitAll", comms, len(devs), (ctypes.c_int * len(devs))(*devs))
        return [Communicator(self, c or 0) for c in comms]

    def destroy_all(self, comms: Sequence[Communicator]) -> None:
        """Destroy communicators this thread drives together (``comm_init_all``'s, or several ranks'): each is
        finalized first, all inside one group (``ncclCommFinalize``, NCCL >= 2.14), as NCCL asks of a thread that
        finalizes several, then destroyed. (Graphs that captured their collectives must be gone first.)"""
        live = [c for c in comms if c.alive]
        if "ncclCommFinalize" in self._fns and len(live) > 1:
            with self.group():
                for c in live:
                    self._call("ncclCommFinalize", c.handle, comm=c.handle)
        for c in live:
            c.destroy()

    def all_reduce(self, send: Any, recv: Any, count: int, dtype: Any, comm: Communicator,
                   stream: Any = None, op: RedOp = RedOp.ncclSum) -> None:
        """``ncclAllReduce`` of ``count`` elements on ``stream`` (in place when ``send`` is ``recv``)."""
        h = comm._h()
        self._call("ncclAllReduce", _address(send, "send"), _address(recv, "recv"), _count(count, "count"),
                   int(data_type(dtype)), int(RedOp(op)), h, _address(stream, "stream"), comm=h)

    def all_gather(self, send: Any, recv: Any, send_count: int, dtype: Any, comm: Communicator,
                   stream: Any = None) -> None:
        """``ncclAllGather``: ``recv`` gets every rank's ``send_count`` elements, in rank order."""
        h = comm._h()
        self._call("ncclAllGather", _address(send, "send"), _address(recv, "recv"),
                   _count(send_count, "send_count"), int(data_type(dtype)), h, _address(stream, "stream"), comm=h)

    def group_start(self) -> None:
        self._call("ncclGroupStart")

    def group_end(self) -> None:
        self._call("ncclGroupEnd")

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """``ncclGroupStart`` ... ``ncclGroupEnd``: the calls inside are issued as one, as a process
        driving several GPUs must. ``ncclGroupEnd`` is issued even when the block raises."""
        self.group_start()
        try:
            yield
        finally:
            self.group_end()
