"""Streams and events."""

from __future__ import annotations

import weakref

from realizar.cuda.device import Device, current_device
from realizar.cuda.driver import call, drv, release




class Stream:
    """A non-blocking CUDA stream; ``Stream.null()`` is the legacy default stream."""

    def __init__(self, device: Device | None = None, *, _handle=None):
        self.device = device or current_device()
        if _handle is not None:
            self.handle = _handle
            self._finalizer = None
        else:
            flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
            self.handle = call("cuStreamCreate", flags)
            self._finalizer = weakref.finalize(self, release, "cuStreamDestroy", self.handle)

    @classmethod
    def null(cls, device: Device | None = None) -> "Stream":
        return cls(device, _handle=drv.CUstream(0))

    def synchronize(self) -> None:
        call("cuStreamSynchronize", self.handle)

    def query(self) -> bool:
        """True when all work on the stream has completed."""
        status = drv.cuStreamQuery(self.handle)[0]
        if status == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        call("cuStreamQuery", self.handle)  # raises on real errors
        return True

    def wait(self, event: "Event") -> None:
        """Make future work on this stream wait for ``event``."""
        call("cuStreamWaitEvent", self.handle, event.handle, 0)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def ptr(self) -> int:
        return int(self.handle)


class Event:
    """A CUDA event for ordering and timing (``elapsed_ms`` between two recorded events)."""

    def __init__(self, timing: bool = True, device: Device | None = None):
        self.device = device or current_device()
        flags = drv.CUevent_flags.CU_EVENT_DEFAULT if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = call("cuEventCreate", flags)
        self._finalizer = weakref.finalize(self, release, "cuEventDestroy", self.handle)

    def record(self, stream: Stream | None = None) -> "Event":
        call("cuEventRecord", self.handle, stream.handle if stream else drv.CUstream(0))
        return self

    def synchronize(self) -> None:
        call("cuEventSynchronize", self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both must have completed)."""
        return float(call("cuEventElapsedTime", self.handle, end.handle))

    def close(self) -> None:
        self._finalizer()
