"""Tiny hand-written PTX kernels for the emulator's unit tests: ``one_op(body)`` wraps a body that turns
``%r1 = a[tid]``, ``%r2 = b[tid]`` (32-bit words) into ``%r3``, stored to ``out[tid]``."""

from __future__ import annotations

import numpy as np

from ptx_gen.emulator import Memory, run

HEADER = ".version 8.0\n.target sm_90\n.address_size 64\n"


def kernel(body: str, params: str = ".param .u64 k_param_a, .param .u64 k_param_b, .param .u64 k_param_out",
           shared: str = "") -> str:
    return f"{HEADER}\n.visible .entry k(\n    {params}\n)\n{{\n    {shared}\n{body}\n}}\n"


PROLOGUE = """
    ld.param.u64 %rd0, [k_param_a];
    ld.param.u64 %rd1, [k_param_b];
    ld.param.u64 %rd2, [k_param_out];
    mov.u32 %r0, %tid.x;
    mul.wide.u32 %rd3, %r0, 4;
    add.s64 %rd4, %rd0, %rd3;
    add.s64 %rd5, %rd1, %rd3;
    add.s64 %rd6, %rd2, %rd3;
    ld.global.b32 %r1, [%rd4];
    ld.global.b32 %r2, [%rd5];
"""


def one_op(op_lines: str) -> str:
    return kernel(PROLOGUE + op_lines + "\n    st.global.b32 [%rd6], %r3;\n    ret;")


def run_words(ptx: str, a: np.ndarray, b: np.ndarray, threads: int | None = None, **kw) -> np.ndarray:
    """Run ``ptx`` on one block of ``len(a)`` threads; the output words viewed as ``a``'s dtype."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    n = a.size
    mem = Memory()
    pa, pb = mem.alloc_array(a), mem.alloc_array(b)
    po = mem.alloc(4 * n)
    run(ptx, (1,), (threads or n,), {"a": pa, "b": pb, "out": po}, mem, **kw)
    return mem.read(po, a.dtype, n)
