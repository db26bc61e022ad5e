"""``load_model(path)``: one entry point for GGUF files and HF safetensors directories.

Dependencies point one way: this module dispatches to the format readers, which build a
:class:`~realizar.models.loaded.LoadedModel` and never import this module.
"""

from __future__ import annotations

import os
from pathlib import Path

from realizar.errors import ModelFormatError
from realizar.models.gguf_loader import load_gguf
from realizar.models.loaded import LoadedModel
from realizar.models.safetensors_loader import load_safetensors

__all__ = ["load_model"]


def load_model(path: str | os.PathLike) -> LoadedModel:
    """Load a ``.gguf`` file, or a directory (or a ``.safetensors`` file inside one) in HF layout."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}")
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
