"""GGUF weights on the GPU: :class:`GpuWeight`, a 2-D weight in its block form, uploaded once and
stored in the layout its GEMV reads (:data:`LAYOUTS`). Which layout a weight gets on a device is the
GEMV's launch policy (:meth:`realizar.gpu.gemv.GemvOps.weight_layout` / ``upload``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ptx_gen.kernels.gemv.gemv_mma import MMA_TYPES, tile_major
from ptx_gen.kernels.gemv.quant_layout import WEIGHT_TYPES, check_in_dim, type_info
from realizar import cuda
from realizar.errors import ShapeError, UnsupportedError

__all__ = ["GpuWeight", "LAYOUTS", "weight_type_name"]

LAYOUTS = ("rows", "tiles", "glu-tiles")


def weight_type_name(ggml_type: Any) -> str:
    """The GGML type name of ``ggml_type`` (a name or a type id), if the GPU kernels read it."""
    if isinstance(ggml_type, str):
        name = ggml_type
    else:
        from realizar.models.quants import type_name  # needs gguf: only when a type id is given

        name = type_name(int(ggml_type))
    if name not in WEIGHT_TYPES:
        raise UnsupportedError(f"no GPU kernels for weight type {name}; supported: {', '.join(WEIGHT_TYPES)}")
    return name


class GpuWeight:
    """A 2-D weight ``(out_dim, in_dim)`` in GGUF block form on the GPU, uploaded once.

    The allocation is rounded up to a multiple of 16 bytes (the kernels read whole 16-byte vectors).
    Build it from a :class:`~realizar.models.tensor.QuantTensor` or from raw bytes, type and shape.
    ``layout``: "rows" keeps GGUF's rows; "tiles" stores the blocks tile-major for the tensor-core GEMV
    (:func:`ptx_gen.kernels.gemv_mma.tile_major`), "glu-tiles" likewise for the fused gate/up GEMV of a
    [gate; up] weight. Only the tensor-core GEMV reads tile-major weights; ``GemvOps.upload`` picks the
    layout the weight's GEMV wants. ``nbytes`` counts the weight's own bytes (not padding).
    """

    def __init__(self, tensor: Any = None, *, data: np.ndarray | None = None, ggml_type: Any = None,
                 shape: Sequence[int] | None = None, name: str = "", layout: str = "rows", device: Any = None):
        if tensor is not None:
            data, ggml_type, shape, name = tensor.data, tensor.ggml_type, tensor.shape, tensor.name
        if data is None or ggml_type is None or shape is None:
            raise ShapeError("GpuWeight needs a QuantTensor or data=, ggml_type= and shape=")
        self.wtype = weight_type_name(ggml_type)
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or min(shape) < 1:
            raise ShapeError(f"GpuWeight {name!r}: a weight matrix must be 2-D (out_dim, in_dim), got {shape}")
        self.out_dim, self.in_dim = shape
        try:
            check_in_dim(self.wtype, self.in_dim)
        except ValueError as exc:
            raise ShapeError(f"GpuWeight {name!r}: {exc}") from None
        self.name = name
        info = type_info(self.wtype)
        self.row_bytes = info.row_bytes(self.in_dim)
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if raw.size != self.row_bytes * self.out_dim:
            raise ShapeError(f"GpuWeight {name!r}: {self.wtype} {shape} needs {self.row_bytes * self.out_dim} "
                             f"bytes, got {raw.size}")
        self.nbytes = raw.size
        if layout not in LAYOUTS:
            raise ShapeError(f"GpuWeight {name!r}: layout must be one of {LAYOUTS}, got {layout!r}")
        if layout != "rows":
            if self.wtype not in MMA_TYPES:
                raise ShapeError(f"GpuWeight {name!r}: only {', '.join(MMA_TYPES)} weights can be stored tile-major, "
                                 f"not {self.wtype}")
            try:
                raw = tile_major(raw, self.wtype, self.out_dim, self.in_dim, glu=layout == "glu-tiles")
            except ValueError as exc:
                raise ShapeError(f"GpuWeight {name!r}: {exc}") from None
        self.layout = layout
        padded = -(-raw.size // 16) * 16
        self.buffer = cuda.GpuBuffer(padded, np.uint8, device=device)
        if padded != raw.size:
            self.buffer.fill_bytes(0)
        self.buffer.copy_from_host_at(raw, 0)

    @classmethod
    def concat(cls, tensors: Sequence[Any], name: str = "", layout: str = "rows", device: Any = None) -> "GpuWeight":
        """Stack the rows of several tensors of one type and row length (e.g. [gate; up] for the
        fused SwiGLU GEMV, or Q/K/V for one QKV GEMV)."""
        types = {weight_type_name(t.ggml_type) for t in tensors}
        ins = {int(t.shape[-1]) for t in tensors}
        if len(types) != 1 or len(ins) != 1:
            raise ShapeError(f"concat needs one weight type and row length, got {sorted(types)} / {sorted(ins)}")
        data = np.concatenate([np.ascontiguousarray(t.data).reshape(-1).view(np.uint8) for t in tensors])
        out = sum(int(t.shape[0]) for t in tensors)
        return cls(data=data, ggml_type=types.pop(), shape=(out, ins.pop()), name=name or "+".join(t.name for t in tensors),
                   layout=layout, device=device)

    @property
    def ptr(self) -> int:
        return self.buffer.ptr

    def free(self) -> None:
        self.buffer.free()

    def __repr__(self) -> str:
        tail = "" if self.layout == "rows" else f", {self.layout}"
        return f"GpuWeight({self.name!r}, {self.wtype}, ({self.out_dim}, {self.in_dim}){tail})"

    def require_rows(self, what: str) -> None:
        """Raise unless the weight keeps GGUF's rows (``what`` reads it that way)."""
        if self.layout != "rows":
            raise ShapeError(f"{what} reads GGUF rows, but GpuWeight {self.name!r} is stored {self.layout} for the "
                             f"tensor-core GEMV; upload it with layout='rows' for this use")
