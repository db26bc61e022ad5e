"""``load_model(path)``: one entry point for GGUF files and HF safetensors directories.

Dependencies point one way: this module dispatches to the format readers, which build a
:class:`~realizar.models.loaded.LoadedModel` and never import this module.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from realizar.errors import ModelFormatError
from realizar.models.gguf_loader import load_gguf
from realizar.models.loaded import LoadedModel
from realizar.models.safetensors_loader import load_safetensors

__all__ = ["load_model"]


def _regular(p: Path) -> None:
    """Refuse ``p`` unless it is a regular file (a FIFO or a device would block or never end a read)."""
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise ModelFormatError(f"cannot read {p}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise ModelFormatError(f"{p} is not a regular file (a FIFO, socket or device): a model is read from files")


def load_model(path: str | os.PathLike) -> LoadedModel:
    """Load a ``.gguf`` file, or a directory (or a ``.safetensors`` file inside one) in HF layout. Every file it
    would read must be a regular file (checked first: nothing is opened that could block)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}")
    if p.is_dir():
        for f in sorted(p.iterdir()):
            if f.suffix in (".json", ".safetensors", ".gguf", ".jinja", ".model", ".txt"):
                _regular(f)
    else:
        _regular(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if not (p / "config.json").exists() and len(ggufs) == 1:
            p = ggufs[0]
        elif not (p / "config.json").exists() and ggufs:
            listed = ", ".join(g.name for g in ggufs[:5])
            raise ModelFormatError(f"{p} holds {len(ggufs)} GGUF files ({listed}); pass one of them")
        else:
            return load_safetensors(p)
    if p.suffix == ".safetensors":
        return load_safetensors(p.parent, p)
    if p.name == "model.safetensors.index.json":
        return load_safetensors(p.parent)
    return load_gguf(p)
