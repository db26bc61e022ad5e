"""Elementwise layer kernels: SwiGLU, residual add, bias add (f32, any length, 16-byte vectors
where the length allows)."""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.elementwise.basic import binary_map

BLOCK = 256
LOG2E = 1.4426950408889634


def silu(k: KernelBuilder, g: Reg) -> Reg:
    """g / (1 + exp(-g)) (ex2.approx: relative error ~2**-22; -> -0 for large negative g)."""
    e = k.ex2(k.mul(g, -LOG2E))
    return k.div(g, k.add(e, 1.0))


@kernel("swiglu", grid=[{"vec": 1}, {"vec": 4}])
def swiglu(m: Module, vec: int = 4) -> KernelBuilder:
    """out[i] = silu(gate[i]) * up[i] for i < n (out may alias gate or up).
    Launch: grid ceil(n / (256 * vec)), block 256."""
    return binary_map(m, "swiglu", vec, ("gate", "up"), "out", lambda k, g, u: k.mul(silu(k, g), u),
                      max_threads=BLOCK, block=BLOCK)


@kernel("swiglu_f16", grid=[{"vec": 1}, {"vec": 2}, {"vec": 4}])
def swiglu_f16(m: Module, vec: int = 4) -> KernelBuilder:
    """:func:`swiglu` writing ``out`` as f16 (rounded to nearest even; a separate buffer): the SwiGLU of
    split gate and up projections of several rows, the f16 input of the down projection's batched GEMM.
    Launch: grid ceil(n / (256 * vec)), block 256."""
    return binary_map(m, "swiglu", vec, ("gate", "up"), "out", lambda k, g, u: k.mul(silu(k, g), u),
                      max_threads=BLOCK, block=BLOCK, out_f16=True)


@kernel("residual_add", grid=[{"vec": 1}, {"vec": 4}])
def residual_add(m: Module, vec: int = 4) -> KernelBuilder:
    """out[i] = a[i] + b[i] for i < n; out may alias a or b (h += x in place).
    Launch: grid ceil(n / (256 * vec)), block 256."""
    return binary_map(m, "residual_add", vec, ("a", "b"), "out", lambda k, p, q: k.add(p, q),
                      max_threads=BLOCK, block=BLOCK)


@kernel("bias_add", grid=[{}])
def bias_add(m: Module) -> KernelBuilder:
    """y[t, j] += bias[j] for j < n_cols, t < n_tokens (grid.y), in place.
    Launch: grid (ceil(n_cols / 256), n_tokens), block 256."""
    k = m.kernel("bias_add", [("y", "u64"), ("bias", "u64"), ("n_cols", "u32")], max_threads=BLOCK)
    k.meta.update(block=BLOCK)
    n_cols = k.param("n_cols")
    j = k.global_index_x()
    with k.if_(k.setp("lt", j, n_cols)):
        addr = k.add(k.global_ptr("y"), k.mul_wide(k.mad(k.ctaid("y"), n_cols, j), 4))
        b = k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(j, 4)), nc=True)
        k.store("global", "f32", addr, k.add(k.load("global", "f32", addr), b))
    k.ret()
    return k
