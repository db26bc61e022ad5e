"""The one dispatcher every GPU op family builds on.

A :class:`Dispatcher` owns, for one device: the kernel memo (name + shape -> compiled kernel, over
``cuda.module_cache(device)``), the launch shape taken from the kernel's typed hints
(:class:`ptx_gen.catalog.LaunchHints`, read in :meth:`Dispatcher.launch` only), the cache of packed kernel arguments (a
launch with the same values reuses its :class:`~realizar.cuda.KernelArgs`), the checks of device
operands (size, dtype, alignment) and of integer arguments, device allocations, and the one call to
:func:`realizar.cuda.launch`. Op families (:mod:`realizar.gpu.gemv`, :mod:`~realizar.gpu.norms`, ...)
are mixins on it; the KV caches share one instance. Nothing here
synchronises, so launches issued through it can be captured into a CUDA graph.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ptx_gen.catalog import LaunchHints
from realizar import cuda
from realizar.cuda.memory import device_address, is_buffer_arg
from realizar.errors import ShapeError

__all__ = ["Dispatcher", "LaunchHints", "check_int", "is_buffer_arg"]

# shared-memory sizes (KB) an SM can be configured with (sm_80..sm_90), up to its maximum
_CARVEOUTS_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
_ARGS_CACHE_LIMIT = 8192  # distinct argument packs kept (a decode step needs a few hundred)


def check_int(name: str, value: Any, lo: int = 1) -> int:
    """``value`` as an int, or ShapeError unless it is an integer (not a bool) of at least ``lo``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < lo:
        what = "a positive integer" if lo == 1 else "a non-negative integer" if lo == 0 else f"an integer >= {lo}"
        raise ShapeError(f"{name} must be {what}, got {value!r}")
    return int(value)


class Dispatcher:
    """Kernel memo, launch configuration, argument cache and operand checks on one device."""

    def __init__(self, device: Any = None):
        self.device = device or cuda.current_device()
        self.kernels = cuda.module_cache(self.device)
        self.sm_count = self.device.sm_count
        self._memo: dict[tuple, Any] = {}
        self._args_cache: dict[tuple, Any] = {}

    # ---- kernels and their launch configuration ------------------------------------------------------
    def kernel(self, name: str, **shape) -> Any:
        """The compiled catalog kernel ``name`` of ``shape`` (loaded once; with its L1 preference set)."""
        key = (name, *sorted(shape.items()))
        k = self._memo.get(key)
        if k is None:
            k = self._memo[key] = self.kernels.get(name, **shape)
            if k.launch.l1_bytes:
                self._keep_l1(k, k.launch)
        return k

    def _keep_l1(self, kern: Any, hints: LaunchHints) -> None:
        """Prefer a shared-memory carveout that leaves ``hints.l1_bytes`` of L1 (the split GEMV's x
        vector, re-read by every warp): by default the driver sizes shared memory for the highest
        occupancy, which for kernels staging kilobytes per warp can shrink L1 to 28 KB. The preference
        is a percentage of the SM's maximum shared memory that the driver rounds up to a supported
        size, so the largest supported size that fits is asked for, rounded down."""
        max_smem = self.device.attribute("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
        unified = max_smem + 28 * 1024  # L1 + shared per SM: 192 KB (sm_80), 256 KB (sm_90), 128 KB (sm_86/89)
        want = max(hints.smem, unified - hints.l1_bytes)
        sizes = [kb * 1024 for kb in _CARVEOUTS_KB if kb * 1024 <= max_smem]
        fits = [s for s in sizes if s <= want]
        size = fits[-1] if fits and fits[-1] >= hints.smem else next((s for s in sizes if s >= hints.smem), max_smem)
        self.device.set_shared_carveout(kern, max(1, size * 100 // max_smem))

    # ---- arguments and launches ----------------------------------------------------------------------
    def args(self, kern: Any, values: dict, buffers: dict | None = None, cache: bool = True) -> Any:
        """Packed arguments for ``values``; ``buffers`` names further GpuBuffers the launch depends on
        (owners of offset operands: graphs check they are still alive). With ``cache`` the pack is kept
        and reused by a later launch with the same values and buffers."""
        key = None
        if cache:
            key = (kern.source.key, tuple(values.items()))
            if buffers:
                # the same addresses in new buffers (freed and reallocated) must not reuse stale packs
                key += tuple(id(b) for b in buffers.values())
            hit = self._args_cache.get(key)
            if hit is not None and (not hit.buffers or all(getattr(b, "alive", True) for b in hit.buffers.values())):
                return hit
        args = kern.args(**values)
        if buffers:
            args.buffers.update(buffers)
        if key is not None:
            if len(self._args_cache) > _ARGS_CACHE_LIMIT:
                self._args_cache.clear()
            self._args_cache[key] = args
        return args

    def launch(self, kern: Any, grid: Any, values: dict, stream: Any = None, *, buffers: dict | None = None,
               cache: bool = True, shared_bytes: int | None = None) -> None:
        """Launch ``kern`` on ``grid`` with the block and dynamic shared memory its hints ask for (or
        ``shared_bytes``, at least the hint's)."""
        args = self.args(kern, values, buffers, cache)
        hints = kern.launch
        shared = hints.dyn_smem if shared_bytes is None else max(int(shared_bytes), hints.dyn_smem)
        cuda.launch(kern, grid, hints.block, args, shared_bytes=shared, stream=stream)

    # ---- operands and allocations --------------------------------------------------------------------
    @staticmethod
    def operand(x: Any, count: int, what: str, dtype=np.float32, align: int = 16) -> tuple[int, Any]:
        """(device address, owning buffer) of a GpuBuffer or ``(GpuBuffer, element offset)`` holding at
        least ``count`` elements of ``dtype`` at an ``align``-byte aligned address."""
        return device_address(x, count, what, dtype, align)

    @staticmethod
    def addr(x: Any, count: int, what: str, dtype=np.float32, align: int = 16) -> int:
        return device_address(x, count, what, dtype, align)[0]

    def epilogue(self, out: Any, span: int, out_f16: bool, bias: Any, bias_count: int, residual: Any) -> dict:
        """The output operands of a GEMM epilogue: ``y`` (``span`` elements, f16 or f32) and, when given,
        ``bias`` (``bias_count`` f32) and ``residual`` (``span`` f32; may be ``out``)."""
        values = {"y": self.addr(out, span, "out", np.float16 if out_f16 else np.float32, align=4)}
        if bias is not None:
            values["bias"] = self.addr(bias, bias_count, "bias", align=4)
        if residual is not None:
            values["residual"] = self.addr(residual, span, "residual", align=4)
        return values

    check_int = staticmethod(check_int)

    def buffer(self, count: int, dtype=np.float32, zero: bool = False) -> Any:
        """A device allocation on this dispatcher's device (zero-filled with ``zero``)."""
        buf = cuda.GpuBuffer(count, dtype, device=self.device)
        if zero:
            buf.fill_bytes(0)
        return buf

    def to_device(self, array: np.ndarray) -> Any:
        """A new device buffer holding a copy of ``array`` (synchronous)."""
        array = np.ascontiguousarray(array)
        buf = cuda.GpuBuffer(array.size, array.dtype, device=self.device)
        buf.copy_from_host(array)
        return buf
