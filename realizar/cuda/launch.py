"""The one launch function. Every kernel launch in realizar goes through :func:`launch`, so graph
recording (``realizar.cuda.graph``) hooks this single place and no kernel can be left out."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence

from realizar.cuda.args import KernelArgs
from realizar.cuda.driver import check, drv, ensure_initialized
from realizar.cuda.module import CompiledKernel
from realizar.cuda.stream import Stream
from realizar.errors import ShapeError

Dim = int | Sequence[int]
_PDL_TARGETS = ("sm_90", "sm_90a")  # targets whose kernels start with griddepcontrol.wait


def _dim3(d: Dim, what: str) -> tuple[int, int, int]:
    t = (int(d),) if isinstance(d, int) else tuple(int(x) for x in d)
    if not 1 <= len(t) <= 3 or any(x < 1 for x in t):
        raise ShapeError(f"{what} must be 1 to 3 positive extents, got {d!r}")
    return (t + (1, 1))[:3]


@dataclass
class LaunchRecord:
    """Everything needed to replay one launch as a graph kernel node."""

    kernel: CompiledKernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: KernelArgs  # a private copy: later changes to the caller's args do not leak in
    stream: Stream | None

    def relaunch(self, stream: Stream | None = None) -> None:
        """Issue this launch again, on ``stream`` (default: the recorded one)."""
        launch(self.kernel, self.grid, self.block, self.args, self.shared_bytes,
               self.stream if stream is None else stream)


class LaunchRecorder(Protocol):
    def record(self, launch: LaunchRecord) -> None: ...


class LaunchList(list):
    """A :class:`LaunchRecorder` that is the list of the launches it was handed."""

    record = list.append


_local = threading.local()


def _recorders() -> list:
    if not hasattr(_local, "recorders"):
        _local.recorders = []
    return _local.recorders


def push_recorder(recorder: LaunchRecorder) -> None:
    """Start handing every launch on this thread to ``recorder`` (launches still run eagerly)."""
    _recorders().append(recorder)


def pop_recorder(recorder: LaunchRecorder) -> None:
    stack = _recorders()
    if not stack or stack[-1] is not recorder:
        raise RuntimeError("launch recorders must be popped in the order they were pushed")
    stack.pop()


@contextlib.contextmanager
def recording() -> Iterator[LaunchList]:
    """Within the block, every launch on this thread (still run eagerly) is appended to the yielded list."""
    launches = LaunchList()
    push_recorder(launches)
    try:
        yield launches
    finally:
        pop_recorder(launches)


@contextlib.contextmanager
def programmatic_dependent_launch(enabled: bool = True) -> Iterator[None]:
    """Within the block, launches of sm_90 kernels on this thread allow programmatic dependent launch:
    the next kernel's blocks may be scheduled while the previous kernel finishes (every sm_90 kernel
    begins with ``griddepcontrol.wait``, so it still reads only completed results). Captured into a
    graph, this becomes programmatic edges, shaving launch latency off each node."""
    previous = getattr(_local, "pdl", False)
    _local.pdl = enabled
    try:
        yield
    finally:
        _local.pdl = previous


def _launch_programmatic(kernel: CompiledKernel, g, b, shared_bytes: int, handle, args: KernelArgs) -> None:
    cfg = drv.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = g
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = b
    cfg.sharedMemBytes = int(shared_bytes)
    cfg.hStream = handle
    attr = drv.CUlaunchAttribute()
    attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    check(drv.cuLaunchKernelEx(cfg, kernel.function, args.address, 0), f"cuLaunchKernelEx({kernel.name})")


def launch(
    kernel: CompiledKernel,
    grid: Dim,
    block: Dim,
    args: KernelArgs,
    shared_bytes: int = 0,
    stream: Stream | None = None,
) -> None:
    """Launch ``kernel`` on ``grid`` x ``block`` with packed ``args`` on ``stream`` (default: null)."""
    g, b = _dim3(grid, "grid"), _dim3(block, "block")
    if b[0] * b[1] * b[2] > 1024:
        raise ShapeError(f"block {b} has more than 1024 threads")
    if args.params != kernel.source.params:
        raise ShapeError(f"arguments {args.signature} do not match kernel {kernel.name}")
    if shared_bytes:
        kernel.ensure_dynamic_shared(shared_bytes)
    runner = kernel.launcher
    if runner is not None:  # a kernel of an EmulatedDevice
        runner(kernel, g, b, int(shared_bytes), stream, args)
    else:
        ensure_initialized()
        handle = stream.handle if stream is not None else drv.CUstream(0)
        if getattr(_local, "pdl", False) and kernel.source.target in _PDL_TARGETS:
            _launch_programmatic(kernel, g, b, shared_bytes, handle, args)
        else:
            check(
                drv.cuLaunchKernel(kernel.function, *g, *b, int(shared_bytes), handle, args.address, 0),
                f"cuLaunchKernel({kernel.name})",
            )
    for recorder in _recorders():
        recorder.record(LaunchRecord(kernel, g, b, int(shared_bytes), args.copy(), stream))
