"""The one error path over ``cuda.bindings.driver``: every call goes through :func:`call`."""

from __future__ import annotations

import threading
from typing import Any

from realizar.errors import RealizarError

try:  # cuda-python 13.x; the old `cuda.cuda` module is gone
    from cuda.bindings import driver as drv
except ImportError as exc:  # pragma: no cover - cuda-python is a hard dependency
    drv = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None


class CudaError(RealizarError, RuntimeError):
    """A CUDA driver call failed. Carries the call, the numeric code, the error name and string."""

    def __init__(self, call: str, code: int, name: str, description: str, detail: str = ""):
        self.call, self.code, self.name, self.description = call, code, name, description
        msg = f"{call} failed: {name} ({code}): {description}"
        super().__init__(msg + (f"\n{detail}" if detail else ""))


class CudaUnavailableError(CudaError):
    """No usable NVIDIA driver or device on this machine."""

    def __init__(self, reason: str):
        self.reason = reason
        RuntimeError.__init__(self, f"no GPU available: {reason}")
        self.call, self.code, self.name, self.description = "cuInit", -1, "CUDA_UNAVAILABLE", reason

    def __str__(self) -> str:
        return f"no GPU available: {self.reason}"


def error_name(code: Any) -> tuple[str, str]:
    """The driver's own name and description of a CUresult (falls back to the enum name)."""
    name, desc = getattr(code, "name", str(code)), "unknown error"
    try:
        err, s = drv.cuGetErrorName(code)
        if int(err) == 0 and s:
            name = s.decode()
        err, s = drv.cuGetErrorString(code)
        if int(err) == 0 and s:
            desc = s.decode()
    except Exception:  # the driver may be unusable, which is what we are reporting
        pass
    return name, desc


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple ``(CUresult, *values)``, raising :class:`CudaError` on failure."""
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if int(status) != 0:
        name, desc = error_name(status)
        raise CudaError(call, int(status), name, desc)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def call(fn_name: str, *args: Any) -> Any:
    """``call("cuMemAlloc", nbytes)``: invoke a driver function and check its status."""
    ensure_initialized()
    return check(getattr(drv, fn_name)(*args), fn_name)


_init_lock = threading.Lock()
_init_state: dict[str, Any] = {}


def ensure_initialized() -> None:
    """``cuInit(0)`` once per process; raise :class:`CudaUnavailableError` if there is no GPU.

    Without a driver, cuda-python raises a RuntimeError subclass from ``cuInit`` instead of
    returning an error code; both forms become CudaUnavailableError.
    """
    if _init_state.get("ok"):  # fast path: every driver call comes through here
        return
    with _init_lock:
        if "error" in _init_state:
            raise _init_state["error"]
        if _init_state.get("ok"):
            return
        try:
            if drv is None:
                raise CudaUnavailableError(f"cuda-python is not importable ({_IMPORT_ERROR})")
            try:
                status = drv.cuInit(0)
            except RuntimeError as exc:  # libcuda.so not found
                raise CudaUnavailableError(f"the NVIDIA driver library could not be loaded ({exc})") from exc
            status = status[0] if isinstance(status, tuple) else status
            if int(status) != 0:
                name, desc = error_name(status)
                raise CudaUnavailableError(f"cuInit failed: {name}: {desc}")
            count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
            if count == 0:
                raise CudaUnavailableError("the driver reports no CUDA devices")
        except CudaUnavailableError as exc:
            _init_state["error"] = exc
            raise
        _init_state["ok"] = True


def is_available() -> bool:
    """True when a CUDA driver and at least one device are usable; never raises."""
    try:
        ensure_initialized()
    except CudaError:
        return False
    return True


def unavailable_reason() -> str | None:
    """Why :func:`is_available` is False (None when a GPU is available)."""
    try:
        ensure_initialized()
    except CudaUnavailableError as exc:
        return exc.reason
    except CudaError as exc:
        return str(exc)
    return None


# ---- releasing resources from finalizers --------------------------------------------------------
# A finalizer may run at any moment, also while a stream is being captured into a graph, and a
# cuMemFree/cuStreamDestroy issued then would invalidate the capture (global capture mode forbids
# such calls from any thread). Releases that arrive during a capture are queued and issued after it.
_capture_depth = 0
_pending_releases: list[tuple[str, Any]] = []
_release_lock = threading.Lock()


def release(fn_name: str, handle: Any) -> None:
    """Call driver function ``fn_name(handle)`` now, or after the active capture ends; never raises."""
    with _release_lock:
        if _capture_depth:
            _pending_releases.append((fn_name, handle))
            return
    try:
        getattr(drv, fn_name)(handle)
    except Exception:  # at interpreter exit the driver may already be gone
        pass


def begin_capture_scope() -> None:
    global _capture_depth
    with _release_lock:
        _capture_depth += 1


def end_capture_scope() -> None:
    global _capture_depth
    with _release_lock:
        _capture_depth -= 1
        pending = list(_pending_releases) if _capture_depth == 0 else []
        if pending:
            _pending_releases.clear()
    for fn_name, handle in pending:
        release(fn_name, handle)
