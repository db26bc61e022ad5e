"""The PTX builder: typed virtual registers, instructions, control flow, one kernel per module.

Every instruction that produces a value returns a *fresh* register, so a value, once named, never
changes. Loop-carried state is explicit: ``k.var(type, init)`` makes a :class:`Var` whose ``set``
emits a ``mov``. An online softmax written with it keeps "old max" and "new max" in different
registers by construction, so the rescale factor cannot silently become 1 by aliasing them.

The instruction families live beside this module and are mixed into :class:`KernelBuilder`:
:mod:`ptx_gen.instr_arith` (arithmetic, comparisons, conversions, bit manipulation) and
:mod:`ptx_gen.instr_memory` (memory, asynchronous copies, barriers, warp collectives, tensor cores);
operand classes are in :mod:`ptx_gen.operands`. Here: registers, parameters, special registers,
control flow and rendering.

    m = Module("sm_90")
    k = m.kernel("axpy", [("x", "u64"), ("y", "u64"), ("a", "f32"), ("n", "u32")])
    i = k.global_index_x()
    with k.if_(k.setp("lt", i, k.param("n"))):
        off = k.mul_wide(i, 4)
        x = k.load("global", "f32", k.add(k.global_ptr("x"), off))
        ...
    ptx = m.emit()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from ptx_gen.instr_arith import ArithmeticOps
from ptx_gen.instr_memory import MemoryOps
from ptx_gen.operands import TENSOR_MAP, TENSOR_MAP_BYTES, Operand, Param, Reg, Symbol, Var
from ptx_gen.target import Target, as_target
from ptx_gen.types import REG_CLASS_ORDER, PtxType, format_immediate, ptx_type


@dataclass
class KernelBuilder(ArithmeticOps, MemoryOps):
    """Builds the body of one ``.entry`` function. Obtain it from :meth:`Module.kernel`."""

    name: str
    params: tuple[Param, ...]
    target: Target
    max_threads: int | None = None
    cluster: tuple[int, int, int] | None = None  # CTAs a cluster (.reqnctapercluster): launched as clusters
    min_blocks: int | None = None  # .minnctapersm: CTAs per SM the register budget must allow
    _lines: list[str] = field(default_factory=list)
    _counts: dict = field(default_factory=dict)
    _labels: int = 0
    _shared_decls: list[str] = field(default_factory=list)
    _indent: int = 1
    _param_cache: dict = field(default_factory=dict)
    _prologue: list = field(default_factory=list)  # parameter loads, emitted at the kernel's entry
    _module_decls: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # launch hints (catalog.LaunchHints.KEYS) and kernel geometry
    _deferred_wait: bool = False  # griddepcontrol.wait placed by the kernel (grid_dependency_wait)
    _deferred_trigger: bool = False  # griddepcontrol.launch_dependents placed by the kernel (launch_dependents)

    # ---- registers and operands ------------------------------------------------------------
    def reg(self, t: str | PtxType) -> Reg:
        """A fresh, never-used register of type ``t``."""
        t = ptx_type(t)
        n = self._counts.get(t.reg_class, 0) + 1
        self._counts[t.reg_class] = n
        return Reg(f"{t.reg_class.prefix}{n}", t)

    def var(self, t: str | PtxType, init: Operand | None = None) -> Var:
        """A mutable register (loop counter, running max, accumulator), optionally initialised."""
        r = self.reg(t)
        v = Var(r.name, r.type)
        if init is not None:
            self.assign(v, init)
        return v

    def assign(self, v: Var, value: Operand) -> None:
        """``v = value``. Only :class:`Var` may be assigned: ordinary values stay immutable."""
        if not isinstance(v, Var):
            raise TypeError(f"only a Var can be assigned; {v} is an immutable value")
        self._emit(f"mov.{self._mov_type(v.type)} {v}, {self._op(value, v.type)};")

    def _op(self, x: Operand | Symbol, t: PtxType) -> str:
        if isinstance(x, (Reg, Symbol)):
            return str(x)
        if isinstance(x, str):
            return x
        return format_immediate(x, t)

    @staticmethod
    def _mov_type(t: PtxType) -> str:
        if t.name in ("f16", "bf16", "u8", "s8", "b8"):
            return "b16"
        return t.name

    @staticmethod
    def _type_of(*xs: Operand, default: str | None = None) -> PtxType:
        for x in xs:
            if isinstance(x, Reg):
                return x.type
        if default is None:
            raise TypeError("cannot infer the operand type from immediates only; pass t=")
        return ptx_type(default)

    def _emit(self, text: str, pred: Reg | None = None, negate: bool = False) -> None:
        guard = ""
        if pred is not None:
            if pred.type.name != "pred":
                raise TypeError(f"guard must be a predicate register, got {pred.type}")
            guard = f"@{'!' if negate else ''}{pred} "
        self._lines.append("    " * self._indent + guard + text)

    def comment(self, text: str) -> None:
        for line in text.splitlines():
            self._lines.append("    " * self._indent + "// " + line)

    def mov(self, value: Operand | Symbol, t: str | PtxType | None = None) -> Reg:
        t = ptx_type(t) if t is not None else self._type_of(value)
        d = self.reg(t)
        self._emit(f"mov.{self._mov_type(t)} {d}, {self._op(value, t)};")
        return d

    # ---- parameters and special registers -------------------------------------------------
    def param(self, name: str) -> Reg:
        """The value of kernel parameter ``name``, loaded once at the kernel's entry and reused: the
        cached register is defined on every path, even when first asked for inside a branch."""
        if name in self._param_cache:
            return self._param_cache[name]
        for p in self.params:
            if p.name == name:
                if p.array:
                    raise ValueError(f"parameter {name!r} is {p.array} bytes: take its address (param_address)")
                d = self.reg(p.type)
                self._prologue.append(f"    ld.param.{p.type.name} {d}, [{self._param_symbol(name)}];")
                self._param_cache[name] = d
                return d
        raise KeyError(f"kernel {self.name} has no parameter {name!r}; it has {[p.name for p in self.params]}")

    def global_ptr(self, name: str) -> Reg:
        """A pointer parameter converted to a global-space address."""
        key = ("global", name)
        if key not in self._param_cache:
            p = self.param(name)
            if p.type.bits != 64:
                raise TypeError(f"parameter {name} is {p.type}, a pointer must be 64-bit")
            d = self.reg("u64")
            self._prologue.append(f"    cvta.to.global.u64 {d}, {p};")
            self._param_cache[key] = d
        return self._param_cache[key]

    def rebase_ptr(self, name: str, offset: Reg) -> Reg:
        """The global pointer parameter ``name`` moved by ``offset`` bytes (u64), emitted here; every later
        :meth:`global_ptr` of ``name`` gives the moved pointer."""
        d = self.add(self.global_ptr(name), offset)
        self._param_cache[("global", name)] = d
        return d

    def param_address(self, name: str) -> Reg:
        """The generic address of kernel parameter ``name`` (a tensor map passed by value: what
        ``cp.async.bulk.tensor`` takes), computed once at the kernel's entry."""
        key = ("address", name)
        if key not in self._param_cache:
            if not any(p.name == name for p in self.params):
                raise ValueError(f"no kernel parameter {name!r}")
            a, d = self.reg("u64"), self.reg("u64")
            self._prologue.append(f"    mov.u64 {a}, {self._param_symbol(name)};")
            self._prologue.append(f"    cvta.param.u64 {d}, {a};")
            self._param_cache[key] = d
        return self._param_cache[key]

    def _param_symbol(self, name: str) -> str:
        return f"{self.name}_param_{name}"

    def sreg(self, name: str) -> Reg:
        """A special register such as ``tid.x``, ``ctaid.y``, ``ntid.x``, ``laneid``, ``nctaid.x``."""
        d = self.reg("u32")
        self._emit(f"mov.u32 {d}, %{name};")
        return d

    def tid(self, axis: str = "x") -> Reg:
        return self.sreg(f"tid.{axis}")

    def ctaid(self, axis: str = "x") -> Reg:
        return self.sreg(f"ctaid.{axis}")

    def ntid(self, axis: str = "x") -> Reg:
        return self.sreg(f"ntid.{axis}")

    def global_index_x(self) -> Reg:
        """ctaid.x * ntid.x + tid.x as u32."""
        return self.mad(self.ctaid("x"), self.ntid("x"), self.tid("x"))


    # ---- control flow ---------------------------------------------------------------------------
    def new_label(self, hint: str = "L") -> str:
        self._labels += 1
        return f"$L_{hint}_{self._labels}"

    def label(self, name: str) -> None:
        self._lines.append(f"{name}:")

    def bra(self, label: str, pred: Reg | None = None, negate: bool = False, uniform: bool = False) -> None:
        self._emit(f"bra{'.uni' if uniform else ''} {label};", pred, negate)

    def ret(self) -> None:
        self._emit("ret;")

    @contextlib.contextmanager
    def if_(self, pred: Reg, negate: bool = False) -> Iterator[None]:
        """Run the body only where ``pred`` holds (or does not hold, with ``negate``)."""
        end = self.new_label("endif")
        self.bra(end, pred, negate=not negate)
        self._indent += 1
        yield
        self._indent -= 1
        self.label(end)

    @contextlib.contextmanager
    def loop(self, start: Operand, stop: Operand, step: Operand = 1, t: str = "u32") -> Iterator[Var]:
        """``for i in range(start, stop, step)`` (positive step); yields the loop variable."""
        i = self.var(t, start)
        head, end = self.new_label("loop"), self.new_label("endloop")
        self.label(head)
        self.bra(end, self.setp("ge", i, stop, t))
        self._indent += 1
        yield i
        self.assign(i, self.add(i, step, t))
        self._indent -= 1
        self.bra(head)
        self.label(end)

    # ---- rendering --------------------------------------------------------------------------------
    def render(self) -> str:
        params = ",\n".join(f"    .param .align {p.align} .b8 {self._param_symbol(p.name)}[{p.array}]" if p.array else
                             f"    .param .{p.type.name} {self._param_symbol(p.name)}" for p in self.params)
        out = [f".visible .entry {self.name}(\n{params}\n)"]
        if self.max_threads:
            out.append(f".maxntid {self.max_threads}, 1, 1")
            if self.min_blocks:
                out.append(f".minnctapersm {self.min_blocks}")
        if self.cluster:
            out.append(f".reqnctapercluster {', '.join(str(int(c)) for c in self.cluster)}")
        out.append("{")
        for rc in REG_CLASS_ORDER:
            n = self._counts.get(rc, 0)
            if n:
                out.append(f"    .reg {rc.decl} {rc.prefix}<{n + 1}>;")
        for decl in self._shared_decls:
            out.append("    " + decl)
        out.append("")
        if self.target.compute_capability >= (9, 0):
            # Programmatic dependent launch (sm_90): wait for the grids this one depends on (unless the kernel
            # placed the wait itself, see grid_dependency_wait), then let the next kernel's blocks be
            # scheduled while this one runs (unless the kernel placed that too, see launch_dependents).
            # Both are no-ops for an ordinary launch.
            if not self._deferred_wait:
                out.append("    griddepcontrol.wait;")
            if not self._deferred_trigger:
                out.append("    griddepcontrol.launch_dependents;")
        out.extend(self._prologue)
        out.extend(self._lines)
        out.append("}")
        return "\n".join(out) + "\n"


class Module:
    """One PTX module holding one kernel (kernels are generated per shape, one module each)."""

    def __init__(self, target: str | Target = "sm_90", header: str = ""):
        self.target = as_target(target)
        self.header = header
        self.kernels: list[KernelBuilder] = []
        self._decls: list[str] = []

    def kernel(
        self,
        name: str,
        params: Sequence[tuple[str, str]],
        max_threads: int | None = None,
        min_blocks: int | None = None,
        cluster: tuple[int, int, int] | None = None,
    ) -> KernelBuilder:
        """``min_blocks`` (with ``max_threads``) emits ``.minnctapersm``: ptxas then budgets registers
        for that many resident CTAs per SM instead of its own occupancy guess (which can spill). ``cluster``
        (sm_90) emits ``.reqnctapercluster``: the grid is launched as clusters of that many CTAs (its extents
        multiples of them), whose shared memories and mbarriers each CTA may address (``mapa``)."""
        if cluster is not None and self.target.compute_capability < (9, 0):
            raise ValueError(f"clusters need sm_90 or newer, the target is {self.target}")
        k = KernelBuilder(
            name=name,
            params=tuple(Param(n, ptx_type("b8"), TENSOR_MAP_BYTES, 64) if t == TENSOR_MAP else Param(n, ptx_type(t))
                         for n, t in params),
            target=self.target,
            max_threads=max_threads,
            min_blocks=min_blocks,
            cluster=tuple(cluster) if cluster is not None else None,
            _module_decls=self._decls,
        )
        self.kernels.append(k)
        return k

    def emit(self) -> str:
        lines = ["//"]
        for h in self.header.splitlines():
            lines.append(f"// {h}".rstrip())
        lines += [
            f"// generated by realizar ptx_gen for {self.target.sm}",
            "//",
            f".version {self.target.ptx_version}",
            f".target {self.target.sm}",
            ".address_size 64",
            "",
        ]
        lines += self._decls
        if self._decls:
            lines.append("")
        body = "\n".join(k.render() for k in self.kernels)
        return "\n".join(lines) + "\n" + body
