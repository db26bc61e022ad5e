"""The instruction table: opcode -> handler, and the handlers of the register-to-register forms
(moves, integer and floating-point arithmetic, bit operations, comparisons, conversions).

A handler is ``handler(m, inst, act, mask)``: ``m`` the running :class:`~ptx_gen.emulator.machine.Machine`
(operands through ``m.read``/``m.write``/``m.reg``), ``inst`` the parsed instruction, ``act`` the
threads that execute it (standing at it with a true guard), ``mask`` those standing at it. Handlers
register with :func:`op`; warp-collective and memory instructions live in ``warp.py`` and
``memops.py``. An opcode without a row is reported as not implemented.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ptx_gen.emulator.memory import EmulatorError
from ptx_gen.emulator.parse import BITS, NP, RAW, Inst

Handler = Callable[..., None]
OPS: dict[str, Handler] = {}


def op(*names: str) -> Callable[[Handler], Handler]:
    """Register the decorated handler for the opcodes ``names``."""

    def register(fn: Handler) -> Handler:
        for name in names:
            if name in OPS:
                raise ValueError(f"opcode {name} registered twice")
            OPS[name] = fn
        return fn

    return register


def not_implemented(inst: Inst) -> EmulatorError:
    return EmulatorError(f"instruction not implemented by the emulator: {inst.text}")


# ---- moves and bit fields --------------------------------------------------------------------------

@op("mov")
def mov(m, inst: Inst, act, mask) -> None:
    """``mov``, including packing ``mov.b32 d, {lo, hi}`` and unpacking ``mov.b32 {lo, hi}, a``."""
    args, t = inst.args, inst.mods[-1]
    if args[1].startswith("{"):
        parts = [x.strip() for x in args[1].strip("{}").split(",")]
        w = BITS[t] // len(parts)
        acc = np.zeros(m.n, np.uint64)
        for i, p_ in enumerate(parts):
            acc |= m.read(p_, f"b{w}").astype(np.uint64) << np.uint64(i * w)
        return m.write(args[0], acc.astype(RAW[BITS[t]]), act, f"b{BITS[t]}")
    if args[0].startswith("{"):
        parts = [x.strip() for x in args[0].strip("{}").split(",")]
        w = BITS[t] // len(parts)
        v = m.read(args[1], f"b{BITS[t]}").astype(np.uint64)
        for i, p_ in enumerate(parts):
            part = (v >> np.uint64(i * w)) & np.uint64((1 << w) - 1)
            m.write(p_, part.astype(RAW[w]), act, f"b{w}")
        return None
    return m.write(args[0], m.read(args[1], t), act, t)


@op("prmt")
def prmt(m, inst: Inst, act, mask) -> None:
    """``prmt.b32 d, a, b, sel``: byte i of d is byte ``sel[4i..4i+2]`` of {b, a} (bit 3: replicate its sign)."""
    args = inst.args
    a = m.read(args[1], "u32").astype(np.uint64)
    b = m.read(args[2], "u32").astype(np.uint64)
    sel = m.read(args[3], "u32").astype(np.uint64)
    both = a | (b << np.uint64(32))
    res = np.zeros(m.n, np.uint64)
    for i in range(4):
        s_ = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
        byte = (both >> ((s_ & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
        byte = np.where(s_ & np.uint64(8), np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0)), byte)
        res |= byte << np.uint64(8 * i)
    return m.write(args[0], res.astype(np.uint32), act, "b32")


@op("shf")
def shf(m, inst: Inst, act, mask) -> None:
    """Funnel shift ``shf.{l,r}.{clamp,wrap}.b32 d, lo, hi, n``."""
    args, mods = inst.args, inst.mods
    lo = m.read(args[1], "u32").astype(np.uint64)
    hi = m.read(args[2], "u32").astype(np.uint64)
    n_ = m.read(args[3], "u32").astype(np.uint64)
    n_ = np.minimum(n_, 32) if mods[1] == "clamp" else n_ & np.uint64(31)
    both = lo | (hi << np.uint64(32))
    if mods[0] == "l":
        res = ((both << n_) >> np.uint64(32)) & np.uint64(0xFFFFFFFF)
    else:
        res = (both >> n_) & np.uint64(0xFFFFFFFF)
    return m.write(args[0], res.astype(np.uint32), act, "b32")


@op("bfe")
def bfe(m, inst: Inst, act, mask) -> None:
    """``bfe.{u32,s32} d, x, pos, len``: bit-field extract (sign-extended for s32)."""
    args, t = inst.args, inst.mods[-1]
    bits = BITS[t]
    x = m.read(args[1], f"b{bits}").astype(np.uint64)
    pos = m.read(args[2], "u32").astype(np.int64) & 0xFF
    ln = m.read(args[3], "u32").astype(np.int64) & 0xFF
    if bits != 32:
        raise EmulatorError(f"only 32-bit bfe is emulated: {inst.text}")
    p_ = np.minimum(pos, 31)
    field_ = (x >> p_.astype(np.uint64)) & ((np.uint64(1) << np.minimum(ln, 32).astype(np.uint64)) - np.uint64(1))
    field_ = np.where((ln == 0) | (pos > 31), 0, field_).astype(np.uint64)
    if t.startswith("s"):
        top = np.minimum(pos + ln - 1, 31)
        sign = ((x >> top.astype(np.uint64)) & np.uint64(1)) == 1
        ext = ~((np.uint64(1) << np.minimum(ln, 32).astype(np.uint64)) - np.uint64(1)) & np.uint64(0xFFFFFFFF)
        field_ = np.where(sign & (ln > 0), field_ | ext, field_)
    return m.write(args[0], field_.astype(np.uint32), act, "b32")


@op("cvta")
def cvta(m, inst: Inst, act, mask) -> None:
    """Generic <-> global addresses are the same numbers here."""
    return m.write(inst.args[0], m.read(inst.args[1], "u64"), act, "u64")


@op("createpolicy")
def createpolicy(m, inst: Inst, act, mask) -> None:
    """An opaque L2 cache policy: only hints take it."""
    return m.write(inst.args[0], np.zeros(m.n, np.uint64), act, "b64")


@op("griddepcontrol", "membar", "fence")
def no_effect(m, inst: Inst, act, mask) -> None:
    """Programmatic dependent launch and memory fences: one grid, one ordering here."""


# ---- arithmetic --------------------------------------------------------------------------------


def _div(a, b, t):
    if t.startswith("f"):
        return a / b
    if t.startswith("s"):
        return np.where(b == 0, -1, np.trunc(a.astype(np.float64) / np.where(b == 0, 1, b)).astype(a.dtype))
    return np.where(b == 0, np.iinfo(a.dtype).max, a // np.where(b == 0, 1, b))


def _mul(a, b, t, mods):
    if "hi" not in mods:
        return a * b
    if BITS[t] != 32:
        raise EmulatorError(f"mul.hi.{t} not implemented")
    wide = np.int64 if t.startswith("s") else np.uint64
    return ((a.astype(wide) * b.astype(wide)) >> 32).astype(a.dtype)


def _bitwise(fn):
    return lambda a, b, t, mods: fn(a.view(RAW[BITS[t]]), b.view(RAW[BITS[t]])).view(a.dtype)


# max.f32 ignores a NaN operand, max.NaN.f32 returns it
_BINARY = {
    "add": lambda a, b, t, mods: a + b,
    "sub": lambda a, b, t, mods: a - b,
    "mul": _mul,
    "div": lambda a, b, t, mods: _div(a, b, t),
    "rem": lambda a, b, t, mods: np.fmod(a, np.where(b == 0, 1, b)) if t.startswith("s") else a % np.where(b == 0, 1, b),
    "min": lambda a, b, t, mods: np.fmin(a, b) if t.startswith("f") else np.minimum(a, b),
    "max": lambda a, b, t, mods: ((np.maximum(a, b) if "NaN" in mods else np.fmax(a, b)) if t.startswith("f")
                                  else np.maximum(a, b)),
    "and": _bitwise(np.bitwise_and),
    "or": _bitwise(np.bitwise_or),
    "xor": _bitwise(np.bitwise_xor),
}
_PRED = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _halves(m, text: str) -> np.ndarray:
    """A ``.f16x2`` operand (a 32-bit register) as (threads, 2) float64: the low half first."""
    return m.read(text, "b32").astype(np.uint32).view(np.float16).reshape(-1, 2).astype(np.float64)


def _write_halves(m, name: str, value: np.ndarray, act) -> None:
    """(threads, 2) values rounded to f16 (nearest even) and packed, the low half first."""
    m.write(name, np.ascontiguousarray(value.astype(np.float16)).view(np.uint32).reshape(-1), act, "b32")


_F16X2 = {"add": np.add, "sub": np.subtract, "mul": np.multiply}


@op(*_BINARY)
def binary(m, inst: Inst, act, mask) -> None:
    """Two-operand arithmetic and bit operations (``mul.wide`` widens; ``.pred`` and/or/xor on predicates)."""
    o, mods, args = inst.op, inst.mods, inst.args
    t = mods[-1]
    if o == "mul" and mods[0] == "wide":
        wide = "u64" if t.startswith("u") else "s64"
        a = m.read(args[1], t).astype(NP[wide])
        b = m.read(args[2], t).astype(NP[wide])
        return m.write(args[0], a * b, act, wide)
    if t == "f16x2":  # (each half in float64, rounded once to f16: exact products and sums of f16 pairs)
        if o not in _F16X2 or "ftz" in mods or "sat" in mods:
            raise EmulatorError(f"unsupported {inst.text}")
        return _write_halves(m, args[0], _F16X2[o](_halves(m, args[1]), _halves(m, args[2])), act)
    if t == "pred":
        if o not in _PRED:
            raise EmulatorError(f"unsupported {inst.text}")
        return m.write(args[0], _PRED[o](m.reg(args[1]), m.reg(args[2])), act, "pred")
    a, b = m.read(args[1], t), m.read(args[2], t)
    res = _BINARY[o](a, b, t, mods)
    m.write(args[0], np.asarray(res).astype(a.dtype, copy=False), act, t)


@op("shl", "shr")
def shift(m, inst: Inst, act, mask) -> None:
    """Shifts: counts past the width give 0 (``shr.s`` fills with the sign)."""
    args, t = inst.args, inst.mods[-1]
    a = m.read(args[1], t)
    n = m.read(args[2], "u32").astype(np.int64)
    bits = BITS[t]
    if inst.op == "shl":
        res = np.where(n >= bits, 0, a.astype(RAW[bits]) << np.minimum(n, bits - 1).astype(RAW[bits]))
        return m.write(args[0], res.astype(RAW[bits]), act, "b%d" % bits if t.startswith("b") else t)
    if t.startswith("s"):
        res = a >> np.minimum(n, bits - 1).astype(a.dtype)
    else:
        res = np.where(n >= bits, 0, a >> np.minimum(n, bits - 1).astype(a.dtype))
    return m.write(args[0], res.astype(a.dtype), act, t)


@op("mad", "fma")
def ternary(m, inst: Inst, act, mask) -> None:
    """``fma``/``mad`` on floats (rounded once, via float64), ``mad.lo`` and ``mad.wide`` on integers."""
    o, mods, args = inst.op, inst.mods, inst.args
    t = mods[-1]
    if o == "fma" and t == "f16x2":  # (via float64: an f16 product is exact there; the sum rounded twice at worst
        # where it falls exactly between two f16 values after the first rounding, which no test draws)
        if mods != ["rn", "f16x2"]:
            raise EmulatorError(f"unsupported {inst.text}")
        a, b, c = (_halves(m, x) for x in args[1:4])
        return _write_halves(m, args[0], a * b + c, act)
    if o == "fma" or (o == "mad" and t.startswith("f")):
        a, b, c = (m.read(x, t).astype(np.float64) for x in args[1:4])
        return m.write(args[0], (a * b + c).astype(NP[t]), act, t)
    if mods[0] == "wide":
        wide = "u64" if t.startswith("u") else "s64"
        a = m.read(args[1], t).astype(NP[wide])
        b = m.read(args[2], t).astype(NP[wide])
        c = m.read(args[3], wide)
        return m.write(args[0], a * b + c, act, wide)
    if mods[0] == "lo":
        a, b, c = (m.read(x, t) for x in args[1:4])
        return m.write(args[0], a * b + c, act, t)
    raise EmulatorError(f"unsupported {inst.text}")


_UNARY = {
    "ex2": lambda a, t: np.exp2(a.astype(np.float32)),
    "lg2": lambda a, t: np.log2(a),
    "rcp": lambda a, t: (np.float32(1.0) / a) if t == "f32" else 1.0 / a,
    "sqrt": lambda a, t: np.sqrt(a),
    "rsqrt": lambda a, t: (1.0 / np.sqrt(a.astype(np.float64))).astype(a.dtype),
    "sin": lambda a, t: np.sin(a.astype(np.float64)).astype(a.dtype),
    "cos": lambda a, t: np.cos(a.astype(np.float64)).astype(a.dtype),
    "neg": lambda a, t: -a,
    "abs": lambda a, t: np.abs(a),
    "not": lambda a, t: ~a,
}


@op(*_UNARY)
def unary(m, inst: Inst, act, mask) -> None:
    t = inst.mods[-1]
    a = m.read(inst.args[1], t) if t != "pred" else m.reg(inst.args[1])
    m.write(inst.args[0], _UNARY[inst.op](a, t), act, t)


# ---- comparisons and conversions ---------------------------------------------------------------

_SETP = {
    "eq": lambda a, b, f: a == b, "lt": lambda a, b, f: a < b, "le": lambda a, b, f: a <= b,
    "gt": lambda a, b, f: a > b, "ge": lambda a, b, f: a >= b,
    "ne": lambda a, b, f: (a != b) & ~np.isnan(a) & ~np.isnan(b) if f else a != b,  # ordered on floats
    "nan": lambda a, b, f: np.isnan(a) | np.isnan(b) if f else a != a,
}


@op("setp")
def setp(m, inst: Inst, act, mask) -> None:
    cmp, ty = inst.mods[0], inst.mods[1]
    a, b = m.read(inst.args[1], ty), m.read(inst.args[2], ty)
    return m.write(inst.args[0], _SETP[cmp](a, b, ty.startswith("f")), act, "pred")


@op("selp")
def selp(m, inst: Inst, act, mask) -> None:
    args, t = inst.args, inst.mods[-1]
    a, b, p = m.read(args[1], t), m.read(args[2], t), m.reg(args[3])
    return m.write(args[0], np.where(p, a, b), act, t)


_ROUND = {"rzi": np.trunc, "rni": np.rint, "rmi": np.floor, "rpi": np.ceil, None: np.trunc}


@op("cvt")
def cvt(m, inst: Inst, act, mask) -> None:
    """Conversions; float -> integer rounds as the modifier says and saturates (NaN -> 0)."""
    mods, args = inst.mods, inst.args
    dst, src = mods[-2], mods[-1]
    rnd = mods[0] if len(mods) == 3 else None
    if dst == "f16x2":  # (two f32 rounded to f16: the first source in the upper half)
        hi, lo = (m.read(x, src).astype(np.float16).view(np.uint16).astype(np.uint32) for x in args[1:3])
        return m.write(args[0], (hi << 16) | lo, act, "b32")
    a = m.read(args[1], src)
    if dst.startswith(("u", "s")) and src.startswith("f"):
        x = _ROUND[rnd](a.astype(np.float64))
        info = np.iinfo(NP[dst])
        res = np.clip(np.nan_to_num(x, nan=0), info.min, info.max).astype(NP[dst])
    else:
        res = a.astype(NP[dst])
    m.write(args[0], res, act, dst)
