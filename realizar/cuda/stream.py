"""Streams and events (their driver operations are the device's: see ``Device.stream_create``...)."""

from __future__ import annotations

import weakref

from realizar.cuda.device import Device, current_device


class Stream:
    """A non-blocking CUDA stream; ``Stream.null()`` is the legacy default stream."""

    def __init__(self, device: Device | None = None, *, _handle=None):
        self.device = device or current_device()
        if _handle is not None:
            self.handle = _handle
            self._finalizer = None
        else:
            self.handle = self.device.stream_create()
            self._finalizer = weakref.finalize(self, self.device.stream_release, self.handle)

    @classmethod
    def null(cls, device: Device | None = None) -> "Stream":
        device = device or current_device()
        return cls(device, _handle=device.null_stream())

    def synchronize(self) -> None:
        self.device.stream_synchronize(self.handle)

    def query(self) -> bool:
        """True when all work on the stream has completed."""
        return self.device.stream_query(self.handle)

    def wait(self, event: "Event") -> None:
        """Make future work on this stream wait for ``event``."""
        self.device.stream_wait(self.handle, event.handle)

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
        self.handle = self.device.event_create(timing)
        self._finalizer = weakref.finalize(self, self.device.event_release, self.handle)

    def record(self, stream: Stream | None = None) -> "Event":
        self.device.event_record(self.handle, stream)
        return self

    def synchronize(self) -> None:
        self.device.event_synchronize(self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to ``end`` (both must have completed)."""
        return self.device.event_elapsed_ms(self.handle, end.handle)

    def close(self) -> None:
        self._finalizer()
