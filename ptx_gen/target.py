"""Compilation targets: which ``.version`` / ``.target`` pair a module is emitted for."""

from __future__ import annotations

from dataclasses import dataclass

# PTX ISA 8.0 is accepted by every driver from CUDA 12.0 on and covers sm_80..sm_90a; we never emit a
# version above 9.0 (the lent machines' driver is CUDA 13.0).
_PTX_VERSION = {"sm_80": "8.0", "sm_86": "8.0", "sm_89": "8.0", "sm_90": "8.0", "sm_90a": "8.0"}

SUPPORTED_TARGETS = tuple(_PTX_VERSION)
DEFAULT_TARGET = "sm_90"


@dataclass(frozen=True)
class Target:
    """A GPU architecture such as ``sm_90``."""

    sm: str

    def __post_init__(self) -> None:
        if self.sm not in _PTX_VERSION:
            raise ValueError(f"unsupported target {self.sm!r}; expected one of {SUPPORTED_TARGETS}")

    @property
    def ptx_version(self) -> str:
        return _PTX_VERSION[self.sm]

    @property
    def compute_capability(self) -> tuple[int, int]:
        digits = self.sm[3:].rstrip("a")
        return int(digits[:-1]), int(digits[-1])

    @classmethod
    def from_compute_capability(cls, major: int, minor: int) -> "Target":
        """The newest supported target a device of this capability runs (sm_90 for 9.x, ...)."""
        wanted = major * 10 + minor
        best = None
        for sm in SUPPORTED_TARGETS:
            if sm.endswith("a"):
                continue
            t = cls(sm)
            cc = t.compute_capability
            if cc[0] * 10 + cc[1] <= wanted and (cc[0] == major or major > 9):
                if best is None or t.compute_capability > best.compute_capability:
                    best = t
        if best is None:
            raise ValueError(
                f"compute capability {major}.{minor} is not supported; realizar needs sm_80 or newer"
            )
        return best

    def __str__(self) -> str:
        return self.sm


def as_target(t: "str | Target") -> Target:
    return t if isinstance(t, Target) else Target(t)
