"""Argmax over a vector of f32 (a vocabulary of up to 2**31 entries), in two passes, ties to the
lowest index like ``numpy.argmax`` (and, like it, a NaN counts as the maximum: the first NaN wins).

Each candidate is packed into one u64 that orders exactly as wanted:
``key(v) << 32 | (0xFFFFFFFF - index)`` where ``key`` maps f32 to u32 monotonically (NaN -> the
largest key); the maximum u64 is the largest value and, among equals, the lowest index.

* ``argmax_partial``: grid ``P`` CTAs (grid-stride loop), each writes its best packed u64 to
  ``partials[ctaid]``;
* ``argmax_final``: one CTA reduces the ``P`` partials and writes the u32 index to ``out[0]``.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel


def pack(k: KernelBuilder, v: Reg, idx: Reg) -> Reg:
    """The u64 ordering key of candidate (v, idx): larger value first, then lower index."""
    bits = k.selp(0, k.bitcast(v, "u32"), k.setp("eq", v, 0.0), t="u32")  # -0 ties with +0
    neg = k.setp("ne", k.and_(bits, 0x80000000), 0)
    key = k.selp(k.not_(bits), k.or_(bits, 0x80000000), neg, t="u32")
    key = k.selp(0xFFFFFFFF, key, _is_nan(k, v), t="u32")
    lo = k.sub(0xFFFFFFFF, idx, t="u32")
    return k.or_(k.shl(k.cvt(key, "u64"), 32), k.cvt(lo, "u64"))


def _is_nan(k: KernelBuilder, v: Reg) -> Reg:
    """v != v, as a predicate (``setp.nan``)."""
    d = k.reg("pred")
    k._emit(f"setp.nan.f32 {d}, {v}, {v};")
    return d


def _warp_max_u64(k: KernelBuilder, v: Reg) -> Reg:
    acc = v
    for off in (16, 8, 4, 2, 1):
        lo = k.cvt(acc, "u32")
        hi = k.cvt(k.shr(acc, 32), "u32")
        olo = k.shfl("bfly", lo, off)
        ohi = k.shfl("bfly", hi, off)
        other = k.or_(k.shl(k.cvt(ohi, "u64"), 32), k.cvt(olo, "u64"))
        acc = k.max(acc, other)
    return acc


def block_max_u64(k: KernelBuilder, v: Reg, block: int) -> Reg:
    """Max over the block; valid in thread 0."""
    part = _warp_max_u64(k, v)
    warps = block // 32
    if warps == 1:
        return part
    smem = k.shared_array(f"{k.name}_red", "u64", 32, align=8)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    with k.if_(k.setp("eq", lane, 0)):
        k.store("shared", "u64", k.add(smem, k.shl(warp, 3)), part)
    k.bar_sync()
    mine = k.load("shared", "u64", k.add(smem, k.shl(lane, 3)), pred=k.setp("lt", lane, warps), other=0)
    return _warp_max_u64(k, mine)


@kernel("argmax_partial", grid=[{"block": 256}, {"block": 1024}])
def argmax_partial(m: Module, block: int = 256) -> KernelBuilder:
    """partials[c] = best packed (value, index) of x[i] for i = c*block + tid + j*gridDim*block < n.
    Launch: grid P (<= 1024), block ``block``."""
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    k = m.kernel(f"argmax_partial_b{block}", [("x", "u64"), ("partials", "u64"), ("n", "u32")], max_threads=block)
    k.meta.update(block=block)
    x, n = k.global_ptr("x"), k.param("n")
    stride = k.mul(k.sreg("nctaid.x"), block)
    best = k.var("u64", 0)  # below every packed candidate (key >= 1 for any float)
    with k.loop(k.global_index_x(), n, stride) as i:
        v = k.load("global", "f32", k.add(x, k.mul_wide(i, 4)))
        k.assign(best, k.max(best, pack(k, v, i)))
    total = block_max_u64(k, best, block)
    with k.if_(k.setp("eq", k.tid(), 0)):
        k.store("global", "u64", k.add(k.global_ptr("partials"), k.mul_wide(k.ctaid(), 8)), total)
    k.ret()
    return k


def _best_partial(k: KernelBuilder, block: int):
    """The largest of the u64 ``partials[0 .. n_partials)``, for thread 0 (the block strides over them)."""
    parts, np_ = k.global_ptr("partials"), k.param("n_partials")
    best = k.var("u64", 0)
    with k.loop(k.tid(), np_, block) as i:
        k.assign(best, k.max(best, k.load("global", "u64", k.add(parts, k.mul_wide(i, 8)))))
    return block_max_u64(k, best, block)


@kernel("argmax_final", grid=[{"block": 1024}, {"block": 128}])
def argmax_final(m: Module, block: int = 1024) -> KernelBuilder:
    """out[0] = index of the best of partials[0 .. n_partials). Launch: grid 1, block ``block``."""
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    k = m.kernel(f"argmax_final_b{block}", [("partials", "u64"), ("out", "u64"), ("n_partials", "u32")],
                 max_threads=block)
    k.meta.update(block=block)
    total = _best_partial(k, block)
    with k.if_(k.setp("eq", k.tid(), 0)):
        idx = k.sub(0xFFFFFFFF, k.cvt(total, "u32"), t="u32")
        k.store("global", "u32", k.global_ptr("out"), idx)
    k.ret()
    return k


@kernel("argmax_pack", grid=[{"block": 1024}, {"block": 128}])
def argmax_pack(m: Module, block: int = 1024) -> KernelBuilder:
    """out[0] (u64) = the best of partials[0 .. n_partials), its index moved up by ``base``.

    The candidate of a slice ``x[base : base + n]`` of a longer vector (a tensor-parallel rank's piece
    of the vocabulary): since the low word is ``0xFFFFFFFF - index``, adding ``base`` to the index is
    subtracting ``base`` from the packed u64 (no borrow while ``base + index < 2**32``). Candidates of
    several slices then compare as u64 exactly as their elements would in the whole vector (larger
    value, then lower global index), and ``argmax_final`` over them gives the global argmax.
    Launch: grid 1, block ``block``."""
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [32, 1024], got {block}")
    k = m.kernel(f"argmax_pack_b{block}", [("partials", "u64"), ("out", "u64"), ("n_partials", "u32"),
                                           ("base", "u32")], max_threads=block)
    k.meta.update(block=block)
    total = _best_partial(k, block)
    with k.if_(k.setp("eq", k.tid(), 0)):
        k.store("global", "u64", k.global_ptr("out"), k.sub(total, k.cvt(k.param("base"), "u64"), t="u64"))
    k.ret()
    return k
