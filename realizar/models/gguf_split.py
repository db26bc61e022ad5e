"""GGUF models split into several files (llama.cpp's ``gguf-split``, and the Hub's repos of large models):
``PREFIX-00001-of-0000N.gguf`` ... ``PREFIX-0000N-of-0000N.gguf`` beside each other. Every part is a GGUF of its
own with ``split.no`` (0-based) and ``split.count``; the first holds the model's metadata and
``split.tensors.count``; the tensors are spread over the parts. :func:`read_gguf_parts` finds and checks all the
parts from any one of them; the loader takes the metadata of the first and the tensors of all.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from realizar.errors import ModelFormatError
from realizar.models.gguf_loader import GGUFFile, read_gguf

__all__ = ["SPLIT_SUFFIX", "read_gguf_parts", "split_paths", "unsplit_stem"]

SPLIT_SUFFIX = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def unsplit_stem(name: str) -> str:
    """A GGUF file name without ``.gguf`` and, for a part of a split model, without ``-0000K-of-0000N``."""
    m = SPLIT_SUFFIX.search(name)
    return name[: m.start()] if m else name.removesuffix(".gguf")


def split_paths(path: Path, count: int) -> list[Path]:
    """The paths of the ``count`` parts of the split GGUF that ``path`` (any part) belongs to, first to last."""
    m = SPLIT_SUFFIX.search(path.name)
    if m is None or int(m[2]) != count:
        raise ModelFormatError(f"{path.name}: one part of a GGUF split into {count} files (split.count), but not "
                               f"named PREFIX-0000K-of-{count:05d}.gguf, so its other parts cannot be found")
    return [path.with_name(f"{path.name[: m.start()]}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def _count(f: GGUFFile, key: str) -> int | None:
    v = f.metadata.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ModelFormatError(f"{f.path.name}: {key} is {v!r}, not a count")
    return v


def read_gguf_parts(path: str | os.PathLike) -> list[GGUFFile]:
    """``[read_gguf(path)]`` for a one-file GGUF; for a part of a split one, every part, first to last, each
    checked (its ``split.no`` and ``split.count``; no tensor in two parts; as many tensors in all as the first
    part's ``split.tensors.count`` says). A missing part is a one-line :class:`ModelFormatError` naming it."""
    f = read_gguf(path)
    count = _count(f, "split.count")
    if count is None or count == 1:
        return [f]
    if count == 0:
        raise ModelFormatError(f"{f.path.name}: split.count is 0")
    parts: list[GGUFFile] = []
    seen: dict[str, str] = {}
    for i, p in enumerate(split_paths(f.path, count)):
        if p == f.path:
            g = f
        elif p.exists():
            g = read_gguf(p)
        else:
            raise ModelFormatError(f"{f.path.name} is one part of a GGUF split into {count} files, and {p.name} is "
                                   f"not beside it in {p.parent} (all {count} parts are needed)")
        no, of = _count(g, "split.no"), _count(g, "split.count")
        if (no, of) != (i, count):
            raise ModelFormatError(f"{p.name}: split.no {no} of split.count {of}, expected {i} of {count}")
        for name in g.tensor_infos:
            if name in seen:
                raise ModelFormatError(f"tensor {name!r} is in both {seen[name]} and {p.name}")
            seen[name] = p.name
        parts.append(g)
    want = _count(parts[0], "split.tensors.count")
    if want is not None and want != len(seen):
        raise ModelFormatError(f"{parts[0].path.name}: split.tensors.count says {want} tensors, the {count} parts "
                               f"hold {len(seen)}")
    return parts
