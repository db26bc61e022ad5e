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
from typing import Any, Callable, Iterable, Mapping

from ptx_gen.builder import KernelBuilder, Module, Param
from ptx_gen.target import DEFAULT_TARGET, as_target

_REGISTRY: dict[str, "KernelSpec"] = {}
_KERNEL_MODULES = (  # imported lazily so the catalog fills on first use (by family)
    "ptx_gen.kernels.elementwise.basic", "ptx_gen.kernels.elementwise.elementwise", "ptx_gen.kernels.elementwise.rmsnorm",
    "ptx_gen.kernels.elementwise.rope", "ptx_gen.kernels.elementwise.embedding", "ptx_gen.kernels.elementwise.stream_read",
    "ptx_gen.kernels.gemv.gemv", "ptx_gen.kernels.gemv.gemv_mma",
    "ptx_gen.kernels.gemm.gemm_mma", "ptx_gen.kernels.gemm.gemm_q", "ptx_gen.kernels.gemm.x8", "ptx_gen.kernels.gemm.gemm_x8",
    "ptx_gen.kernels.gemm.gemm_wg",
    "ptx_gen.kernels.gemm.gemm_ws",
    "ptx_gen.kernels.dequant.dequant",
    "ptx_gen.kernels.attention.incremental_attention", "ptx_gen.kernels.attention.flash_decoding",
    "ptx_gen.kernels.attention.flash_attention", "ptx_gen.kernels.attention.flash_attention_mma",
    "ptx_gen.kernels.attention.paged_decode", "ptx_gen.kernels.attention.paged_prefill",
    "ptx_gen.kernels.kv.kv_append", "ptx_gen.kernels.kv.rope_append", "ptx_gen.kernels.kv.rope_append_rows",
    "ptx_gen.kernels.kv.paged_append",
    "ptx_gen.kernels.sampling.argmax", "ptx_gen.kernels.sampling.sample_rows", "ptx_gen.kernels.sampling.feed",
    "ptx_gen.kernels.moe.route",
    "ptx_gen.kernels.moe.group",
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
    arch: str | None = None  # an architecture-specific target (sm_90a) the kernel is always emitted for

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
        for p in self.shape_params:
            self._check_type(p, full[p])
        return {p: full[p] for p in self.shape_params}

    def _check_type(self, param: str, value: Any) -> None:
        """Reject text for a parameter whose default is a number or bool (a clean error here instead
        of a ``TypeError`` from inside the generator)."""
        default = self.defaults.get(param)
        if isinstance(value, str) and isinstance(default, (bool, int, float)):
            raise ValueError(
                f"kernel {self.name}: shape parameter {param!r} must be {_type_words(default)} "
                f"(default {default!r}), got {value!r}"
            )

    def parse_value(self, param: str, text: str) -> Any:
        """The value of shape parameter ``param`` written as ``text``, converted to the type of its
        default (int: decimal or 0x.., float, bool: true/false/1/0, str: as is); parameters without
        a default take the first of int, float, bool, None that parses. :class:`ValueError` naming
        the parameter and the expected type when ``text`` does not parse."""
        if param not in self.shape_params:
            raise ValueError(
                f"kernel {self.name} has no shape parameter {param!r}; it takes {list(self.shape_params)}"
            )
        text = text.strip()
        default = self.defaults.get(param)
        try:
            if isinstance(default, bool):
                return _parse_bool(text)
            if isinstance(default, int):
                return int(text, 0)
            if isinstance(default, float):
                return float(text)
        except ValueError:
            raise ValueError(
                f"kernel {self.name}: shape parameter {param!r} must be {_type_words(default)} "
                f"(default {default!r}), got {text!r}"
            ) from None
        if isinstance(default, str):
            return text
        return _parse_value(text)


def _type_words(default: Any) -> str:
    if isinstance(default, bool):
        return "a bool (true/false)"
    if isinstance(default, int):
        return "an int"
    return "a number" if isinstance(default, float) else f"a {type(default).__name__}"


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1"):
        return True
    if low in ("false", "0"):
        return False
    raise ValueError(text)


def _parse_value(text: str) -> Any:
    """Text to int (decimal or 0x..), float, bool (true/false) or None (none/null); else the text."""
    text = text.strip()
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (lambda t: int(t, 0), float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _split_shape(items: str | Iterable[str]) -> dict[str, str]:
    """``"a=1,b=2"`` or ``["a=1", "b=2"]`` -> ``{"a": "1", "b": "2"}`` (values still text)."""
    if isinstance(items, str):
        items = [items]
    out: dict[str, str] = {}
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier():
                raise ValueError(f"bad shape parameter {part!r}: expected NAME=VALUE (e.g. vec=4)")
            if key in out:
                raise ValueError(f"shape parameter {key!r} given twice")
            out[key] = value
    return out


def parse_shape(items: str | Iterable[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Shape parameters from ``"a=1,b=2"``, ``["a=1", "b=2"]`` or a mapping, without a kernel to check
    them against: values become ``int``, ``float``, ``bool`` (``true``/``false``) or ``None`` where
    they parse as such, else stay text. Use :func:`parse_shape_arg` when the kernel is known."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        return dict(items)
    return {k: _parse_value(v) for k, v in _split_shape(items).items()}


def parse_shape_arg(name: str, items: str | Iterable[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Shape parameters of kernel ``name`` from command-line text (``"in_dim=4096,wtype=Q4_K"`` or a
    list of such), each converted to the type of its default. :class:`ValueError` naming the
    parameter for an unknown parameter or a value that does not parse; ``KeyError`` for an unknown
    kernel. A mapping is checked the same way (its text values are parsed)."""
    s = spec(name)
    if items is None:
        return {}
    raw = dict(items) if isinstance(items, Mapping) else _split_shape(items)
    shape = {k: s.parse_value(k, v) if isinstance(v, str) else v for k, v in raw.items()}
    s.full_shape(shape)  # unknown / mistyped parameters fail here, before any generation
    return shape


@dataclass(frozen=True)
class LaunchHints:
    """How to launch a generated kernel, from its generator: ``block`` threads per CTA (an int, or a
    ``(x, y, z)`` tuple), ``dyn_smem`` bytes of dynamic shared memory to pass at launch, ``l1_bytes``
    the L1 footprint the kernel counts on (the launcher sizes the shared-memory carveout to leave
    it), ``smem`` bytes of static shared memory the kernel declares."""

    block: int | tuple[int, int, int]
    dyn_smem: int = 0
    l1_bytes: int = 0
    smem: int = 0

    #: the ``KernelBuilder.meta`` keys that are launch hints; every other key is kernel geometry
    KEYS = ("block", "dyn_smem", "l1_bytes", "smem")

    @classmethod
    def from_meta(cls, name: str, meta: Mapping[str, Any]) -> "LaunchHints":
        if "block" not in meta:
            raise RuntimeError(f"generator for {name} must set meta['block'] (threads per CTA)")
        block = meta["block"]
        return cls(
            block=tuple(block) if isinstance(block, (tuple, list)) else int(block),
            dyn_smem=int(meta.get("dyn_smem", 0)),
            l1_bytes=int(meta.get("l1_bytes", 0)),
            smem=int(meta.get("smem", 0)),
        )


@dataclass(frozen=True)
class PtxKernel:
    """The PTX of one kernel generated for one shape and target."""

    name: str
    entry: str
    target: str
    shape: tuple[tuple[str, Any], ...]
    ptx: str
    params: tuple[Param, ...]
    launch: LaunchHints = field(compare=False, hash=False)
    #: kernel-specific geometry (``rows_per_cta``, ``subgroups``, ``block_q``, ...) beside the launch
    #: hints, which it also still holds under their ``LaunchHints`` names
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> tuple:
        """Module-cache key: kernel name + shape + target."""
        return (self.name, self.shape, self.target)

    @property
    def shape_dict(self) -> dict:
        return dict(self.shape)


def kernel(name: str, grid: list[dict] | None = None, arch: str | None = None):
    """Decorator registering ``fn(m: Module, **shape) -> KernelBuilder`` under ``name``. ``arch``: the kernel
    uses architecture-specific instructions (``wgmma``: ``"sm_90a"``) and is emitted for that target when
    asked for any target of the same compute capability (others: :class:`ValueError`)."""

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
            arch=arch,
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
    return _emit_cached(name, target_for(s, target), tuple(full.items()))


def target_for(s: KernelSpec, target: str) -> str:
    """The target kernel ``s`` is emitted for on ``target`` (its ``arch`` on a device of that capability)."""
    t = as_target(target)
    if s.arch is None:
        return t.sm
    if t.compute_capability != as_target(s.arch).compute_capability:
        raise ValueError(f"kernel {s.name} needs {s.arch} (its instructions exist only there), not {t.sm}")
    return s.arch


def targets(s: KernelSpec, among: Iterable[str]) -> tuple[str, ...]:
    """The targets of ``among`` kernel ``s`` is validated for: its ``arch`` alone when it has one."""
    return (s.arch,) if s.arch else tuple(among)


@lru_cache(maxsize=None)
def _emit_cached(name: str, target: str, shape: tuple) -> PtxKernel:
    s = _REGISTRY[name]
    header = f"kernel: {name}\nshape: " + ", ".join(f"{k}={v}" for k, v in shape)
    m = Module(target, header=header)
    k = s.generator(m, **dict(shape))
    if len(m.kernels) != 1 or m.kernels[0] is not k:
        raise RuntimeError(f"generator for {name} must build exactly one kernel and return it")
    return PtxKernel(
        name=name, entry=k.name, target=target, shape=shape, ptx=m.emit(), params=k.params,
        launch=LaunchHints.from_meta(name, k.meta), meta=dict(k.meta),
    )
