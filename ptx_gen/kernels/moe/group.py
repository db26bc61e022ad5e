"""Grouping a mixture-of-experts batch by expert on the device (a counting sort), so one grouped GEMM launch
(:func:`ptx_gen.kernels.gemm.gemm_q.gemm_q_experts`) reads each chosen expert's weights once per tile of its
tokens instead of once per token.

``moe_group``: the ``pairs`` (token, slot) pairs of ``ids [pairs]`` (u32 expert ids, the router's ``[rows,
used]``) counted per expert in shared memory (atomics), one warp's scan of the counts gives each expert its
range of ``order`` and its tiles of at most ``mt`` pairs; each pair is then written at its expert's next place
(an atomic cursor: within an expert the order of pairs is the atomics' order, which no result depends on).

Outputs: ``order [pairs]`` (u32 pair indices, expert by expert, ascending expert) and ``tiles [max_tiles]``
records of two u32 (``start`` into ``order``, ``expert << 8 | count``, 1 <= count <= mt), expert by expert;
records past the last tile are (0, 0): count 0, a GEMM CTA that has nothing to do. ``max_tiles`` must be at
least ``pairs // mt + min(experts, pairs)`` (every expert adds at most one partial tile). One CTA:
grid 1, block meta["block"].
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.moe.route import MAX_EXPERTS

TILE_TOKENS = (8, 16, 32, 64, 128)
BLOCK = 512


def max_tiles(pairs: int, experts: int, mt: int) -> int:
    """The tile records a batch of ``pairs`` pairs can need (the GEMM's grid.y)."""
    return pairs // mt + min(experts, pairs)


@kernel("moe_group", grid=[{"experts": 128, "mt": 16}, {"experts": 8, "mt": 64}, {"experts": 60, "mt": 8},
                           {"experts": 256, "mt": 128}])
def moe_group(m: Module, experts: int = 128, mt: int = 16) -> KernelBuilder:
    """order, tiles of ``ids`` grouped by expert (see the module docstring). Params: ids, order, tiles, pairs,
    max_tiles. Launch: grid 1, block meta["block"]."""
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be 1..{MAX_EXPERTS}, got {experts}")
    if mt not in TILE_TOKENS:
        raise ValueError(f"mt (pairs per tile) must be one of {TILE_TOKENS}, got {mt}")
    name = f"moe_group_e{experts}_m{mt}"
    k = m.kernel(name, [("ids", "u64"), ("order", "u64"), ("tiles", "u64"), ("pairs", "u32"), ("max_tiles", "u32")],
                 max_threads=BLOCK)
    k.meta.update(block=BLOCK)
    count = k.shared_array(f"{name}_count", "u32", experts)
    cursor = k.shared_array(f"{name}_cursor", "u32", experts)
    total = k.shared_array(f"{name}_total", "u32", 1)
    tid = k.tid()
    pairs = k.param("pairs")
    with k.loop(tid, experts, BLOCK) as e:
        k.store("shared", "u32", k.add(count, k.shl(e, 2)), 0)
    k.bar_sync()
    k.grid_dependency_wait()  # (the ids come from the router's top-k)
    ids, order, tiles = k.global_ptr("ids"), k.global_ptr("order"), k.global_ptr("tiles")

    def expert_of(p) -> object:
        return k.load("global", "u32", k.add(ids, k.mul_wide(p, 4)))

    with k.loop(tid, pairs, BLOCK) as p:
        k.atom("shared", "add", "u32", k.add(count, k.shl(expert_of(p), 2)), 1)
    k.bar_sync()

    # warp 0: lane l owns experts l * per .. l * per + per - 1; a warp scan of their pair and tile counts
    per = -(-experts // 32)
    shift = mt.bit_length() - 1
    with k.if_(k.setp("lt", tid, 32)):
        first = k.mul(tid, per)
        es = [k.add(first, i) if i else first for i in range(per)]
        oks = [k.setp("lt", e, experts) for e in es]
        cs = [k.load("shared", "u32", k.add(count, k.shl(e, 2)), pred=ok, other=0) for e, ok in zip(es, oks)]
        ts = [k.shr(k.add(c, mt - 1), shift) for c in cs]
        c_sum, t_sum = cs[0], ts[0]
        for c, t in zip(cs[1:], ts[1:]):
            c_sum, t_sum = k.add(c_sum, c), k.add(t_sum, t)
        c_inc, t_inc = k.var("u32", c_sum), k.var("u32", t_sum)
        for d in (1, 2, 4, 8, 16):
            up_c, up_t = k.shfl("up", c_inc, d), k.shfl("up", t_inc, d)
            lo = k.setp("ge", tid, d)
            k.assign(c_inc, k.add(c_inc, k.selp(up_c, 0, lo, "u32")))
            k.assign(t_inc, k.add(t_inc, k.selp(up_t, 0, lo, "u32")))
        pair_at = k.var("u32", k.sub(c_inc, c_sum))
        tile_at = k.var("u32", k.sub(t_inc, t_sum))
        for e, ok, c, t in zip(es, oks, cs, ts):
            with k.if_(ok):
                k.store("shared", "u32", k.add(cursor, k.shl(e, 2)), pair_at)
                with k.loop(0, t) as j:
                    off = k.shl(j, shift)
                    rec = k.add(tiles, k.mul_wide(k.add(tile_at, j), 8))
                    k.store("global", "u32", rec, k.add(pair_at, off))
                    k.store("global", "u32", rec, k.or_(k.shl(e, 8), k.min(k.sub(c, off), mt)), 4)
            k.assign(pair_at, k.add(pair_at, c))
            k.assign(tile_at, k.add(tile_at, t))
        with k.if_(k.setp("eq", tid, 31)):
            k.store("shared", "u32", total, t_inc)
    k.bar_sync()

    with k.loop(tid, pairs, BLOCK) as p:
        at = k.atom("shared", "add", "u32", k.add(cursor, k.shl(expert_of(p), 2)), 1)
        k.store("global", "u32", k.add(order, k.mul_wide(at, 4)), p)
    with k.loop(k.add(k.load("shared", "u32", total), tid), k.param("max_tiles"), BLOCK) as t:
        rec = k.add(tiles, k.mul_wide(t, 8))
        k.store("global", "u32", rec, 0)
        k.store("global", "u32", rec, 0, 4)
    k.ret()
    return k
