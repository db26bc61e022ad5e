"""PTX scalar types, the register classes that hold them, and immediate-operand formatting."""

from __future__ import annotations

import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class RegClass:
    """A family of virtual registers declared together, e.g. ``.reg .f32 %f<12>;``."""

    prefix: str  # "%f"
    decl: str  # ".f32"


PRED = RegClass("%p", ".pred")
B16 = RegClass("%rs", ".b16")
B32 = RegClass("%r", ".b32")
B64 = RegClass("%rd", ".b64")
F32 = RegClass("%f", ".f32")
F64 = RegClass("%fd", ".f64")

REG_CLASS_ORDER = (PRED, B16, B32, B64, F32, F64)


@dataclass(frozen=True)
class PtxType:
    """One PTX fundamental type (``.f32``, ``.u64``, ...)."""

    name: str  # "f32"
    bits: int
    kind: str  # "float", "signed", "unsigned", "bits", "pred"
    reg_class: RegClass

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind in ("signed", "unsigned")

    @property
    def nbytes(self) -> int:
        return max(self.bits // 8, 1)

    def __str__(self) -> str:
        return self.name


TYPES: dict[str, PtxType] = {
    t.name: t
    for t in (
        PtxType("pred", 1, "pred", PRED),
        PtxType("b16", 16, "bits", B16),
        PtxType("u16", 16, "unsigned", B16),
        PtxType("s16", 16, "signed", B16),
        PtxType("f16", 16, "float", B16),
        PtxType("bf16", 16, "float", B16),
        PtxType("b32", 32, "bits", B32),
        PtxType("u32", 32, "unsigned", B32),
        PtxType("s32", 32, "signed", B32),
        PtxType("f32", 32, "float", F32),
        PtxType("b64", 64, "bits", B64),
        PtxType("u64", 64, "unsigned", B64),
        PtxType("s64", 64, "signed", B64),
        PtxType("f64", 64, "float", F64),
        PtxType("u8", 8, "unsigned", B16),
        PtxType("s8", 8, "signed", B16),
        PtxType("b8", 8, "bits", B16),
    )
}


def ptx_type(t: str | PtxType) -> PtxType:
    """Look up a type by name (``"f32"`` or ``".f32"``); raise ValueError naming the known ones."""
    if isinstance(t, PtxType):
        return t
    key = t.lstrip(".")
    try:
        return TYPES[key]
    except KeyError:
        raise ValueError(f"unknown PTX type {t!r}; expected one of {sorted(TYPES)}") from None


def format_immediate(value: int | float, t: PtxType) -> str:
    """Render a Python number as a PTX literal of type ``t``; floats are exact hex (0f/0d) forms."""
    if isinstance(value, bool):
        value = int(value)
    if t.name == "f32":
        return "0f%08X" % struct.unpack(">I", struct.pack(">f", float(value)))[0]
    if t.name == "f64":
        return "0d%016X" % struct.unpack(">Q", struct.pack(">d", float(value)))[0]
    if t.is_float:
        raise ValueError(f"immediate operands of type {t.name} are not supported; convert from f32")
    if not float(value).is_integer():
        raise ValueError(f"integer operand of type {t.name} got non-integer {value!r}")
    value = int(value)
    lo = -(1 << (t.bits - 1)) if t.kind == "signed" else -(1 << (t.bits - 1))
    hi = (1 << t.bits) - 1
    if not lo <= value <= hi:
        raise ValueError(f"immediate {value} does not fit in {t.name}")
    if value < 0:
        return str(value)
    return f"0x{value:X}" if value > 0xFFFF else str(value)
