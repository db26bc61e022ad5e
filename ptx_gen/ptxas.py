"""Assemble PTX with ptxas (from the ``nvidia-cuda-nvcc`` wheel or a toolkit) and read its report."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ptx_gen import toolchain
from ptx_gen.toolchain import ToolNotFound


class PtxasNotFound(ToolNotFound):
    """No ptxas binary: install the test extra (``nvidia-cuda-nvcc``) or a CUDA toolkit."""


class PtxasError(RuntimeError):
    """ptxas rejected the PTX; ``log`` holds its messages and ``ptx`` the input."""

    def __init__(self, message: str, log: str, ptx: str):
        super().__init__(f"{message}\n{log}")
        self.log = log
        self.ptx = ptx


@dataclass(frozen=True)
class ResourceReport:
    """What ``ptxas -v`` says about one entry function."""

    entry: str
    target: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    cubin: bytes
    log: str

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@lru_cache(maxsize=1)
def find_ptxas() -> str:
    """Path of ptxas (see :mod:`ptx_gen.toolchain` for where it is looked for)."""
    try:
        return toolchain.find_tool("ptxas", "pip install nvidia-cuda-nvcc (the test extra), or set $PTXAS")
    except ToolNotFound as e:
        raise PtxasNotFound(str(e)) from None


_REG = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")


def assemble(ptx: str, target: str, opt_level: int = 3) -> list[ResourceReport]:
    """Assemble ``ptx`` for ``target`` and return one report per entry function."""
    exe = find_ptxas()
    with tempfile.TemporaryDirectory(prefix="realizar-ptxas-") as tmp:
        src, out = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(ptx)
        proc = subprocess.run(
            [exe, f"-arch={target}", f"-O{opt_level}", "-v", str(src), "-o", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise PtxasError(f"ptxas failed for {target} (exit {proc.returncode})", log, ptx)
        cubin = out.read_bytes()
    return _parse_report(log, target, cubin)


def _parse_report(log: str, target: str, cubin: bytes) -> list[ResourceReport]:
    reports = []
    blocks = re.split(r"(?=ptxas info\s*: Compiling entry function)", log)
    for block in blocks:
        m = _ENTRY.search(block)
        if not m:
            continue
        regs = _REG.search(block)
        spill = _SPILL.search(block)
        smem = _SMEM.search(block)
        reports.append(
            ResourceReport(
                entry=m.group(1),
                target=m.group(2),
                registers=int(regs.group(1)) if regs else 0,
                stack_bytes=int(spill.group(1)) if spill else 0,
                spill_stores=int(spill.group(2)) if spill else 0,
                spill_loads=int(spill.group(3)) if spill else 0,
                shared_bytes=int(smem.group(1)) if smem else 0,
                cubin=cubin,
                log=block.strip(),
            )
        )
    if not reports:
        raise PtxasError("ptxas produced no entry-function report", log, "")
    return reports
