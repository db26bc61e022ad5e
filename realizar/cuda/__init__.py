"""A thin runtime over ``cuda.bindings.driver``: devices, streams, events, buffers, modules, launches.

    from realizar import cuda
    if cuda.is_available():
        k = cuda.module_cache().get("vector_add", vec=4)
        with cuda.GpuBuffer.from_numpy(a) as da, ...:
            cuda.launch(k, grid, k.meta["block"], k.args(da, db, dout, n))

Without a GPU, ``cuda.EmulatedDevice()`` passed as ``device=`` (or ``REALIZAR_DEVICE=emulate``) runs
the same calls on the CPU PTX emulator.
"""

from realizar.cuda.args import KernelArgs
from realizar.cuda.device import Device, current_device
from realizar.cuda.graph import (
    ABReport, Graph, GraphCaptureError, GraphError, GraphExec, ab_check, build_graph, capture, record_graph,
)
from realizar.cuda.graph_cache import GRAPH_MODES, GraphCache
from realizar.cuda.driver import CudaError, CudaUnavailableError, is_available, unavailable_reason
from realizar.cuda.emulated import EmulatedDevice
from realizar.cuda.launch import (LaunchRecord, launch, pop_recorder, programmatic_dependent_launch, push_recorder,
                                  recording)
from realizar.cuda.memory import BufferFreedError, GpuBuffer
from realizar.cuda.module import CompiledKernel, JitError, ModuleCache, module_cache
from realizar.cuda.pinned import PinnedArray, StepValues
from realizar.cuda.stream import Event, Stream

__all__ = [
    "ABReport", "Graph", "GraphCaptureError", "GraphError", "GraphExec", "ab_check", "build_graph", "capture",
    "record_graph", "GRAPH_MODES", "GraphCache", "PinnedArray", "StepValues",
    "BufferFreedError", "CompiledKernel", "CudaError", "CudaUnavailableError", "Device", "EmulatedDevice", "Event",
    "GpuBuffer", "JitError", "KernelArgs", "LaunchRecord", "ModuleCache", "Stream", "current_device",
    "is_available", "launch", "programmatic_dependent_launch", "module_cache", "pop_recorder", "push_recorder",
    "recording", "unavailable_reason",
]
