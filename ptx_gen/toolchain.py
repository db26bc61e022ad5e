"""The one lookup of the CUDA command-line tools (ptxas, nvdisasm, cuobjdump).

Each tool is looked for, in order, at ``$<TOOL>`` (``$PTXAS``, ``$NVDISASM``, ``$CUOBJDUMP``), in the
``nvidia-*`` pip wheels (``nvidia-cuda-nvcc``, ``nvidia-cuda-nvdisasm``, ...), under ``$CUDA_HOME/bin``
and ``$CUDA_PATH/bin``, on ``PATH``, and in ``/usr/local/cuda/bin``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["ToolNotFound", "tool_candidates", "find_tool"]

# Sub-directories of the ``nvidia`` namespace package where the wheels put their ``bin/``.
_WHEEL_DIRS = ("cu13", "cuda_nvcc", "cuda_nvdisasm", "cuda_cuobjdump", "cu12")


class ToolNotFound(RuntimeError):
    """A CUDA command-line tool is not installed where :func:`find_tool` looks."""


def tool_candidates(tool: str) -> list[Path]:
    """The paths where ``tool`` may be, in the order they are tried."""
    out: list[Path] = []
    env = os.environ.get(tool.upper())
    if env:
        out.append(Path(env))
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for root in nvidia.__path__:
            out.extend(Path(root) / sub / "bin" / tool for sub in _WHEEL_DIRS)
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


def find_tool(tool: str, hint: str = "") -> str:
    """Path of the first executable ``tool`` among :func:`tool_candidates`; :class:`ToolNotFound`
    (with ``hint`` on how to install it) when there is none."""
    for c in tool_candidates(tool):
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    raise ToolNotFound(f"{tool} not found" + (f": {hint}" if hint else ""))
