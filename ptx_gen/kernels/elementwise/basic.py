"""Small demo kernels that exercise the builder and the runtime: elementwise ops and a reduction."""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel


def _elementwise(k: KernelBuilder, vec: int, n: Reg, body) -> None:
    """Run ``body(byte_offset, width)`` for the ``vec`` elements of this thread; the tail of an
    ``n`` that is not a multiple of ``vec`` is handled one element at a time."""
    first = k.mul(k.global_index_x(), vec)
    full = k.setp("le", k.add(first, vec), n)
    done = k.new_label("done")
    with k.if_(full):
        body(k.mul_wide(first, 4), vec)
        k.bra(done)
    for j in range(vec):
        idx = k.add(first, j)
        with k.if_(k.setp("lt", idx, n)):
            body(k.mul_wide(idx, 4), 1)
    k.label(done)


def binary_map(m: Module, name: str, vec: int, inputs: tuple[str, str], out: str, op, *,
               nc: tuple[bool, bool] = (False, False), scalars: tuple[str, ...] = (),
               max_threads: int = 1024, block: int = 256, out_f16: bool = False) -> KernelBuilder:
    """``out[i] = op(k, a[i], b[i])`` over ``n`` float32 elements, ``vec`` per thread (16-byte loads at
    4), with the two inputs named ``inputs``; ``out`` may be a third pointer or one of the inputs (in
    place). ``scalars`` are f32 parameters between the pointers and ``n`` (read with ``k.param``);
    ``nc`` marks inputs that may be read through the non-coherent cache (never one written here);
    ``out_f16``: ``out`` is a separate f16 buffer (each result rounded to nearest even)."""
    if vec not in (1, 2, 4):
        raise ValueError(f"vec must be 1, 2 or 4, got {vec}")
    if out_f16 and out in inputs:
        raise ValueError("an f16 output cannot be an f32 input (in place)")
    pointers = [*inputs] + ([] if out in inputs else [out])
    params = [(p, "u64") for p in pointers] + [(s, "f32") for s in scalars] + [("n", "u32")]
    k = m.kernel(f"{name}_v{vec}" + ("_f16" if out_f16 else ""), params, max_threads=max_threads)
    k.meta.update(block=block, per_thread=vec)
    a, b, o, n = k.global_ptr(inputs[0]), k.global_ptr(inputs[1]), k.global_ptr(out), k.param("n")

    def body(off: Reg, width: int) -> None:
        xa = k.load("global", "f32", k.add(a, off), vec=width, nc=nc[0])
        xb = k.load("global", "f32", k.add(b, off), vec=width, nc=nc[1])
        xa, xb = (xa, xb) if width > 1 else ((xa,), (xb,))
        if not out_f16:
            k.store("global", "f32", k.add(o, off), [op(k, p, q) for p, q in zip(xa, xb)])
            return
        half = [k.cvt(op(k, p, q), "f16") for p, q in zip(xa, xb)]  # f16 at half the f32 byte offset
        if width == 1:
            k.store("global", "b16", k.add(o, k.shr(off, 1)), half[0])
        else:  # pairs of f16 in b32 words: one 4- or 8-byte store
            words = [k.pack_b32(half[i], half[i + 1]) for i in range(0, width, 2)]
            k.store("global", "b32", k.add(o, k.shr(off, 1)), words)

    _elementwise(k, vec, n, body)
    k.ret()
    return k


@kernel("vector_add", grid=[{"vec": 1}, {"vec": 2}, {"vec": 4}])
def vector_add(m: Module, vec: int = 4) -> KernelBuilder:
    """out[i] = a[i] + b[i] over n float32 elements; each thread handles ``vec`` (16-byte loads at 4)."""
    return binary_map(m, "vector_add", vec, ("a", "b"), "out", lambda k, p, q: k.add(p, q), nc=(True, True))


@kernel("axpy", grid=[{"vec": 1}, {"vec": 4}])
def axpy(m: Module, vec: int = 4) -> KernelBuilder:
    """y[i] = alpha * x[i] + y[i] in place (fused multiply-add, float32)."""
    return binary_map(m, "axpy", vec, ("x", "y"), "y", lambda k, p, q: k.fma(k.param("alpha"), p, q),
                      nc=(True, False), scalars=("alpha",))


def block_reduce(k: KernelBuilder, value: Reg, block: int, op: str = "add") -> Reg:
    """Reduce ``value`` over the whole block (``block`` threads, a multiple of 32); every thread gets
    the result. Uses a warp butterfly, one shared slot per warp, then a second butterfly."""
    warps = block // 32
    partial = k.warp_reduce(value, op)
    if warps == 1:
        return partial
    smem = k.shared_array(f"{k.name}_red", value.type, 32)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    with k.if_(k.setp("eq", lane, 0)):
        k.store("shared", value.type, k.add(smem, k.shl(warp, 2)), partial)
    k.bar_sync()
    neutral = {"add": 0.0, "max": float("-inf"), "min": float("inf")}[op]
    active = k.setp("lt", lane, warps)
    mine = k.load("shared", value.type, k.add(smem, k.shl(lane, 2)), pred=active, other=neutral)
    total = k.warp_reduce(mine, op)
    k.bar_sync()  # the shared slots may be reused by a following reduction
    return total


@kernel("row_sum", grid=[{"block": 32}, {"block": 128}, {"block": 256}, {"block": 1024}])
def row_sum(m: Module, block: int = 256) -> KernelBuilder:
    """out[r] = sum(x[r, :]) for a row-major [rows, cols] float32 matrix; one block per row."""
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    k = m.kernel(f"row_sum_b{block}", [("x", "u64"), ("out", "u64"), ("cols", "u32")], max_threads=block)
    k.meta.update(block=block)
    x, out, cols = k.global_ptr("x"), k.global_ptr("out"), k.param("cols")
    row = k.ctaid()
    row_base = k.add(x, k.mul_wide(k.mul(row, cols), 4))
    acc = k.var("f32", 0.0)
    with k.loop(k.tid(), cols, block) as c:
        v = k.load("global", "f32", k.add(row_base, k.mul_wide(c, 4)))
        k.assign(acc, k.add(acc, v))
    total = block_reduce(k, acc, block)
    with k.if_(k.setp("eq", k.tid(), 0)):
        k.store("global", "f32", k.add(out, k.mul_wide(row, 4)), total)
    k.ret()
    return k


@kernel("copy_row_indirect", grid=[{}])
def copy_row_indirect(m: Module) -> KernelBuilder:
    """dst[row, :] = src[:] for a [rows, cols] float32 matrix, with ``row`` read from a device u32
    (a graph-compatible position: the graph stays fixed while the value changes every step);
    rows at or past ``rows`` are ignored rather than written out of bounds."""
    k = m.kernel(
        "copy_row_indirect",
        [("src", "u64"), ("dst", "u64"), ("row_ptr", "u64"), ("rows", "u32"), ("cols", "u32")],
        max_threads=1024,
    )
    k.meta.update(block=256)
    src, dst, cols = k.global_ptr("src"), k.global_ptr("dst"), k.param("cols")
    row = k.load("global", "u32", k.global_ptr("row_ptr"))
    i = k.global_index_x()
    ok = k.setp("lt", i, cols)
    with k.if_(k.setp("lt", row, k.param("rows"))):
        with k.if_(ok):
            v = k.load("global", "f32", k.add(src, k.mul_wide(i, 4)))
            k.store("global", "f32", k.add(dst, k.mul_wide(k.mad(row, cols, i), 4)), v)
    k.ret()
    return k
