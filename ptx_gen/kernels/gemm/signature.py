"""The parameters and name flags every GEMM with the shared epilogue has (``gemm_f16``, ``gemm_q``, ``gemm_wg``,
``gemm_ws``, ``gemm_x8``): its operand pointers, then ``bias`` and ``residual`` where it has them, then its sizes;
the flags ``_bias``, ``_res``, ``_h`` (f16 output), ``_glu`` in its name; the epilogue combinations it refuses."""

from __future__ import annotations

__all__ = ["epilogue_signature"]


def epilogue_signature(pointers: list[str], sizes: list[str], *, bias: bool, residual: bool, out_f16: bool,
                       glu: bool, layout: str | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(name flags, params): u64 ``pointers``, [bias], [residual], u32 ``sizes``. Raises ValueError for a SwiGLU
    epilogue with a bias or residual, and for a "glu-tiles" ``layout`` without ``glu`` (only the SwiGLU GEMM
    reads a [gate; up] weight)."""
    if glu and (bias or residual):
        raise ValueError("the SwiGLU epilogue takes no bias or residual")
    if layout == "glu-tiles" and not glu:
        raise ValueError("a glu-tiles weight is [gate; up]: only the glu GEMM reads it")
    flags = "".join(f"_{n}" for n, on in (("bias", bias), ("res", residual), ("h", out_f16), ("glu", glu)) if on)
    params = [(p, "u64") for p in pointers] + [("bias", "u64")] * bias + [("residual", "u64")] * residual
    return flags, params + [(s, "u32") for s in sizes]
