"""The module cache: PTX -> loaded CUfunction, once per (kernel, shape, target) per process."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ptx_gen.catalog import PtxKernel, emit
from realizar.cuda.args import KernelArgs
from realizar.cuda.device import Device, current_device
from realizar.cuda.driver import CudaError, call, drv, ensure_initialized

_LOG_BYTES = 64 * 1024


class JitError(CudaError):
    """The driver's JIT rejected a PTX module; ``log`` is its error log, ``ptx_path`` the saved input."""

    def __init__(self, base: CudaError, log: str, ptx_path: Path, kernel: str):
        self.log, self.ptx_path, self.kernel = log, ptx_path, kernel
        CudaError.__init__(
            self, base.call, base.code, base.name, base.description,
            f"kernel {kernel}: JIT log:\n{log.strip() or '(empty)'}\nPTX kept at {ptx_path}",
        )


@dataclass
class CompiledKernel:
    """A loaded kernel: its function handle, parameter signature and launch hints."""

    source: PtxKernel
    function: object  # CUfunction
    module: object  # CUmodule (kept alive with the function)
    info_log: str = ""
    _dynamic_shared_limit: int = field(default=48 * 1024)
    launcher = None  # (not a field) an emulated kernel's runner; None: launched through the driver

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def meta(self) -> dict:
        return self.source.meta

    @property
    def launch(self):
        """The generator's launch hints (:class:`ptx_gen.catalog.LaunchHints`)."""
        return self.source.launch

    def args(self, *values, **named) -> KernelArgs:
        """Pack kernel arguments (positional or by parameter name) into reusable ctypes storage."""
        return KernelArgs(self.source.params, *values, **named)

    def ensure_dynamic_shared(self, nbytes: int) -> None:
        """Raise the kernel's dynamic shared-memory limit when a launch needs more than 48 KiB."""
        if nbytes > self._dynamic_shared_limit:
            attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            call("cuFuncSetAttribute", self.function, attr, int(nbytes))
            self._dynamic_shared_limit = int(nbytes)


class ModuleCache:
    """Loads PTX with ``cuModuleLoadDataEx`` (capturing JIT info/error logs), keyed by kernel+shape+target.

    With ``disk_dir`` (or ``$REALIZAR_CUBIN_CACHE``) the JIT's cubin output is not available through
    the driver API, so instead the assembled cubin from ptxas (when ptxas is installed) is stored
    there by PTX hash and loaded directly next time, skipping the JIT.
    """

    def __init__(self, device: Device | None = None, disk_dir: str | Path | None = None):
        self.device = device or current_device()
        self._kernels: dict[tuple, CompiledKernel] = {}
        self._lock = threading.Lock()
        disk_dir = disk_dir or os.environ.get("REALIZAR_CUBIN_CACHE")
        self.disk_dir = Path(disk_dir) if disk_dir else None
        self.loads = 0  # number of modules actually loaded (tests check kernels compile once)

    def get(self, name: str, **shape) -> CompiledKernel:
        """The kernel ``name`` of the catalog for ``shape`` on this device's target."""
        return self.load(emit(name, target=self.device.target.sm, **shape))

    def load(self, source: PtxKernel) -> CompiledKernel:
        with self._lock:
            hit = self._kernels.get(source.key)
            if hit is not None:
                return hit
            compiled = self.device.load_kernel(source, self)
            self._kernels[source.key] = compiled
            self.loads += 1
            return compiled

    def _load_module(self, source: PtxKernel):
        image = self._cached_cubin(source)
        if image is None:
            image = source.ptx.encode() + b"\0"
        opt = drv.CUjit_option
        options = [
            opt.CU_JIT_INFO_LOG_BUFFER,
            opt.CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
            opt.CU_JIT_ERROR_LOG_BUFFER,
            opt.CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
            opt.CU_JIT_LOG_VERBOSE,
        ]
        ensure_initialized()
        # cuda-python passes the log buffers to the driver as char*; the driver writes into them.
        info_buf, err_buf = bytearray(_LOG_BYTES), bytearray(_LOG_BYTES)
        values = [info_buf, _LOG_BYTES, err_buf, _LOG_BYTES, 1]
        result = drv.cuModuleLoadDataEx(image, len(options), options, values)
        status = result[0]
        if int(status) != 0:
            from realizar.cuda.driver import check

            try:
                check(result, "cuModuleLoadDataEx")
            except CudaError as base:
                log = _c_string(err_buf) + _c_string(info_buf)
                raise JitError(base, log, _keep_ptx(source), source.name) from None
        return result[1], _c_string(info_buf)

    def _cached_cubin(self, source: PtxKernel) -> bytes | None:
        if self.disk_dir is None:
            return None
        digest = hashlib.sha256(source.ptx.encode()).hexdigest()[:32]
        path = self.disk_dir / f"{source.name}-{source.target}-{digest}.cubin"
        if path.is_file():
            return path.read_bytes()
        try:
            from ptx_gen.ptxas import assemble

            cubin = assemble(source.ptx, source.target)[0].cubin
        except Exception:  # no ptxas here, or it disagrees: fall back to the driver's JIT
            return None
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(cubin)
        tmp.replace(path)
        return cubin


def _c_string(buf: bytes | bytearray) -> str:
    return bytes(buf).split(b"\0", 1)[0].decode(errors="replace")


def _keep_ptx(source: PtxKernel) -> Path:
    """Save rejected PTX for inspection; the path goes into the JitError."""
    fd, name = tempfile.mkstemp(prefix=f"realizar-{source.name}-", suffix=".ptx")
    with os.fdopen(fd, "w") as f:
        f.write(source.ptx)
    return Path(name)


_default_caches: dict[object, ModuleCache] = {}


def module_cache(device: Device | None = None) -> ModuleCache:
    """The process-wide module cache of ``device`` (default :func:`current_device`)."""
    device = device or current_device()
    key = device.ordinal if not device.emulated else device  # each emulated device has its own
    if key not in _default_caches:
        _default_caches[key] = ModuleCache(device)
    return _default_caches[key]
