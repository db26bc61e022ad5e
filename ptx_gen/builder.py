"""The PTX builder: typed virtual registers, instructions, control flow, one kernel per module.

Every instruction that produces a value returns a *fresh* register, so a value, once named, never
changes. Loop-carried state is explicit: ``k.var(type, init)`` makes a :class:`Var` whose ``set``
emits a ``mov``. An online softmax written with it keeps "old max" and "new max" in different
registers by construction (the Rust original's batched kernel aliased them, which silently made the
rescale factor 1).

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
from typing import Iterator, Sequence, Union

from ptx_gen.target import Target, as_target
from ptx_gen.types import REG_CLASS_ORDER, PtxType, format_immediate, ptx_type

SPACES = ("global", "shared", "local", "param", "const")
SHUFFLE_MODES = ("down", "up", "bfly", "idx")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
PREFETCH_SIZES = ("64B", "128B", "256B")  # cp.async's .L2::<size> hint
L2_EVICT = ("evict_first", "evict_last", "evict_normal", "evict_unchanged")  # createpolicy's L2 priorities


@dataclass(frozen=True)
class Reg:
    """A virtual register holding one immutable value of ``type``."""

    name: str
    type: PtxType

    def __str__(self) -> str:
        return self.name


class Var(Reg):
    """A mutable register for loop-carried values; assign with :meth:`KernelBuilder.assign`."""


@dataclass(frozen=True)
class Symbol:
    """A named address (a shared-memory array) usable where an address operand is expected."""

    name: str

    def __str__(self) -> str:
        return self.name


Operand = Union[Reg, int, float]


@dataclass(frozen=True)
class Param:
    name: str
    type: PtxType


@dataclass
class KernelBuilder:
    """Builds the body of one ``.entry`` function. Obtain it from :meth:`Module.kernel`."""

    name: str
    params: tuple[Param, ...]
    target: Target
    max_threads: int | None = None
    min_blocks: int | None = None  # .minnctapersm: CTAs per SM the register budget must allow
    _lines: list[str] = field(default_factory=list)
    _counts: dict = field(default_factory=dict)
    _labels: int = 0
    _shared_decls: list[str] = field(default_factory=list)
    _indent: int = 1
    _param_cache: dict = field(default_factory=dict)
    _prologue: list = field(default_factory=list)  # parameter loads, emitted at the kernel's entry
    _module_decls: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # launch hints for the runtime (block size, shared)
    _deferred_wait: bool = False  # griddepcontrol.wait placed by the kernel (grid_dependency_wait)

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

    # ---- arithmetic ---------------------------------------------------------------------------
    def _binary(self, op: str, a: Operand, b: Operand, t: str | None, suffix: str = "") -> Reg:
        ty = ptx_type(t) if t else self._type_of(a, b)
        d = self.reg(ty)
        self._emit(f"{op}{suffix}.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ty)};")
        return d

    def add(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._binary("add", a, b, t)

    def sub(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._binary("sub", a, b, t)

    def mul(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        ty = ptx_type(t) if t else self._type_of(a, b)
        return self._binary("mul", a, b, t, "" if ty.is_float else ".lo")

    def mul_wide(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        """32 x 32 -> 64-bit product (u32 or s32 inputs), the usual way to form byte offsets."""
        ty = ptx_type(t) if t else self._type_of(a, b)
        wide = ptx_type(("s" if ty.kind == "signed" else "u") + "64")
        d = self.reg(wide)
        self._emit(f"mul.wide.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ty)};")
        return d

    def mul_hi(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._binary("mul", a, b, t, ".hi")

    def div(self, a: Operand, b: Operand, t: str | None = None, approx: bool = False) -> Reg:
        ty = ptx_type(t) if t else self._type_of(a, b)
        mode = (".approx" if approx else ".rn") if ty.is_float else ""
        return self._binary("div", a, b, t, mode)

    def rem(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._binary("rem", a, b, t)

    def min(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._binary("min", a, b, t)

    def max(self, a: Operand, b: Operand, t: str | None = None, nan: bool = False) -> Reg:
        """``max``; floats ignore a NaN operand unless ``nan`` (``max.NaN``, sm_80+: NaN wins)."""
        return self._binary("max", a, b, t, ".NaN" if nan else "")

    def _bitwise(self, op: str, a: Operand, b: Operand, t: str | None, b_type: str | None = None) -> Reg:
        """``op.b<bits>``; the result keeps the operand's type (u32 stays u32) for later arithmetic."""
        ty = ptx_type(t) if t else self._type_of(a, b)
        d = self.reg(ty)
        bits = "pred" if ty.name == "pred" else f"b{ty.bits}"
        bt = ptx_type(b_type) if b_type else ty
        self._emit(f"{op}.{bits} {d}, {self._op(a, ty)}, {self._op(b, bt)};")
        return d

    def and_(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._bitwise("and", a, b, t)

    def both(self, a: Reg | None, b: Reg | None) -> Reg | None:
        """The predicate ``a and b``, where None stands for "always" (so None when both are)."""
        if a is None:
            return b
        return a if b is None else self.and_(a, b)

    def or_(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._bitwise("or", a, b, t)

    def xor(self, a: Operand, b: Operand, t: str | None = None) -> Reg:
        return self._bitwise("xor", a, b, t)

    def shl(self, a: Operand, b: int | Reg, t: str | None = None) -> Reg:
        return self._bitwise("shl", a, b, t, b_type="u32")

    def shr(self, a: Operand, b: int | Reg, t: str | None = None) -> Reg:
        """Logical shift for unsigned/bit types, arithmetic for signed ones."""
        ty = ptx_type(t) if t else self._type_of(a)
        d = self.reg(ty)
        self._emit(f"shr.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ptx_type('u32'))};")
        return d

    def not_(self, a: Reg) -> Reg:
        name = "pred" if a.type.name == "pred" else f"b{a.type.bits}"
        d = self.reg(name)
        self._emit(f"not.{name} {d}, {a};")
        return d

    def neg(self, a: Reg) -> Reg:
        d = self.reg(a.type)
        self._emit(f"neg.{a.type.name} {d}, {a};")
        return d

    def abs(self, a: Reg) -> Reg:
        d = self.reg(a.type)
        self._emit(f"abs.{a.type.name} {d}, {a};")
        return d

    def mad(self, a: Operand, b: Operand, c: Operand, t: str | None = None) -> Reg:
        """Integer a*b+c (low half); for floats use :meth:`fma`."""
        ty = ptx_type(t) if t else self._type_of(a, b, c)
        if ty.is_float:
            return self.fma(a, b, c, t)
        d = self.reg(ty)
        self._emit(f"mad.lo.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ty)}, {self._op(c, ty)};")
        return d

    def mad_wide(self, a: Operand, b: Operand, c: Operand, t: str | None = None) -> Reg:
        """64-bit a*b+c from 32-bit a, b: ``mad.wide.u32`` (c is 64-bit)."""
        ty = ptx_type(t) if t else self._type_of(a, b)
        wide = ptx_type(("s" if ty.kind == "signed" else "u") + "64")
        d = self.reg(wide)
        self._emit(
            f"mad.wide.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ty)}, {self._op(c, wide)};"
        )
        return d

    def fma(self, a: Operand, b: Operand, c: Operand, t: str | None = None) -> Reg:
        ty = ptx_type(t) if t else self._type_of(a, b, c)
        d = self.reg(ty)
        self._emit(f"fma.rn.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ty)}, {self._op(c, ty)};")
        return d

    def _unary(self, op: str, a: Operand, t: str | None) -> Reg:
        ty = ptx_type(t) if t else self._type_of(a, default="f32")
        d = self.reg(ty)
        self._emit(f"{op}.{ty.name} {d}, {self._op(a, ty)};")
        return d

    def ex2(self, a: Operand) -> Reg:
        """2**a (``ex2.approx.f32``: max 2 ulp; PTX has no IEEE ex2)."""
        return self._unary("ex2.approx", a, "f32")

    def lg2(self, a: Operand) -> Reg:
        return self._unary("lg2.approx", a, "f32")

    def rcp(self, a: Operand, approx: bool = False, t: str | None = None) -> Reg:
        return self._unary("rcp.approx" if approx else "rcp.rn", a, t or "f32")

    def sqrt(self, a: Operand, approx: bool = False, t: str | None = None) -> Reg:
        return self._unary("sqrt.approx" if approx else "sqrt.rn", a, t or "f32")

    def rsqrt(self, a: Operand, t: str | None = None) -> Reg:
        """1/sqrt(a): PTX offers only the approximate form; for IEEE use rcp(sqrt(a))."""
        return self._unary("rsqrt.approx", a, t or "f32")

    def sin(self, a: Operand) -> Reg:
        """``sin.approx.f32``: absolute error about 2**-20.9 for |a| <= pi (reduce the range first)."""
        return self._unary("sin.approx", a, "f32")

    def cos(self, a: Operand) -> Reg:
        """``cos.approx.f32``: absolute error about 2**-20.9 for |a| <= pi (reduce the range first)."""
        return self._unary("cos.approx", a, "f32")

    def exp(self, a: Operand) -> Reg:
        """e**a as ex2(a * log2(e))."""
        return self.ex2(self.mul(a, 1.4426950408889634, "f32"))

    # ---- comparisons and predicates --------------------------------------------------------
    def setp(self, cmp: str, a: Operand, b: Operand, t: str | None = None) -> Reg:
        if cmp not in COMPARISONS:
            raise ValueError(f"unknown comparison {cmp!r}; expected one of {COMPARISONS}")
        ty = ptx_type(t) if t else self._type_of(a, b)
        d = self.reg("pred")
        self._emit(f"setp.{cmp}.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ty)};")
        return d

    def selp(self, a: Operand, b: Operand, pred: Reg, t: str | None = None) -> Reg:
        """``pred ? a : b``."""
        ty = ptx_type(t) if t else self._type_of(a, b)
        d = self.reg(ty)
        self._emit(f"selp.{ty.name} {d}, {self._op(a, ty)}, {self._op(b, ty)}, {pred};")
        return d

    # ---- conversions --------------------------------------------------------------------------
    def cvt(self, a: Reg, to: str | PtxType, rounding: str | None = None) -> Reg:
        """Convert between f32/f16/bf16/f64/s32/u32/s64/u64/u16/u8.

        Defaults: float->int truncates (``rzi``), int->float and narrowing float conversions round
        to nearest even (``rn``). bf16->f32 is done exactly by a 16-bit shift so it works on sm_80.
        """
        to = ptx_type(to)
        src = a.type
        if src.name == "bf16" and to.name == "f32":
            wide = self.reg("u32")
            self._emit(f"cvt.u32.u16 {wide}, {a};")
            bits = self.shl(wide, 16, "b32")
            return self.bitcast(bits, "f32")
        if rounding is None:
            if src.is_float and to.is_int:
                rounding = "rzi"
            elif to.is_float and (src.is_int or to.bits < src.bits):
                rounding = "rn"
        d = self.reg(to)
        rnd = f".{rounding}" if rounding else ""
        self._emit(f"cvt{rnd}.{to.name}.{src.name} {d}, {a};")
        return d

    def bitcast(self, a: Reg, to: str | PtxType) -> Reg:
        """Reinterpret the bits of ``a`` as another type of the same width (``mov.b32``)."""
        to = ptx_type(to)
        if to.bits != a.type.bits:
            raise TypeError(f"bitcast needs equal widths: {a.type} -> {to}")
        d = self.reg(to)
        self._emit(f"mov.b{to.bits} {d}, {a};")
        return d

    def pack_b32(self, lo: Reg, hi: Reg) -> Reg:
        """Two 16-bit registers into one 32-bit one (``mov.b32 d, {lo, hi}``)."""
        d = self.reg("b32")
        self._emit(f"mov.b32 {d}, {{{lo}, {hi}}};")
        return d

    def unpack_b32(self, a: Reg) -> tuple[Reg, Reg]:
        lo, hi = self.reg("b16"), self.reg("b16")
        self._emit(f"mov.b32 {{{lo}, {hi}}}, {a};")
        return lo, hi

    # ---- memory ---------------------------------------------------------------------------------
    @staticmethod
    def _address(addr: Reg | Symbol, offset: int) -> str:
        if offset:
            return f"[{addr}{offset:+d}]"
        return f"[{addr}]"

    def load(
        self,
        space: str,
        t: str | PtxType,
        addr: Reg | Symbol,
        offset: int = 0,
        *,
        vec: int = 1,
        nc: bool = False,
        pred: Reg | None = None,
        other: Operand | None = None,
        cache: str | None = None,
        into: Sequence[Var] | None = None,
    ) -> Reg | tuple[Reg, ...]:
        """``ld.<space>[.nc][.v2|.v4].<t>``; with ``pred`` the load is guarded and the result
        holds ``other`` (which must be given) where the guard is false.

        ``into`` (``vec`` :class:`Var` s) loads into existing loop-carried registers instead of fresh
        ones, e.g. to prefetch the next iteration's data while this one is computed; a guarded load
        into them may omit ``other`` (they then keep their value where the guard is false)."""
        t = ptx_type(t)
        if space not in SPACES:
            raise ValueError(f"unknown state space {space!r}; expected one of {SPACES}")
        if vec not in (1, 2, 4):
            raise ValueError(f"vector width must be 1, 2 or 4, got {vec}")
        if nc and space != "global":
            raise ValueError("ld.nc exists only for the global space")
        if into is not None:
            into = list(into)
            if len(into) != vec or not all(isinstance(v, Var) and v.type.reg_class == t.reg_class for v in into):
                raise TypeError(f"into= needs {vec} Var(s) of register class {t.reg_class.decl}")
        if pred is not None and other is None and into is None:
            raise ValueError("a predicated load needs `other`, the value where the guard is false")
        dests = into if into is not None else [self.reg(t) for _ in range(vec)]
        if pred is not None and other is not None:
            for d in dests:
                self._emit(f"mov.{self._mov_type(t)} {d}, {self._op(other, t)};")
        qual = f".{space}" + (".nc" if nc else "") + (f".{cache}" if cache else "")
        qual += f".v{vec}" if vec > 1 else ""
        dst = f"{{{', '.join(map(str, dests))}}}" if vec > 1 else str(dests[0])
        self._emit(f"ld{qual}.{t.name} {dst}, {self._address(addr, offset)};", pred)
        return tuple(dests) if vec > 1 else dests[0]

    def store(
        self,
        space: str,
        t: str | PtxType,
        addr: Reg | Symbol,
        value: Operand | Sequence[Operand],
        offset: int = 0,
        *,
        pred: Reg | None = None,
        negate: bool = False,
    ) -> None:
        """``st.<space>[.v2|.v4].<t>``; pass a sequence of 2 or 4 values for a vector store."""
        t = ptx_type(t)
        if space not in SPACES:
            raise ValueError(f"unknown state space {space!r}; expected one of {SPACES}")
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) not in (1, 2, 4):
            raise ValueError(f"vector width must be 1, 2 or 4, got {len(values)}")
        ops = [self._op(v, t) for v in values]
        src = f"{{{', '.join(ops)}}}" if len(ops) > 1 else ops[0]
        vq = f".v{len(ops)}" if len(ops) > 1 else ""
        self._emit(f"st.{space}{vq}.{t.name} {self._address(addr, offset)}, {src};", pred, negate)

    def atom(
        self,
        space: str,
        op: str,
        t: str | PtxType,
        addr: Reg | Symbol,
        value: Operand,
        offset: int = 0,
        compare: Operand | None = None,
    ) -> Reg:
        """``atom.<space>.<op>.<t>``, returning the old value; ``op='cas'`` needs ``compare``."""
        t = ptx_type(t)
        d = self.reg(t)
        if op == "cas":
            if compare is None:
                raise ValueError("atom.cas needs `compare`")
            self._emit(
                f"atom.{space}.cas.{t.name} {d}, {self._address(addr, offset)}, "
                f"{self._op(compare, t)}, {self._op(value, t)};"
            )
        else:
            self._emit(f"atom.{space}.{op}.{t.name} {d}, {self._address(addr, offset)}, {self._op(value, t)};")
        return d

    def red(self, space: str, op: str, t: str | PtxType, addr: Reg | Symbol, value: Operand, offset: int = 0) -> None:
        """Fire-and-forget atomic reduction (``red.<space>.<op>.<t>``)."""
        t = ptx_type(t)
        self._emit(f"red.{space}.{op}.{t.name} {self._address(addr, offset)}, {self._op(value, t)};")

    def prefetch_l2(self, addr: Reg, nbytes: Operand) -> None:
        """``cp.async.bulk.prefetch.L2.global``: ask the L2 to fetch ``nbytes`` (a multiple of 16) from
        the 16-byte aligned global ``addr`` (sm_90+; a hint with no effect on results)."""
        self._need_sm90("cp.async.bulk.prefetch.L2")
        self._emit(f"cp.async.bulk.prefetch.L2.global [{addr}], {self._op(nbytes, ptx_type('u32'))};")

    def cp_async(self, dst: Reg, src: Reg, pred: Reg | None = None, dst_offset: int = 0, src_offset: int = 0,
                 *, prefetch: str | None = None, policy: Reg | None = None) -> None:
        """``cp.async.cg.shared.global [dst], [src], 16``: copy 16 bytes (both addresses 16-byte aligned)
        from global to shared memory without passing through registers, bypassing L1 (sm_80+). The
        copy lands at some point before this thread's :meth:`cp_async_wait_all`; other threads see it
        after a barrier that follows the wait.

        Hints that change no result: ``prefetch`` ("64B", "128B" or "256B", ``.L2::<size>``) lets the L2
        fetch that much around the 16 bytes on a miss; ``policy`` (from :meth:`create_policy`,
        ``.L2::cache_hint``) says how the L2 should keep the bytes."""
        hints = ""
        if policy is not None:
            if not isinstance(policy, Reg) or policy.type.bits != 64:
                raise TypeError(f"policy must be a 64-bit register from create_policy, got {policy!r}")
            hints += ".L2::cache_hint"
        if prefetch is not None:
            if prefetch not in PREFETCH_SIZES:
                raise ValueError(f"prefetch must be one of {PREFETCH_SIZES}, got {prefetch!r}")
            hints += f".L2::{prefetch}"
        tail = f", {policy}" if policy is not None else ""
        self._emit(f"cp.async.cg.shared.global{hints} {self._address(dst, dst_offset)}, "
                   f"{self._address(src, src_offset)}, 16{tail};", pred)

    def create_policy(self, evict: str = "evict_first", fraction: float = 1.0) -> Reg:
        """``createpolicy.fractional.L2::<evict>.b64``: an L2 cache policy (sm_80+) for the given
        ``fraction`` (0, 1] of the accesses that use it, e.g. ``evict_first`` for data streamed once."""
        if evict not in L2_EVICT:
            raise ValueError(f"evict must be one of {L2_EVICT}, got {evict!r}")
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
        d = self.reg("b64")
        self._emit(f"createpolicy.fractional.L2::{evict}.b64 {d}, {float(fraction)!r};")
        return d

    def grid_dependency_wait(self) -> None:
        """Place the ``griddepcontrol.wait`` of programmatic dependent launch here instead of at the
        kernel's entry (sm_90+; nothing on older targets, whose launches are never programmatic).

        Code before it overlaps the end of the kernel this one depends on, so it may only read memory
        no earlier kernel writes (weights) and write nothing but shared memory; every thread that goes
        on to touch other global memory must pass a wait. A second wait on a path is harmless. Data an
        earlier kernel writes must be read with coherent loads, never ``ld.global.nc``: its promise
        that the data is read-only for the kernel's lifetime lets ptxas move such a load above the
        wait (found on the GPU: decode went wrong once weight loads preceded the wait)."""
        self._deferred_wait = True
        if self.target.compute_capability >= (9, 0):
            self._emit("griddepcontrol.wait;")

    def cp_async_commit(self) -> None:
        """``cp.async.commit_group``: close this thread's group of cp.async copies issued so far."""
        self._emit("cp.async.commit_group;")

    def cp_async_wait_group(self, pending: int) -> None:
        """``cp.async.wait_group N``: all but this thread's newest ``pending`` committed groups have
        landed (a ring of ``pending + 1`` stages in flight)."""
        self._emit(f"cp.async.wait_group {int(pending)};")

    # ---- bulk copies (sm_90): the tensor memory accelerator, completion through an mbarrier ----------
    def _need_sm90(self, what: str) -> None:
        if self.target.compute_capability < (9, 0):
            raise ValueError(f"{what} needs sm_90 or newer, the target is {self.target}")

    def mbarrier_init(self, addr: Reg, count: int, pred: Reg | None = None) -> None:
        """``mbarrier.init``: an 8-byte shared barrier expecting ``count`` arrivals per phase."""
        self._need_sm90("mbarrier with transaction counts")
        self._emit(f"mbarrier.init.shared::cta.b64 [{addr}], {int(count)};", pred)

    def fence_mbarrier_init(self) -> None:
        """Make mbarrier initialisations visible to the other threads and to the bulk-copy unit."""
        self._emit("fence.mbarrier_init.release.cluster;")

    def fence_proxy_async(self) -> None:
        """Order this thread's earlier shared-memory accesses before later bulk copies (async proxy)."""
        self._emit("fence.proxy.async.shared::cta;")

    def mbarrier_expect_tx(self, addr: Reg, nbytes: Operand, pred: Reg | None = None) -> None:
        """Arrive at the barrier, announcing ``nbytes`` that bulk copies will complete in this phase."""
        self._emit(f"mbarrier.arrive.expect_tx.shared::cta.b64 _, [{addr}], {self._op(nbytes, ptx_type('u32'))};",
                   pred)

    def cp_async_bulk(self, dst: Reg, src: Reg, nbytes: int, mbar: Reg, pred: Reg | None = None,
                      policy: Reg | None = None) -> None:
        """``cp.async.bulk`` global -> shared of ``nbytes`` (a multiple of 16; both addresses 16-byte
        aligned) by the tensor memory accelerator; its bytes count towards the phase of ``mbar``.
        ``policy`` (from :meth:`create_policy`): an L2 cache hint for the bytes read."""
        self._need_sm90("cp.async.bulk")
        if policy is not None and (not isinstance(policy, Reg) or policy.type.bits != 64):
            raise TypeError(f"policy must be a 64-bit register from create_policy, got {policy!r}")
        hint, tail = (".L2::cache_hint", f", {policy}") if policy is not None else ("", "")
        self._emit(f"cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes{hint} [{dst}], [{src}], "
                   f"{int(nbytes)}, [{mbar}]{tail};", pred)

    def mbarrier_wait(self, addr: Reg, parity: Operand) -> None:
        """Spin until the barrier's phase of ``parity`` (0 or 1) has completed (its arrivals and bytes)."""
        ok = self.reg("pred")
        top = self.new_label("mbar_wait")
        self.label(top)
        self._emit(f"mbarrier.try_wait.parity.shared::cta.b64 {ok}, [{addr}], {self._op(parity, ptx_type('u32'))};")
        self.bra(top, ok, negate=True)

    def ldmatrix_x4(self, addr: Reg, offset: int = 0) -> tuple[Reg, Reg, Reg, Reg]:
        """``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` (warp-collective, sm_75+): four 8x8 matrices of
        16-bit elements, i.e. 8 rows of 16 bytes each; lane ``8 j + r`` gives the (16-byte aligned)
        shared address of row ``r`` of matrix ``j``. Lane ``l`` receives, for each matrix, bytes
        ``4 (l % 4) .. 4 (l % 4) + 3`` of row ``l / 4``: register ``j`` from matrix ``j``."""
        ds = tuple(self.reg("b32") for _ in range(4))
        self._emit(f"ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{', '.join(map(str, ds))}}}, "
                   f"{self._address(addr, offset)};")
        return ds

    def mma_s8(self, a: Sequence[Reg], b: Sequence[Reg], c: Sequence[Operand],
               a_unsigned: bool = False) -> tuple[Reg, Reg, Reg, Reg]:
        """``mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32`` (warp-collective, sm_80+): D = A B + C
        exactly in int32, A 16x32 and B 32x8 of signed bytes (``a_unsigned``: A's bytes are unsigned,
        ``.u8.s8``). With ``g = lane / 4``, ``t = lane % 4``:
        a[0] = A[g][4t..4t+3], a[1] = A[g+8][4t..4t+3], a[2] = A[g][16+4t..], a[3] = A[g+8][16+4t..]
        (4 bytes each, lowest k in the lowest byte); b[0] = B[4t..4t+3][g], b[1] = B[16+4t..16+4t+3][g];
        c and d: [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1]."""
        if len(a) != 4 or len(b) != 2 or len(c) != 4:
            raise ValueError("mma m16n8k32 takes 4 A, 2 B and 4 C registers")
        s32 = ptx_type("s32")
        cs = [x if isinstance(x, Reg) else self.mov(x, "s32") for x in c]
        ds = tuple(self.reg(s32) for _ in range(4))
        fmt = lambda regs: "{" + ", ".join(map(str, regs)) + "}"  # noqa: E731
        atype = "u8" if a_unsigned else "s8"
        self._emit(f"mma.sync.aligned.m16n8k32.row.col.s32.{atype}.s8.s32 {fmt(ds)}, {fmt(a)}, {fmt(b)}, {fmt(cs)};")
        return ds

    def cp_async_wait_all(self) -> None:
        """``cp.async.wait_all``: every cp.async this thread issued has landed in shared memory."""
        self._emit("cp.async.wait_all;")

    def shared_array(self, name: str, t: str | PtxType, count: int, align: int = 16) -> Reg:
        """Declare a static shared array in this kernel and return its 32-bit shared address."""
        t = ptx_type(t)
        nbytes = t.nbytes * count
        self._shared_decls.append(f".shared .align {align} .b8 {name}[{nbytes}];")
        return self.mov(Symbol(name), "u32")

    def dynamic_shared(self, align: int = 16) -> Reg:
        """The 32-bit address of this kernel's dynamic shared memory (size set at launch)."""
        sym = f"{self.name}_dyn_smem"
        decl = f".extern .shared .align {align} .b8 {sym}[];"
        if decl not in self._module_decls:
            self._module_decls.append(decl)
        return self.mov(Symbol(sym), "u32")

    # ---- warp and block collectives ------------------------------------------------------------
    def shfl(self, mode: str, value: Reg, lane: Operand, clamp: int | None = None, mask: int = 0xFFFFFFFF) -> Reg:
        """``shfl.sync.<mode>.b32``; ``lane`` is the delta (down/up), xor mask (bfly) or source (idx)."""
        if mode not in SHUFFLE_MODES:
            raise ValueError(f"unknown shuffle mode {mode!r}; expected one of {SHUFFLE_MODES}")
        if value.type.bits != 32:
            raise TypeError(f"shfl moves 32-bit values, got {value.type}")
        if clamp is None:
            clamp = 0 if mode == "up" else 0x1F
        d = self.reg(value.type)
        u32 = ptx_type("u32")
        self._emit(
            f"shfl.sync.{mode}.b32 {d}, {value}, {self._op(lane, u32)}, {self._op(clamp, u32)}, "
            f"{self._op(mask, u32)};"
        )
        return d

    def redux(self, value: Reg, op: str = "max") -> Reg:
        """``redux.sync.<op>`` over the whole warp (sm_80+): one instruction for a 32-bit integer
        add/min/max/and/or/xor that every lane receives (``value``: u32 or s32)."""
        if op not in ("add", "min", "max", "and", "or", "xor"):
            raise ValueError(f"unknown redux op {op!r}")
        if value.type.name not in ("u32", "s32", "b32"):
            raise TypeError(f"redux reduces 32-bit integers, got {value.type}")
        t = "b32" if op in ("and", "or", "xor") else ("s32" if value.type.name == "s32" else "u32")
        d = self.reg(value.type)
        self._emit(f"redux.sync.{op}.{t} {d}, {value}, 0xffffffff;")
        return d

    def warp_reduce(self, value: Reg, op: str = "add", width: int = 32) -> Reg:
        """Butterfly reduction over ``width`` lanes; every lane receives the result (``"max_nan"``: a
        float max that a NaN wins)."""
        fn = {"add": self.add, "max": self.max, "min": self.min,
              "max_nan": lambda a, b: self.max(a, b, nan=True)}[op]
        acc = value
        offset = width // 2
        while offset >= 1:
            acc = fn(acc, self.shfl("bfly", acc, offset))
            offset //= 2
        return acc

    def bar_sync(self, barrier: int = 0, threads: int | None = None) -> None:
        extra = f", {threads}" if threads is not None else ""
        self._emit(f"bar.sync {barrier}{extra};")

    def fence(self, scope: str = "gl") -> None:
        """``membar.<cta|gl|sys>``."""
        self._emit(f"membar.{scope};")

    def bar_warp_sync(self, mask: int = 0xFFFFFFFF) -> None:
        """``bar.warp.sync``: the lanes in ``mask`` wait for each other (and their shared-memory
        writes become visible to each other)."""
        self._emit(f"bar.warp.sync {self._op(mask, ptx_type('u32'))};")

    # ---- bit manipulation ------------------------------------------------------------------------
    def prmt(self, a: Operand, b: Operand, selector: Operand) -> Reg:
        """``prmt.b32``: byte ``i`` of the result is byte ``selector[4i:4i+3]`` of the 8-byte value
        ``{b, a}`` (bytes 0-3 from ``a``, 4-7 from ``b``); selector bit ``4i+3`` replicates its sign."""
        u32 = ptx_type("u32")
        d = self.reg("u32")
        self._emit(f"prmt.b32 {d}, {self._op(a, u32)}, {self._op(b, u32)}, {self._op(selector, u32)};")
        return d

    def shf(self, direction: str, lo: Operand, hi: Operand, amount: Operand, mode: str = "wrap") -> Reg:
        """Funnel shift ``shf.<l|r>.<wrap|clamp>.b32`` of the 64-bit value ``{hi, lo}``;
        ``shf("l", x, x, n)`` rotates ``x`` left by ``n``."""
        if direction not in ("l", "r") or mode not in ("wrap", "clamp"):
            raise ValueError(f"shf needs direction l/r and mode wrap/clamp, got {direction!r}, {mode!r}")
        u32 = ptx_type("u32")
        d = self.reg("u32")
        self._emit(
            f"shf.{direction}.{mode}.b32 {d}, {self._op(lo, u32)}, {self._op(hi, u32)}, {self._op(amount, u32)};"
        )
        return d

    def bfe(self, a: Operand, pos: Operand, length: Operand, t: str | None = None) -> Reg:
        """Bit-field extract ``bfe.<u32|s32|u64|s64>``: ``length`` bits from bit ``pos`` (sign-extended
        for signed types)."""
        ty = ptx_type(t) if t else self._type_of(a, default="u32")
        d = self.reg(ty)
        u32 = ptx_type("u32")
        self._emit(f"bfe.{ty.name} {d}, {self._op(a, ty)}, {self._op(pos, u32)}, {self._op(length, u32)};")
        return d

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
        params = ",\n".join(f"    .param .{p.type.name} {self._param_symbol(p.name)}" for p in self.params)
        out = [f".visible .entry {self.name}(\n{params}\n)"]
        if self.max_threads:
            out.append(f".maxntid {self.max_threads}, 1, 1")
            if self.min_blocks:
                out.append(f".minnctapersm {self.min_blocks}")
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
            # scheduled while this one runs. Both are no-ops for an ordinary launch.
            if not self._deferred_wait:
                out.append("    griddepcontrol.wait;")
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
    ) -> KernelBuilder:
        """``min_blocks`` (with ``max_threads``) emits ``.minnctapersm``: ptxas then budgets registers
        for that many resident CTAs per SM instead of its own occupancy guess (which can spill)."""
        k = KernelBuilder(
            name=name,
            params=tuple(Param(n, ptx_type(t)) for n, t in params),
            target=self.target,
            max_threads=max_threads,
            min_blocks=min_blocks,
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
