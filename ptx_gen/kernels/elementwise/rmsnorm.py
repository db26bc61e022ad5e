"""RMSNorm, optionally fused with the residual add that precedes it.

    y = h / sqrt(mean(h^2) + eps) * weight,   h = x            (plain)
                                              h = residual + x  (fused; h is written back to residual)

One CTA per row (grid.x = rows; rows are ``hidden`` f32 apart), each thread holding ``hidden / (4 *
block)`` float4 of h in registers between the reduction and the scaling, so x is read once.
``rmsnorm_f16`` is the same kernel writing y as f16 (rounded to nearest even; rows ``hidden`` f16
apart), the A operand of the f16 tensor-core GEMM.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.elementwise.basic import block_reduce

MAX_HIDDEN = 16384


def default_block(hidden: int) -> int:
    """A block size giving each thread about four float4 (at most 512 threads, eight float4)."""
    vecs = hidden // 4
    b = -(-vecs // 4)
    return max(32, min(512, -(-b // 32) * 32))  # 1024 threads: ptxas spills the fused variant


@kernel("rmsnorm", grid=[{"hidden": h, "block": default_block(h), "residual": r}
                         for h in (64, 576, 4096, 16384) for r in (False, True)]
        + [{"hidden": 4100, "block": 96}])
def rmsnorm(m: Module, hidden: int = 4096, block: int = 256, residual: bool = False) -> KernelBuilder:
    """y[r] = h[r] * rsqrt(mean(h[r]^2) + eps) * weight for each row r (grid.x), f32; with ``residual``,
    h = residual + x and h is stored back into residual (in place). Launch: grid rows, block ``block``."""
    return build_rmsnorm(m, hidden, block, residual)


@kernel("rmsnorm_f16", grid=[{"hidden": h, "block": default_block(h), "residual": r}
                             for h, r in ((576, False), (4096, True), (16384, False), (64, True))])
def rmsnorm_f16(m: Module, hidden: int = 4096, block: int = 256, residual: bool = False) -> KernelBuilder:
    """:func:`rmsnorm` writing y as f16 (each f32 result rounded to nearest even; rows ``hidden`` f16
    apart). Launch: grid rows, block ``block``."""
    return build_rmsnorm(m, hidden, block, residual, out_f16=True)


def build_rmsnorm(m: Module, hidden: int, block: int, residual: bool, out_f16: bool = False) -> KernelBuilder:
    """The RMSNorm kernel of :func:`rmsnorm` (``out_f16``: of :func:`rmsnorm_f16`)."""
    if hidden % 4 or not 4 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be a multiple of 4 in [4, {MAX_HIDDEN}], got {hidden}")
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    params = [("x", "u64"), ("weight", "u64"), ("y", "u64")]
    if residual:
        params.append(("residual", "u64"))
    params.append(("eps", "f32"))
    name = f"rmsnorm_h{hidden}_b{block}" + ("_res" if residual else "") + ("_f16" if out_f16 else "")
    # no .maxntid for the f16 output: with it ptxas fits the residual form in 32 registers on sm_90 and spills
    k = m.kernel(name, params, max_threads=None if out_f16 else block)
    k.meta.update(block=block)
    vecs = hidden // 4
    per = -(-vecs // block)
    tid = k.tid()
    row_off = k.mul_wide(k.ctaid(), hidden * 4)
    x = k.add(k.global_ptr("x"), row_off)
    y = k.add(k.global_ptr("y"), k.shr(row_off, 1) if out_f16 else row_off)
    wt = k.global_ptr("weight")
    res = k.add(k.global_ptr("residual"), row_off) if residual else None
    hs, oks, offs = [], [], []
    ss = None
    for c in range(per):
        v = k.add(tid, c * block) if c else tid
        ok = None if (c + 1) * block <= vecs else k.setp("lt", v, vecs)
        off = k.mul_wide(v, 16)
        if ok is None:
            h = list(k.load("global", "f32", k.add(x, off), vec=4))
        else:
            h = list(k.load("global", "f32", k.add(x, off), vec=4, pred=ok, other=0.0))
        if residual:
            if ok is None:
                r = k.load("global", "f32", k.add(res, off), vec=4)
            else:
                r = k.load("global", "f32", k.add(res, off), vec=4, pred=ok, other=0.0)
            h = [k.add(a, b) for a, b in zip(r, h)]
            k.store("global", "f32", k.add(res, off), h, pred=ok)
        for e in h:
            ss = k.mul(e, e) if ss is None else k.fma(e, e, ss)
        hs.append(h)
        oks.append(ok)
        offs.append(off)
    total = block_reduce(k, ss, block)
    inv = k.rsqrt(k.add(k.mul(total, 1.0 / hidden), k.param("eps")))
    for h, ok, off in zip(hs, oks, offs):
        wv = k.load("global", "f32", k.add(wt, off), vec=4, nc=True) if ok is None else \
            k.load("global", "f32", k.add(wt, off), vec=4, nc=True, pred=ok, other=0.0)
        out = [k.mul(k.mul(e, inv), w) for e, w in zip(h, wv)]
        if out_f16:  # four f16 in two b32 words: one 8-byte store
            half = [k.cvt(e, "f16") for e in out]
            words = [k.pack_b32(half[0], half[1]), k.pack_b32(half[2], half[3])]
            k.store("global", "b32", k.add(y, k.shr(off, 1)), words, pred=ok)
        else:
            k.store("global", "f32", k.add(y, off), out, pred=ok)
    k.ret()
    return k
