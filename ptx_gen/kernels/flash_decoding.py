"""Flash decoding (split-KV decode attention): a chunk kernel on a static grid and an exact reduce.

``flash_decoding_chunk`` runs on grid ``(num_kv_heads * subgroups, num_chunks)`` whatever the
sequence length, so a captured graph never changes shape. The rows per chunk are computed on the
device from ``seq_len`` (see :func:`ptx_gen.kernels.decode_core.chunk_rows`): the ``num_chunks``
blocks of a head share the sequence evenly, in multiples of the block's step, and never below
``min_chunk`` rows. A chunk that starts at or past ``seq_len`` writes a neutral partial (max = -inf,
sum = 0, acc = 0).

Partials (log2 domain): ``part_ml[h, c] = (max_c, sum_c)`` and ``part_acc[h, c, :] = acc_c`` with
``acc_c = sum_j ex2(s_j - max_c) v_j``. ``flash_decoding_reduce`` (one block per query head)
combines them exactly: ``out = sum_c ex2(max_c - M) acc_c / sum_c ex2(max_c - M) sum_c`` with
``M = max_c max_c``; weights of neutral partials are 0 (their acc is never read), and a -inf ``M``
is never subtracted from itself.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.decode_core import (
    NEG_INF, block_heads, build_decode_pass, check_head_dim, decode_layout, emit_chunk_rows, emit_combine,
    guard_base, lane_setup, load_q, load_seq_len, safe_reciprocal, seq_len_param,
)

_CHUNK_GRID = [
    {"head_dim": 64, "group": 7},
    {"head_dim": 128, "group": 4, "indirect": True},
    {"head_dim": 128, "group": 7, "indirect": True},
    {"head_dim": 80, "group": 1},
    {"head_dim": 256, "group": 2, "indirect": True},
    {"head_dim": 48, "group": 6},
    {"head_dim": 96, "group": 4},
    {"head_dim": 32, "group": 8},
]


@kernel("flash_decoding_chunk", grid=_CHUNK_GRID)
def flash_decoding_chunk(
    m: Module, head_dim: int = 128, group: int = 1, indirect: bool = True,
    heads_per_block: int | None = None, warps: int = 4, unroll: int | None = None, prefetch: bool = False,
) -> KernelBuilder:
    """Partial attention of each query head over one chunk of the cache rows (split-KV decode).

    q: [num_heads, head_dim]; caches [num_kv_heads, max_len, head_dim]; part_acc:
    [num_heads, num_chunks, head_dim]; part_ml: [num_heads, num_chunks, 2]. seq_len from a value or
    (``indirect``) a device u32. Launch: grid (num_kv_heads * meta['subgroups'], num_chunks), block
    meta['block']; ``min_chunk`` >= 1 (use a multiple of meta['quantum'])."""
    lay = decode_layout(head_dim, group, heads_per_block, warps, unroll, prefetch)
    name = (f"flash_decoding_chunk_d{head_dim}_g{group}_hb{lay.heads_per_block}_w{warps}_u{lay.unroll}"
            f"{'_pf' if prefetch else ''}{'_ind' if indirect else ''}")
    params = [("q", "u64"), ("k_cache", "u64"), ("v_cache", "u64"), ("part_acc", "u64"), ("part_ml", "u64"),
              seq_len_param(indirect), ("max_len", "u32"), ("min_chunk", "u32")]
    k = m.kernel(name, params)  # no .maxntid: with it ptxas picked 56 registers and spilled for D=80
    k.meta.update(block=lay.threads, subgroups=lay.subgroups, heads_per_block=lay.heads_per_block,
                  quantum=lay.rows_per_step, layout=lay)
    kvh, head0 = block_heads(k, lay)
    lanes = lane_setup(k, lay)
    qv = load_q(k, lay, lanes, head0)  # before the seq_len-dependent branch: its latency overlaps
    seq_len = load_seq_len(k, indirect)
    nch = k.sreg("nctaid.y")
    cidx = k.ctaid("y")
    rows = emit_chunk_rows(k, seq_len, nch, lay.rows_per_step, k.param("min_chunk"))
    start = k.mul(cidx, rows)
    end = k.min(k.add(start, rows), seq_len)
    part_acc, part_ml = k.global_ptr("part_acc"), k.global_ptr("part_ml")
    tid = lanes.tid
    slots = lay.heads_per_block * lay.nc

    def partial_index(i):
        """(head * num_chunks + chunk) for head head0 + i."""
        head = k.add(head0, i) if i is not None else head0
        return k.mad(head, nch, cidx)

    # a chunk at or past the end: neutral partial, then leave (block-uniform branch, before any barrier)
    with k.if_(k.setp("ge", start, seq_len)):
        for it in range(-(-slots // lay.threads)):
            slot = k.add(tid, it * lay.threads) if it else tid
            with k.if_(k.setp("lt", slot, slots)):
                i = k.div(slot, lay.nc) if lay.heads_per_block > 1 else None
                c4 = k.rem(slot, lay.nc) if lay.heads_per_block > 1 else slot
                pidx = partial_index(i)
                k.store("global", "f32", k.add(part_acc, k.mul_wide(k.mad(pidx, lay.nc, c4), 16)), [0.0] * 4)
                with k.if_(k.setp("eq", c4, 0)):
                    k.store("global", "f32", k.add(part_ml, k.mul_wide(pidx, 8)), [NEG_INF, 0.0])
        k.ret()

    st = build_decode_pass(k, lay, lanes, qv, kvh, head0, start, end, "fdc")

    def write(i, c4, mx, total, acc4):
        pidx = partial_index(i)
        k.store("global", "f32", k.add(part_acc, k.mul_wide(k.mad(pidx, lay.nc, c4), 16)), acc4)
        with k.if_(k.setp("eq", c4, 0)):
            k.store("global", "f32", k.add(part_ml, k.mul_wide(pidx, 8)), [mx, total])

    emit_combine(k, st, write)
    k.ret()
    return k


_REDUCE_GRID = [
    {"head_dim": 64, "num_chunks": 256},
    {"head_dim": 128, "num_chunks": 64, "indirect": True},
    {"head_dim": 80, "num_chunks": 37},
    {"head_dim": 256, "num_chunks": 128},
    {"head_dim": 32, "num_chunks": 1},
]

_REDUCE_THREADS = 256


def _block_reduce(k: KernelBuilder, value, threads: int, op: str, slots):
    """Reduce over the block with a warp butterfly and one shared slot per warp (``slots``: a shared
    array of >= threads // 32 floats, reusable after return); every thread gets the result."""
    warps = threads // 32
    partial = k.warp_reduce(value, op)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    with k.if_(k.setp("eq", lane, 0)):
        k.store("shared", "f32", k.add(slots, k.shl(warp, 2)), partial)
    k.bar_sync()
    neutral = {"add": 0.0, "max": NEG_INF}[op]
    mine = k.load("shared", "f32", k.add(slots, k.shl(lane, 2)), pred=k.setp("lt", lane, warps), other=neutral)
    total = k.warp_reduce(mine, op)
    k.bar_sync()
    return total
_LOADS_IN_FLIGHT = 8


@kernel("flash_decoding_reduce", grid=_REDUCE_GRID)
def flash_decoding_reduce(m: Module, head_dim: int = 128, num_chunks: int = 64, indirect: bool = True) -> KernelBuilder:
    """out[h] = exact combination of the ``num_chunks`` partials of query head h (see the module doc).

    Launch: grid (num_heads,), block meta['block']. ``seq_len`` is only used to clamp and is
    accepted for symmetry with the chunk kernel (a zero-length sequence writes zeros)."""
    check_head_dim(head_dim)
    if not isinstance(num_chunks, int) or not 1 <= num_chunks <= 4096:
        raise ValueError(f"num_chunks must be in 1..4096, got {num_chunks!r}")
    NC = head_dim // 4
    NT = _REDUCE_THREADS
    lanes = NT // NC  # chunk lanes: threads (cl, c4) with c4 fastest
    name = f"flash_decoding_reduce_d{head_dim}_n{num_chunks}{'_ind' if indirect else ''}"
    params = [("part_acc", "u64"), ("part_ml", "u64"), ("out", "u64"), seq_len_param(indirect), ("max_len", "u32")]
    k = m.kernel(name, params, max_threads=NT)
    k.meta.update(block=NT)
    part_acc, part_ml, out = k.global_ptr("part_acc"), k.global_ptr("part_ml"), k.global_ptr("out")
    head = k.ctaid("x")
    tid = k.tid()
    seq_len = load_seq_len(k, indirect)
    row0 = k.mul(head, num_chunks)  # index of partial (head, 0)

    # phase A: global max and weighted sum over the partials; weights to shared memory
    sm_w = k.shared_array("fdr_w", "f32", num_chunks)
    per_thread = -(-num_chunks // NT)
    mls = []
    for a in range(per_thread):
        c = k.add(tid, a * NT) if a else tid
        ok = k.setp("lt", c, num_chunks) if (a + 1) * NT > num_chunks else None
        addr = k.add(part_ml, k.mul_wide(k.add(row0, c), 8))
        if ok is not None:
            mv, lv = k.load("global", "f32", addr, vec=2, pred=ok, other=NEG_INF)
            lv = k.selp(lv, 0.0, ok)
        else:
            mv, lv = k.load("global", "f32", addr, vec=2)
        mls.append((c, ok, mv, lv))
    mloc = mls[0][2]
    for _, _, mv, _ in mls[1:]:
        mloc = k.max(mloc, mv)
    slots = k.shared_array("fdr_slots", "f32", 32)
    big = _block_reduce(k, mloc, NT, "max", slots)
    base = guard_base(k, big)
    lsum = None
    for c, ok, mv, lv in mls:
        w = k.ex2(k.sub(mv, base))  # -inf (neutral or missing) -> 0
        lsum = k.mul(lv, w) if lsum is None else k.fma(lv, w, lsum)
        k.store("shared", "f32", k.add(sm_w, k.shl(c, 2)), w, pred=ok)
    total = _block_reduce(k, lsum, NT, "add", slots)  # its barriers also publish sm_w
    k.bar_sync()
    inv = safe_reciprocal(k, total)

    # phase B: thread (cl, c4) sums chunks cl, cl + lanes, ... for float4 column c4
    sm_red = k.shared_array("fdr_red", "f32", lanes * NC * 4)
    c4 = k.rem(tid, NC)
    cl = k.div(tid, NC)
    active = k.setp("lt", tid, lanes * NC)
    acc4 = [k.var("f32", 0.0) for _ in range(4)]
    steps = -(-num_chunks // lanes)
    with k.if_(active):
        col = k.mul_wide(c4, 16)
        for g0 in range(0, steps, _LOADS_IN_FLIGHT):
            batch = []
            for b in range(g0, min(steps, g0 + _LOADS_IN_FLIGHT)):
                c = k.add(cl, b * lanes) if b else cl
                in_range = k.setp("lt", c, num_chunks) if (b + 1) * lanes > num_chunks else None
                w = k.load("shared", "f32", k.add(sm_w, k.shl(c, 2)), pred=in_range, other=0.0) \
                    if in_range is not None else k.load("shared", "f32", k.add(sm_w, k.shl(c, 2)))
                use = k.setp("ne", w, 0.0)
                addr = k.add(k.add(part_acc, k.mul_wide(k.add(row0, c), head_dim * 4)), col)
                vals = k.load("global", "f32", addr, vec=4, pred=use, other=0.0)
                batch.append((w, vals))
            for w, vals in batch:
                for e in range(4):
                    k.assign(acc4[e], k.fma(vals[e], w, acc4[e]))
        k.store("shared", "f32", k.add(sm_red, k.shl(tid, 4)), list(acc4))
    k.bar_sync()
    with k.if_(k.setp("lt", tid, NC)):
        res = None
        for x in range(lanes):
            vals = k.load("shared", "f32", k.add(sm_red, k.shl(tid, 4)), x * NC * 16, vec=4)
            res = list(vals) if res is None else [k.add(r, v) for r, v in zip(res, vals)]
        empty = k.setp("eq", seq_len, 0)
        outv = [k.selp(0.0, k.mul(r, inv), empty) for r in res]
        k.store("global", "f32", k.add(out, k.mul_wide(k.mad(head, NC, tid), 16)), outv)
    k.ret()
    return k
