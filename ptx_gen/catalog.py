"""The kernel catalog: kernel name -> generator taking shape parameters.

Kernels register themselves with :func:`kernel`; code and tools list them (:func:`names`,
:func:`spec`), emit one for a shape (:func:`emit`), and validate all of them over each spec's
validation grid (``tests/test_ptx_catalog.py``, ``realizar ptx check``).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from ptx_gen.builder import KernelBuilder, Module, Param
from ptx_gen.target import DEFAULT_TARGET, as_target

_REGISTRY: dict[str, "KernelSpec"] = {}
_KERNEL_MODULES = (  # imported lazily so the catalog fills on first use
    "ptx_gen.kernels.basic",
    "ptx_gen.kernels.kv_append", "ptx_gen.kernels.incremental_attention", "ptx_gen.kernels.flash_decoding",
    "ptx_gen.kernels.flash_attention", "ptx_gen.kernels.rope_append",
    "ptx_gen.kernels.gemv", "ptx_gen.kernels.gemv_mma", "ptx_gen.kernels.rmsnorm", "ptx_gen.kernels.rope", "ptx_gen.kernels.elementwise",
    "ptx_gen.kernels.embedding", "ptx_gen.kernels.argmax", "ptx_gen.kernels.stream_read",
)
_EXTRA_MODULES: list[str] = []


@dataclass(frozen=True)
class KernelSpec:
    """A registered kernel generator."""

    name: str
    generator: Callable[..., KernelBuilder]
    doc: str
    shape_params: tuple[str, ...]
    defaults: dict[str, Any]
    grid: tuple[dict, ...]  # shapes the validation tests assemble

    def full_shape(self, shape: dict) -> dict:
        unknown = set(shape) - set(self.shape_params)
        if unknown:
            raise ValueError(
                f"kernel {self.name} has no shape parameter(s) {sorted(unknown)}; "
                f"it takes {list(self.shape_params)}"
            )
        full = {**self.defaults, **shape}
        missing = [p for p in self.shape_params if p not in full]
        if missing:
            raise ValueError(f"kernel {self.name} needs shape parameter(s) {missing}")
        return {p: full[p] for p in self.shape_params}


@dataclass(frozen=True)
class PtxKernel:
    """The PTX of one kernel generated for one shape and target."""

    name: str
    entry: str
    target: str
    shape: tuple[tuple[str, Any], ...]
    ptx: str
    params: tuple[Param, ...]
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> tuple:
        """Module-cache key: kernel name + shape + target."""
        return (self.name, self.shape, self.target)

    @property
    def shape_dict(self) -> dict:
        return dict(self.shape)


def kernel(name: str, grid: list[dict] | None = None):
    """Decorator registering ``fn(m: Module, **shape) -> KernelBuilder`` under ``name``."""

    def register(fn: Callable[..., KernelBuilder]) -> Callable[..., KernelBuilder]:
        sig = inspect.signature(fn)
        shape_params = tuple(list(sig.parameters)[1:])
        defaults = {
            n: p.default for n, p in sig.parameters.items() if p.default is not inspect.Parameter.empty
        }
        if name in _REGISTRY and _REGISTRY[name].generator is not fn:
            raise ValueError(f"kernel {name!r} registered twice")
        _REGISTRY[name] = KernelSpec(
            name=name,
            generator=fn,
            doc=inspect.getdoc(fn) or "",
            shape_params=shape_params,
            defaults=defaults,
            grid=tuple(grid or ({},)),
        )
        return fn

    return register


def add_kernel_module(module_name: str) -> None:
    """Let another package of kernels join the catalog (imported on first catalog use)."""
    if module_name not in _EXTRA_MODULES:
        _EXTRA_MODULES.append(module_name)
        _load.cache_clear()


@lru_cache(maxsize=1)
def _load() -> None:
    for mod in (*_KERNEL_MODULES, *_EXTRA_MODULES):
        importlib.import_module(mod)


def names() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def spec(name: str) -> KernelSpec:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel {name!r} in the catalog; known: {names()}") from None


def emit(name: str, target: str = DEFAULT_TARGET, **shape) -> PtxKernel:
    """Generate kernel ``name`` for ``shape`` and ``target`` (memoised; output is deterministic)."""
    s = spec(name)
    full = s.full_shape(shape)
    return _emit_cached(name, as_target(target).sm, tuple(full.items()))


@lru_cache(maxsize=None)
def _emit_cached(name: str, target: str, shape: tuple) -> PtxKernel:
    s = _REGISTRY[name]
    header = f"kernel: {name}\nshape: " + ", ".join(f"{k}={v}" for k, v in shape)
    m = Module(target, header=header)
    k = s.generator(m, **dict(shape))
    if len(m.kernels) != 1 or m.kernels[0] is not k:
        raise RuntimeError(f"generator for {name} must build exactly one kernel and return it")
    return PtxKernel(
        name=name, entry=k.name, target=target, shape=shape, ptx=m.emit(), params=k.params, meta=dict(k.meta)
    )
