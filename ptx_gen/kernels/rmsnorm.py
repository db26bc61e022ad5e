"""RMSNorm, optionally fused with the residual add that precedes it.

    y = h / sqrt(mean(h^2) + eps) * weight,   h = x            (plain)
                                              h = residual + x  (fused; h is written back to residual)

One CTA per row (grid.x = rows; rows are ``hidden`` f32 apart), each thread holding ``hidden / (4 *
block)`` float4 of h in registers between the reduction and the scaling, so x is read once.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.basic import block_reduce

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
    if hidden % 4 or not 4 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden must be a multiple of 4 in [4, {MAX_HIDDEN}], got {hidden}")
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    params = [("x", "u64"), ("weight", "u64"), ("y", "u64")]
    if residual:
        params.append(("residual", "u64"))
    params.append(("eps", "f32"))
    k = m.kernel(f"rmsnorm_h{hidden}_b{block}" + ("_res" if residual else ""), params, max_threads=block)
    k.meta.update(block=block)
    vecs = hidden // 4
    per = -(-vecs // block)
    tid = k.tid()
    row_off = k.mul_wide(k.ctaid(), hidden * 4)
    x = k.add(k.global_ptr("x"), row_off)
    y = k.add(k.global_ptr("y"), row_off)
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
        k.store("global", "f32", k.add(y, off), out, pred=ok)
    k.ret()
    return k
