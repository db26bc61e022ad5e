"""Inspect the kernel catalog from Python: PTX text, ptxas resource reports, SASS, and diffs.

    from realizar import ptx_tools
    print(ptx_tools.ptx_text("axpy", "sm_90", vec=4))
    r = ptx_tools.check("axpy", "sm_90", vec=4)        # registers, spills, stack, shared memory
    for r in ptx_tools.check_all():                     # every kernel over its validation grid
        print(r.summary())
    print(ptx_tools.sass("axpy", "sm_90", vec=4))       # needs nvdisasm or cuobjdump
    print(ptx_tools.diff("axpy", {"vec": 1}, {"vec": 4}))

The same functions back ``realizar ptx list|emit|check|sass|diff``.
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ptx_gen import catalog
from ptx_gen.ptxas import PtxasError, PtxasNotFound, ResourceReport, assemble
from ptx_gen.target import DEFAULT_TARGET, as_target

__all__ = [
    "CHECK_TARGETS",
    "CheckResult",
    "KernelInfo",
    "SassToolNotFound",
    "check",
    "check_all",
    "diff",
    "find_sass_tool",
    "kernel_info",
    "list_kernels",
    "parse_shape",
    "ptx_text",
    "sass",
]

#: Targets ``check_all`` assembles for by default: the oldest and the newest we support.
CHECK_TARGETS = ("sm_80", "sm_90")


class SassToolNotFound(RuntimeError):
    """Neither nvdisasm nor cuobjdump is installed."""


# ----------------------------------------------------------------------------------------------
# Listing
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelInfo:
    """What the catalog knows about one kernel generator."""

    name: str
    shape_params: tuple[str, ...]
    defaults: dict[str, Any]
    grid: tuple[dict, ...]
    doc: str

    @property
    def summary(self) -> str:
        """The first line of the generator's docstring."""
        return self.doc.strip().splitlines()[0] if self.doc.strip() else ""

    def signature(self) -> str:
        """``name(p1=default, p2)`` — the shape parameters with their defaults."""
        parts = [f"{p}={self.defaults[p]!r}" if p in self.defaults else p for p in self.shape_params]
        return f"{self.name}({', '.join(parts)})"


def kernel_info(name: str) -> KernelInfo:
    s = catalog.spec(name)
    return KernelInfo(s.name, tuple(s.shape_params), dict(s.defaults), tuple(s.grid), s.doc)


def list_kernels() -> list[KernelInfo]:
    """Every kernel in the catalog, sorted by name."""
    return [kernel_info(n) for n in catalog.names()]


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------


def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text.strip(), 0) if conv is int else conv(text.strip())
        except ValueError:
            pass
    return text.strip()


def parse_shape(items: str | Iterable[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Shape parameters from ``"a=1,b=2"``, ``["a=1", "b=2"]`` or a mapping. Values become ``int``,
    ``float``, ``bool`` (``true``/``false``) or ``None`` where they parse as such, else stay text."""
    if items is None:
        return {}
    if isinstance(items, Mapping):
        return dict(items)
    if isinstance(items, str):
        items = [items]
    shape: dict[str, Any] = {}
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or not key.isidentifier():
                raise ValueError(f"bad shape parameter {part!r}: expected NAME=VALUE (e.g. vec=4)")
            if key in shape:
                raise ValueError(f"shape parameter {key!r} given twice")
            shape[key] = _parse_value(value)
    return shape


def _format_shape(shape: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items()) or "(defaults)"


# ----------------------------------------------------------------------------------------------
# PTX and resource reports
# ----------------------------------------------------------------------------------------------


def ptx_text(name: str, target: str = DEFAULT_TARGET, **shape: Any) -> str:
    """The PTX module of kernel ``name`` generated for ``shape`` (defaults filled in) and ``target``."""
    return catalog.emit(name, str(as_target(target)), **shape).ptx


@dataclass(frozen=True)
class CheckResult:
    """The outcome of assembling one kernel for one shape and target.

    ``ok`` is false when generation or ptxas failed (``error`` says why); otherwise the resource
    numbers come from ``ptxas -v`` and ``report`` holds the full :class:`ResourceReport` (log, cubin).
    """

    name: str
    target: str
    shape: dict[str, Any]
    entry: str = ""
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    shared_bytes: int = 0
    ok: bool = True
    error: str | None = None
    report: ResourceReport | None = field(default=None, repr=False, compare=False)

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable view (no cubin, no log)."""
        return {
            "name": self.name,
            "target": self.target,
            "shape": dict(self.shape),
            "entry": self.entry,
            "registers": self.registers,
            "spill_stores": self.spill_stores,
            "spill_loads": self.spill_loads,
            "stack_bytes": self.stack_bytes,
            "shared_bytes": self.shared_bytes,
            "ok": self.ok,
            "error": self.error,
        }

    def summary(self) -> str:
        head = f"{self.name} [{_format_shape(self.shape)}] {self.target}"
        if not self.ok:
            return f"{head}: FAILED: {self.error}"
        return (
            f"{head}: {self.entry}: {self.registers} registers, {self.shared_bytes} B shared, "
            f"{self.stack_bytes} B stack, spills {self.spill_stores}/{self.spill_loads} B (store/load)"
        )


def _full_shape(name: str, shape: Mapping[str, Any]) -> dict[str, Any]:
    return catalog.spec(name).full_shape(dict(shape))


def check(name: str, target: str = DEFAULT_TARGET, **shape: Any) -> CheckResult:
    """Generate kernel ``name`` for ``shape`` and ``target``, assemble it with ``ptxas -v`` and return
    its resource report. Raises ``KeyError`` / ``ValueError`` for an unknown kernel, shape parameter
    or target, :class:`~ptx_gen.ptxas.PtxasError` when ptxas rejects the PTX, and
    :class:`~ptx_gen.ptxas.PtxasNotFound` without ptxas."""
    sm = str(as_target(target))
    full = _full_shape(name, shape)
    k = catalog.emit(name, sm, **full)
    reports = assemble(k.ptx, sm)
    rep = next((r for r in reports if r.entry == k.entry), reports[0])
    return CheckResult(
        name=name,
        target=sm,
        shape=full,
        entry=rep.entry,
        registers=rep.registers,
        spill_stores=rep.spill_stores,
        spill_loads=rep.spill_loads,
        stack_bytes=rep.stack_bytes,
        shared_bytes=rep.shared_bytes,
        report=rep,
    )


def check_all(
    targets: Sequence[str] = CHECK_TARGETS,
    names: Sequence[str] | None = None,
) -> list[CheckResult]:
    """:func:`check` every kernel (or those in ``names``) over each shape of its validation grid, for
    each target. A kernel that fails to generate or assemble gives a result with ``ok=False`` instead
    of raising, so one bad kernel does not hide the others. (Unknown names still raise ``KeyError``.)"""
    results: list[CheckResult] = []
    wanted = list(names) if names else catalog.names()
    for name in wanted:
        spec = catalog.spec(name)
        for shape in spec.grid:
            for target in targets:
                sm = str(as_target(target))
                try:
                    results.append(check(name, sm, **shape))
                except PtxasNotFound:
                    raise
                except PtxasError as e:
                    first = next((ln for ln in e.log.splitlines() if "error" in ln.lower()), str(e))
                    results.append(CheckResult(name, sm, dict(shape), ok=False, error=first.strip()))
                except (ValueError, TypeError, RuntimeError, AssertionError) as e:
                    results.append(
                        CheckResult(name, sm, dict(shape), ok=False, error=f"{type(e).__name__}: {e}")
                    )
    return results


# ----------------------------------------------------------------------------------------------
# SASS
# ----------------------------------------------------------------------------------------------


def _tool_candidates(tool: str) -> list[Path]:
    out: list[Path] = []
    env = os.environ.get(tool.upper())
    if env:
        out.append(Path(env))
    try:
        import nvidia  # namespace package of the nvidia-* wheels (nvidia-cuda-nvdisasm, ...)

        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_nvdisasm", "cuda_cuobjdump", "cu12"):
                out.append(Path(root) / sub / "bin" / tool)
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append(Path(os.environ[var]) / "bin" / tool)
    which = shutil.which(tool)
    if which:
        out.append(Path(which))
    out.append(Path("/usr/local/cuda/bin") / tool)
    return out


def find_sass_tool() -> tuple[str, str]:
    """``(kind, path)`` of a disassembler: ``nvdisasm`` preferred, else ``cuobjdump``. Looks at
    ``$NVDISASM`` / ``$CUOBJDUMP``, the nvidia-* wheels, ``$CUDA_HOME/bin`` and ``PATH``."""
    for tool in ("nvdisasm", "cuobjdump"):
        for c in _tool_candidates(tool):
            if c.is_file() and os.access(c, os.X_OK):
                return tool, str(c)
    raise SassToolNotFound(
        "no SASS disassembler found: pip install nvidia-cuda-nvdisasm (or nvidia-cuda-cuobjdump), "
        "or set $NVDISASM to an nvdisasm binary"
    )


def sass_of_cubin(cubin: bytes) -> str:
    """Disassemble a cubin with nvdisasm (code sections only) or ``cuobjdump -sass``."""
    kind, exe = find_sass_tool()
    with tempfile.TemporaryDirectory(prefix="realizar-sass-") as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(cubin)
        cmd = [exe, "-c", str(path)] if kind == "nvdisasm" else [exe, "-sass", str(path)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def sass(name: str, target: str = DEFAULT_TARGET, **shape: Any) -> str:
    """The SASS (machine code) ptxas produces for kernel ``name`` at ``shape`` and ``target``.
    Raises :class:`SassToolNotFound` when neither nvdisasm nor cuobjdump is installed."""
    find_sass_tool()  # fail before assembling
    r = check(name, target, **shape)
    assert r.report is not None
    return sass_of_cubin(r.report.cubin)


# ----------------------------------------------------------------------------------------------
# Diff
# ----------------------------------------------------------------------------------------------


def diff(
    name: str,
    shape_a: Mapping[str, Any] | str | None,
    shape_b: Mapping[str, Any] | str | None,
    target: str = DEFAULT_TARGET,
    target_b: str | None = None,
    context: int = 3,
) -> str:
    """Unified diff of the PTX of kernel ``name`` at two shapes (``{"vec": 1}`` or ``"vec=1"``),
    optionally also at two targets. Empty when both give the same PTX."""
    sa, sb = parse_shape(shape_a), parse_shape(shape_b)
    ta, tb = str(as_target(target)), str(as_target(target_b or target))
    a = catalog.emit(name, ta, **sa)
    b = catalog.emit(name, tb, **sb)
    label_a = f"{name} [{_format_shape(dict(a.shape))}] {ta}"
    label_b = f"{name} [{_format_shape(dict(b.shape))}] {tb}"
    return "".join(
        difflib.unified_diff(
            a.ptx.splitlines(keepends=True),
            b.ptx.splitlines(keepends=True),
            fromfile=label_a,
            tofile=label_b,
            n=context,
        )
    )
