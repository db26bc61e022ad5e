"""Value instructions of :class:`~ptx_gen.builder.KernelBuilder`: integer and floating-point arithmetic,
comparisons and selects, conversions, and bit manipulation. Each returns a fresh register."""

from __future__ import annotations

from ptx_gen.operands import COMPARISONS, Operand, Reg
from ptx_gen.types import PtxType, ptx_type


class ArithmeticOps:
    """Mixed into :class:`~ptx_gen.builder.KernelBuilder`; uses its ``reg``, ``_emit``, ``_op`` and
    ``_type_of``."""

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

    def sub_f16x2(self, a: Reg, b: Reg) -> Reg:
        """``sub.rn.f16x2``: each f16 half of ``a`` minus that of ``b`` (32-bit registers, the low half first)."""
        d = self.reg("b32")
        self._emit(f"sub.rn.f16x2 {d}, {a}, {b};")
        return d

    def fma_f16x2(self, a: Reg, b: Reg, c: Reg) -> Reg:
        """``fma.rn.f16x2``: ``a * b + c`` on each f16 half, rounded once."""
        d = self.reg("b32")
        self._emit(f"fma.rn.f16x2 {d}, {a}, {b}, {c};")
        return d

    def cvt_f16x2(self, lo: Reg, hi: Reg) -> Reg:
        """Two f32 rounded to f16 (nearest even) and packed in one 32-bit register, ``lo`` in the low half
        (``cvt.rn.f16x2.f32``, sm_80+: one instruction for the pair)."""
        d = self.reg("b32")
        self._emit(f"cvt.rn.f16x2.f32 {d}, {hi}, {lo};")
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
