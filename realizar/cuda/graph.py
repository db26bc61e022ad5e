"""CUDA graphs, two ways: stream capture, and manual construction from recorded launches.

Manual construction is the Rust original's answer to drivers whose stream capture failed. There,
each dispatch function had to remember to record itself and a kernel without the hook silently fell
out of the graph. Here recording hooks :func:`realizar.cuda.launch.launch`, the only way to launch,
so a recording sees every kernel.

    with cuda.record_graph(stream) as rec:      # launches run eagerly AND are recorded
        model.decode_step(...)
    exe = rec.graph.instantiate()
    step.set(pos=7); exe.replay(stream, step)   # per-step values: one async copy, then the graph

On an EmulatedDevice a graph has no driver handle (``handle is None``): it is its list of launch
records, and a replay runs them again, in order, on the emulator.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from realizar.cuda.args import KernelArgs
from realizar.cuda.driver import CudaError, begin_capture_scope, call, check, drv, end_capture_scope, release
from realizar.cuda.launch import LaunchList, LaunchRecord, pop_recorder, push_recorder, recording
from realizar.cuda.memory import BufferFreedError
from realizar.cuda.pinned import StepValues
from realizar.cuda.stream import Stream
from realizar.errors import RealizarError


class GraphError(RealizarError, RuntimeError):
    """A graph could not be built, instantiated, updated or replayed."""


class GraphCaptureError(GraphError):
    """Stream capture failed or was invalidated (e.g. a synchronous call inside the capture)."""


def _no_release() -> None:
    """The finalizer of an emulated graph: nothing to release."""


class Graph:
    """A graph template and the launches it contains (whose argument storage it owns)."""

    def __init__(self, handle, records: list[LaunchRecord], nodes: list | None = None, kind: str = "captured"):
        self.handle = handle
        self.records = records
        self.nodes = nodes or []
        self.kind = kind
        self._finalizer = weakref.finalize(self, *((release, "cuGraphDestroy", handle) if handle is not None
                                                   else (_no_release,)))

    @property
    def num_kernels(self) -> int:
        return len(self.records)

    def node_count(self) -> int:
        """Nodes the driver sees in the graph (equals num_kernels for kernel-only graphs)."""
        if self.handle is None:
            return len(self.records)
        _, n = check(drv.cuGraphGetNodes(self.handle, 0), "cuGraphGetNodes")
        return int(n)

    def instantiate(self) -> "GraphExec":
        exe = call("cuGraphInstantiate", self.handle, 0) if self.handle is not None else None
        return GraphExec(exe, self)

    def close(self) -> None:
        self._finalizer()


class GraphExec:
    """An executable graph. Replays check that every buffer its kernels reference is still alive."""

    def __init__(self, handle, graph: Graph):
        self.handle = handle
        self.graph = graph
        self._buffers = self._referenced_buffers()
        self._finalizer = weakref.finalize(self, *((release, "cuGraphExecDestroy", handle) if handle is not None
                                                   else (_no_release,)))

    def _referenced_buffers(self) -> list:
        """Each distinct buffer the graph's kernels use, once (checked on every replay)."""
        seen: dict[int, object] = {}
        for rec in self.graph.records:
            for buf in rec.args.buffers.values():
                seen.setdefault(id(buf), buf)
        return list(seen.values())

    def _check_buffers(self) -> None:
        for buf in self._buffers:
            if not buf.alive:
                for i, rec in enumerate(self.graph.records):
                    for name, b in rec.args.buffers.items():
                        if b is buf:
                            raise BufferFreedError(
                                f"graph node {i} ({rec.kernel.name}) references argument {name!r}, a "
                                "freed GpuBuffer: rebuild the graph after reallocating"
                            )

    def launch(self, stream: Stream) -> None:
        if not self._finalizer.alive:
            raise GraphError("replay of a closed graph")
        self._check_buffers()
        if self.handle is None:  # emulated: run the recorded launches again
            for rec in self.graph.records:
                rec.kernel.launcher(rec.kernel, rec.grid, rec.block, rec.shared_bytes, stream, rec.args)
            return
        check(drv.cuGraphLaunch(self.handle, stream.handle), "cuGraphLaunch")

    def replay(self, stream: Stream, step: StepValues | None = None) -> None:
        """Upload this step's values (one async copy), then launch the graph, both on ``stream``."""
        if step is not None:
            step.upload(stream)
        self.launch(stream)

    def update(self, graph: Graph) -> None:
        """Take the parameters of a re-captured/re-recorded graph of the same topology
        (``cuGraphExecUpdate``); raise GraphError with the driver's reason when it cannot."""
        if self.handle is None:
            if [r.kernel.source.key for r in graph.records] != [r.kernel.source.key for r in self.graph.records]:
                raise GraphError("cannot update an emulated graph with one of other kernels")
        else:
            status, info = drv.cuGraphExecUpdate(self.handle, graph.handle)
            if int(status) != 0:
                raise GraphError(f"cuGraphExecUpdate refused the new graph: {info.result.name}")
        self.graph = graph
        self._buffers = self._referenced_buffers()

    def set_kernel_args(self, node: int, args: KernelArgs) -> None:
        """Change one kernel node's arguments in the executable graph (manually built graphs)."""
        if not self.graph.nodes:
            raise GraphError("kernel-node parameters can only be set on manually built graphs")
        rec = self.graph.records[node]
        if args.params != rec.kernel.source.params:
            raise GraphError(f"node {node} runs {rec.kernel.name}{args.signature}: signature mismatch")
        owned = args.copy()
        if self.handle is not None:
            params = _node_params(LaunchRecord(rec.kernel, rec.grid, rec.block, rec.shared_bytes, owned, rec.stream))
            call("cuGraphExecKernelNodeSetParams", self.handle, self.graph.nodes[node], params)
        rec.args = owned  # the driver copied the values; the record mirrors what the node now runs
        self._buffers = self._referenced_buffers()

    def close(self) -> None:
        self._finalizer()


def _node_params(rec: LaunchRecord):
    p = drv.CUDA_KERNEL_NODE_PARAMS()
    p.func = rec.kernel.function
    p.gridDimX, p.gridDimY, p.gridDimZ = rec.grid
    p.blockDimX, p.blockDimY, p.blockDimZ = rec.block
    p.sharedMemBytes = rec.shared_bytes
    p.kernelParams = rec.args.address
    p.extra = 0
    return p


@dataclass
class Capture:
    """Result holder of :func:`capture`; ``graph`` is set when the ``with`` block ends."""

    stream: Stream
    graph: Graph | None = None


@contextlib.contextmanager
def capture(stream: Stream, mode: str = "global") -> Iterator[Capture]:
    """Capture the work issued on ``stream`` inside the block into a :class:`Graph`.

    ``mode`` is the driver's capture mode: "global" (unsafe calls anywhere fail), "thread_local"
    or "relaxed". A synchronous call inside the capture invalidates it: that surfaces as
    :class:`GraphCaptureError` naming the cause.
    """
    modes = {
        "global": drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL,
        "thread_local": drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        "relaxed": drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED,
    }
    if mode not in modes:
        raise GraphError(f"unknown capture mode {mode!r}; expected one of {sorted(modes)}")
    result = Capture(stream)
    recorder = LaunchList()
    if stream.device.emulated:  # launches on the stream are recorded, not run
        stream.device.begin_capture(stream)
        push_recorder(recorder)
        try:
            yield result
        finally:
            pop_recorder(recorder)
            stream.device.end_capture(stream)
        # as a driver's capture, the graph holds only the captured stream's work: launches on other
        # streams inside the block ran eagerly (EmulatedDevice.launch_kernel) and must not replay
        ours = [r for r in recorder if r.stream is stream]
        result.graph = Graph(None, ours, kind="captured")
        return
    begin_capture_scope()  # finalizers now queue their frees instead of invalidating the capture
    try:
        call("cuStreamBeginCapture", stream.handle, modes[mode])
    except BaseException:
        end_capture_scope()
        raise
    push_recorder(recorder)
    body_error: BaseException | None = None
    try:
        yield result
    except BaseException as exc:  # end the capture whatever happened, then report
        body_error = exc
    finally:
        pop_recorder(recorder)
        status, handle = drv.cuStreamEndCapture(stream.handle)
        end_capture_scope()
    if body_error is not None:
        if int(status) == 0 and handle:
            release("cuGraphDestroy", handle)
        if isinstance(body_error, CudaError):
            raise GraphCaptureError(
                f"stream capture failed inside the captured region: {body_error} "
                "(synchronous calls, blocking copies and null-stream work are not allowed while capturing)"
            ) from body_error
        raise body_error
    if int(status) != 0:
        try:
            check((status,), "cuStreamEndCapture")
        except CudaError as exc:
            raise GraphCaptureError(
                f"stream capture was invalidated: {exc} (an operation that is illegal during "
                "capture ran on this or the legacy default stream)"
            ) from exc
    result.graph = Graph(handle, recorder, kind="captured")


@dataclass
class Recording:
    """Result holder of :func:`record_graph`; ``graph`` is set when the ``with`` block ends."""

    dependencies: str
    records: list[LaunchRecord]
    graph: Graph | None = None


@contextlib.contextmanager
def record_graph(dependencies: str = "chain") -> Iterator[Recording]:
    """Run the block eagerly while recording every launch, then build a graph of kernel nodes.

    ``dependencies``: "chain" links node i to node i-1 (the eager order); "buffers" derives edges
    from shared buffer arguments (each buffer argument counts as read and written), letting
    independent kernels run concurrently.
    """
    if dependencies not in ("chain", "buffers"):
        raise GraphError(f"dependencies must be 'chain' or 'buffers', got {dependencies!r}")
    with recording() as launches:
        rec = Recording(dependencies, launches)
        yield rec
    rec.graph = build_graph(launches, dependencies)


def build_graph(records: list[LaunchRecord], dependencies: str = "chain") -> Graph:
    """Add one kernel node per record with ``cuGraphAddKernelNode``."""
    if not records:
        raise GraphError("no kernel launches were recorded: an empty graph would do nothing")
    if records[0].kernel.launcher is not None:  # emulated: replayed in the recorded (eager) order
        return Graph(None, list(records), list(range(len(records))), kind="manual")
    handle = call("cuGraphCreate", 0)
    graph_nodes: list = []
    try:
        last_touch: dict[int, int] = {}
        for i, rec in enumerate(records):
            if dependencies == "chain":
                deps = [graph_nodes[i - 1]] if i else []
            else:
                ptrs = {int(b.ptr) for b in rec.args.buffers.values()}
                deps = [graph_nodes[j] for j in sorted({last_touch[p] for p in ptrs if p in last_touch})]
                for p in ptrs:
                    last_touch[p] = i
            node = call("cuGraphAddKernelNode", handle, deps, len(deps), _node_params(rec))
            graph_nodes.append(node)
    except BaseException:
        release("cuGraphDestroy", handle)
        raise
    return Graph(handle, list(records), graph_nodes, kind="manual")


@dataclass
class ABReport:
    """Buffers whose contents differed between eager execution and graph replay."""

    compared: int
    mismatches: list[tuple[str, int, int]]  # (buffer description, differing bytes, first byte index)

    @property
    def identical(self) -> bool:
        return not self.mismatches


def ab_check(exe: GraphExec, reset: Callable[[], None], stream: Stream) -> ABReport:
    """Run the graph's launches eagerly and by replay from the same state; compare every buffer.

    ``reset`` restores all inputs/state (e.g. re-uploads inputs, truncates a KV cache) and is called
    before each of the two runs. Bit-identical results are expected: the same kernels run with the
    same arguments in the same order.
    """
    buffers: dict[int, tuple[str, object]] = {}
    for i, rec in enumerate(exe.graph.records):
        for name, buf in rec.args.buffers.items():
            buffers.setdefault(int(buf.ptr), (f"node {i} {rec.kernel.name}.{name}", buf))

    def snapshot() -> dict[int, np.ndarray]:
        stream.synchronize()
        return {p: b.copy_to_host().view(np.uint8) for p, (_, b) in buffers.items()}

    reset()
    stream.synchronize()
    for rec in exe.graph.records:
        rec.relaunch(stream)
    eager = snapshot()
    reset()
    stream.synchronize()
    exe.launch(stream)
    replayed = snapshot()
    mismatches = []
    for p, (desc, _) in buffers.items():
        diff = np.flatnonzero(eager[p] != replayed[p])
        if diff.size:
            mismatches.append((desc, int(diff.size), int(diff[0])))
    return ABReport(len(buffers), mismatches)
