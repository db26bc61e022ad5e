"""Inspect the kernel catalog from Python: PTX text, ptxas resource reports, SASS, and diffs.

    from ptx_gen import inspect as ptx_inspect
    print(ptx_inspect.ptx_text("axpy", "sm_90", vec=4))
    r = ptx_inspect.check("axpy", "sm_90", vec=4)       # registers, spills, stack, shared memory
    for r in ptx_inspect.check_all(progress=True):      # every kernel over its validation grid
        print(r.summary())
    print(ptx_inspect.sass("axpy", "sm_90", vec=4))     # needs nvdisasm or cuobjdump
    print(ptx_inspect.diff("axpy", {"vec": 1}, {"vec": 4}))

Shape parameters given as text (``"in_dim=4096,wtype=Q4_K"``) go through
:func:`ptx_gen.catalog.parse_shape_arg`, which checks them against the kernel's parameters.
The same functions back ``realizar ptx list|emit|check|sass|diff``.
"""

from __future__ import annotations

import difflib
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ptx_gen import catalog, toolchain
from ptx_gen.catalog import parse_shape, parse_shape_arg
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
    "parse_shape_arg",
    "ptx_text",
    "sass",
]

#: Targets ``check_all`` assembles for by default: the oldest and the newest we support.
CHECK_TARGETS = ("sm_80", "sm_90")


class SassToolNotFound(toolchain.ToolNotFound):
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
    full = _full_shape(name, shape)
    k = catalog.emit(name, str(as_target(target)), **full)
    sm = k.target  # (an architecture-specific kernel's own target, e.g. sm_90a)
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


Progress = Callable[[int, int, str], None]


def check_all(
    targets: Sequence[str] = CHECK_TARGETS,
    names: Sequence[str] | None = None,
    progress: bool | Progress = False,
) -> list[CheckResult]:
    """:func:`check` every kernel (or those in ``names``) over each shape of its validation grid, for
    each target. A kernel that fails to generate or assemble gives a result with ``ok=False`` instead
    of raising, so one bad kernel does not hide the others. (Unknown names still raise ``KeyError``.)

    ``progress``: ``True`` draws a tqdm bar on stderr; a callable is called as ``progress(done, total,
    label)`` after each assembly."""
    wanted = list(names) if names else catalog.names()
    jobs = [
        (name, dict(shape), str(as_target(target)))
        for name in wanted
        for shape in catalog.spec(name).grid
        for target in catalog.targets(catalog.spec(name), targets)
    ]
    bar = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="ptx check", unit="kernel", leave=False)
    results: list[CheckResult] = []
    try:
        for done, (name, shape, sm) in enumerate(jobs, 1):
            results.append(_check_one(name, shape, sm))
            if bar is not None:
                bar.update(1)
            elif callable(progress):
                progress(done, len(jobs), f"{name} {sm}")
    finally:
        if bar is not None:
            bar.close()
    return results


def _check_one(name: str, shape: dict[str, Any], sm: str) -> CheckResult:
    """:func:`check`, with generation and ptxas failures turned into a result with ``ok=False``."""
    try:
        return check(name, sm, **shape)
    except PtxasNotFound:
        raise
    except PtxasError as e:
        first = next((ln for ln in e.log.splitlines() if "error" in ln.lower()), str(e))
        return CheckResult(name, sm, shape, ok=False, error=first.strip())
    except (ValueError, TypeError, RuntimeError, AssertionError) as e:
        return CheckResult(name, sm, shape, ok=False, error=f"{type(e).__name__}: {e}")


# ----------------------------------------------------------------------------------------------
# SASS
# ----------------------------------------------------------------------------------------------


def find_sass_tool() -> tuple[str, str]:
    """``(kind, path)`` of a disassembler: ``nvdisasm`` preferred, else ``cuobjdump`` (looked for by
    :func:`ptx_gen.toolchain.find_tool`)."""
    for tool in ("nvdisasm", "cuobjdump"):
        try:
            return tool, toolchain.find_tool(tool)
        except toolchain.ToolNotFound:
            pass
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
    sa, sb = parse_shape_arg(name, shape_a), parse_shape_arg(name, shape_b)
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
