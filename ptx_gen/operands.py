"""Operands of the PTX builder: registers, symbols, parameters, and the names instructions accept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ptx_gen.types import PtxType

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
    """A kernel parameter: a scalar of ``type``, or (``array`` > 0) ``array`` bytes aligned to ``align`` (a
    ``CUtensorMap`` passed by value: :data:`TENSOR_MAP`)."""

    name: str
    type: PtxType
    array: int = 0
    align: int = 0


TENSOR_MAP = "tmap"  # the parameter type name of a tensor map: 128 bytes aligned to 64, passed by value
TENSOR_MAP_BYTES = 128
