"""Flash decoding (split-KV decode attention) on a static grid, as one launch or as two.

Both forms run on grid ``(num_kv_heads * subgroups, num_chunks)`` whatever the sequence length, so a
captured graph never changes shape. The rows per chunk are computed on the device from ``seq_len``
(see :func:`ptx_gen.kernels.attention.decode_core.chunk_rows`): the ``num_chunks`` blocks of a head share the
sequence evenly, row by row, never below ``min_chunk`` rows (single launch: and, while chunks of at most
``grow_rows`` rows allow it, in at most ``GROUP_CHUNKS`` chunks); the first ``ceil(L / rows)`` chunks are
*active*.

Partials (log2 domain): ``part_ml[h, c] = (max_c, sum_c)`` and ``part_acc[h, c, :] = acc_c`` with
``acc_c = sum_j ex2(s_j - max_c) v_j``; they combine exactly: ``out = sum_c ex2(max_c - M) acc_c /
sum_c ex2(max_c - M) sum_c`` with ``M = max_c max_c``.

* ``flash_decoding`` (one launch): inactive chunks return at once. One active chunk writes the
  normalised output itself. Otherwise the active chunks are taken in sets of ``GROUP_CHUNKS``: each
  writes its partial, and the last block of a set to finish (``decode_combine.arrive``: a u32 counter
  per set, reset by that block) combines the set. With one set that is the output; with several, the
  set's combination goes to partial slot ``num_chunks + set`` and the last set to finish combines
  those. ``counters``: ``grid_x * (ceil(num_chunks / GROUP_CHUNKS) + 1)`` u32, zero before the first
  launch (they are left at zero). Partials: ``num_chunks + ceil(num_chunks / GROUP_CHUNKS)`` slots per
  head. An empty sequence writes zeros.
* ``flash_decoding_chunk`` + ``flash_decoding_reduce`` (two launches): every chunk writes a partial
  (a neutral one -- max = -inf, sum = 0, acc = 0 -- past the end) and the reduce kernel, one block per
  query head, combines all ``num_chunks``.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.decode_combine import arrive, combine_batch, combine_partials, partial_writer
from ptx_gen.kernels.attention.decode_core import (
    DEFAULT_L2_PREFETCH, NEG_INF, DecodeLayout, block_heads, build_decode_pass, check_head_dim, decode_layout,
    emit_chunk_rows, emit_combine, guard_base, lane_setup, layout_name, load_q, load_seq_len, safe_reciprocal,
    seq_len_param,
)

GROUP_CHUNKS = 16  # chunks combined by the last of them (flash_decoding)

_CHUNK_GRID = [
    {"head_dim": 64, "group": 7},
    {"head_dim": 128, "group": 4, "indirect": True},
    {"head_dim": 128, "group": 7, "indirect": True, "scores": "butterfly"},
    {"head_dim": 80, "group": 1},
    {"head_dim": 256, "group": 2, "indirect": True, "prefetch": True},
    {"head_dim": 48, "group": 6},
    {"head_dim": 96, "group": 4},
    {"head_dim": 32, "group": 8, "l2_prefetch": 0},
]


def _set_meta(k: KernelBuilder, lay: DecodeLayout) -> None:
    k.meta.update(block=lay.threads, subgroups=lay.subgroups, heads_per_block=lay.heads_per_block,
                  quantum=lay.rows_per_step, layout=lay)


def _chunk_span(k: KernelBuilder, indirect: bool, grow: bool = False):
    """(seq_len, num_chunks, chunk index, rows per chunk, start, end) of this block."""
    seq_len = load_seq_len(k, indirect)
    nch = k.sreg("nctaid.y")
    cidx = k.ctaid("y")
    rows = emit_chunk_rows(k, seq_len, nch, k.param("min_chunk"), k.param("grow_rows") if grow else None,
                           GROUP_CHUNKS)
    start = k.mul(cidx, rows)
    end = k.min(k.add(start, rows), seq_len)
    return seq_len, nch, cidx, rows, start, end


def _slot_loop(k: KernelBuilder, lay: DecodeLayout, body) -> None:
    """``body(i, c4)`` for every (head i of the block, float4 column c4), spread over the threads
    (``i`` is None when the block has one head)."""
    slots = lay.heads_per_block * lay.nc
    tid = k.tid()
    for it in range(-(-slots // lay.threads)):
        slot = k.add(tid, it * lay.threads) if it else tid
        with k.if_(k.setp("lt", slot, slots)):
            i = k.div(slot, lay.nc) if lay.heads_per_block > 1 else None
            c4 = k.rem(slot, lay.nc) if lay.heads_per_block > 1 else slot
            body(i, c4)


@kernel("flash_decoding_chunk", grid=_CHUNK_GRID)
def flash_decoding_chunk(
    m: Module, head_dim: int = 128, group: int = 1, indirect: bool = True,
    heads_per_block: int | None = None, warps: int = 4, unroll: int | None = None, prefetch: bool = False,
    scores: str | None = None, l2_prefetch: int = DEFAULT_L2_PREFETCH,
) -> KernelBuilder:
    """Partial attention of each query head over one chunk of the cache rows (split-KV decode).

    q: [num_heads, head_dim]; caches [num_kv_heads, max_len, head_dim]; part_acc:
    [num_heads, num_chunks, head_dim]; part_ml: [num_heads, num_chunks, 2]. seq_len from a value or
    (``indirect``) a device u32. Launch: grid (num_kv_heads * meta['subgroups'], num_chunks), block
    meta['block']; ``min_chunk`` >= 1 rows."""
    lay = decode_layout(head_dim, group, heads_per_block, warps, unroll, prefetch, scores, l2_prefetch)
    params = [("q", "u64"), ("k_cache", "u64"), ("v_cache", "u64"), ("part_acc", "u64"), ("part_ml", "u64"),
              seq_len_param(indirect), ("max_len", "u32"), ("min_chunk", "u32")]
    # no .maxntid: with it ptxas picked 56 registers and spilled for D=80
    k = m.kernel(f"flash_decoding_chunk_{layout_name(lay)}{'_ind' if indirect else ''}", params)
    _set_meta(k, lay)
    kvh, head0 = block_heads(k, lay)
    lanes = lane_setup(k, lay, "fdc")
    qv = load_q(k, lay, lanes, head0)  # before the seq_len-dependent branch: its latency overlaps
    seq_len, nch, cidx, rows, start, end = _chunk_span(k, indirect)
    part_acc, part_ml = k.global_ptr("part_acc"), k.global_ptr("part_ml")

    def partial_index(i):
        """(head * num_chunks + chunk) for head head0 + i."""
        head = k.add(head0, i) if i is not None else head0
        return k.mad(head, nch, cidx)

    def neutral(i, c4):
        pidx = partial_index(i)
        k.store("global", "f32", k.add(part_acc, k.mul_wide(k.mad(pidx, lay.nc, c4), 16)), [0.0] * 4)
        with k.if_(k.setp("eq", c4, 0)):
            k.store("global", "f32", k.add(part_ml, k.mul_wide(pidx, 8)), [NEG_INF, 0.0])

    # a chunk at or past the end: neutral partial, then leave (block-uniform branch, before any barrier)
    with k.if_(k.setp("ge", start, seq_len)):
        _slot_loop(k, lay, neutral)
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


_FUSED_GRID = [
    {"head_dim": 64, "group": 7},
    {"head_dim": 128, "group": 7, "indirect": True},
    {"head_dim": 128, "group": 4, "indirect": True, "unroll": 2, "prefetch": True},
    {"head_dim": 80, "group": 1, "scores": "butterfly"},
    {"head_dim": 256, "group": 2, "indirect": True},
    {"head_dim": 48, "group": 6, "l2_prefetch": 0},
    {"head_dim": 96, "group": 3},
    {"head_dim": 32, "group": 16},
]


@kernel("flash_decoding", grid=_FUSED_GRID)
def flash_decoding(
    m: Module, head_dim: int = 128, group: int = 1, indirect: bool = True,
    heads_per_block: int | None = None, warps: int = 4, unroll: int | None = None, prefetch: bool = False,
    scores: str | None = None, l2_prefetch: int = DEFAULT_L2_PREFETCH,
) -> KernelBuilder:
    """out[h] = softmax(q[h] . K[h // group, :L] / sqrt(D)) @ V[h // group, :L] in one launch (see the
    module doc): split-KV chunks, combined in-kernel by the last blocks to finish.

    q, out: [num_heads, head_dim]; caches [num_kv_heads, max_len, head_dim]; part_acc / part_ml:
    [num_heads, slots, head_dim] / [num_heads, slots, 2] with slots = num_chunks + ceil(num_chunks /
    meta['group_chunks']); counters: grid_x * (ceil(num_chunks / meta['group_chunks']) + 1) u32, zero.
    seq_len from a value or (``indirect``) a device u32, clamped to max_len. Launch: grid (num_kv_heads *
    meta['subgroups'], num_chunks), block meta['block']; ``min_chunk`` >= 1 rows; ``grow_rows``: chunks
    grow up to this many rows to keep a short sequence within one set (one combine level; 0: never, see
    ``chunk_rows``)."""
    lay = decode_layout(head_dim, group, heads_per_block, warps, unroll, prefetch, scores, l2_prefetch)
    params = [("q", "u64"), ("k_cache", "u64"), ("v_cache", "u64"), ("out", "u64"), ("part_acc", "u64"),
              ("part_ml", "u64"), ("counters", "u64"), seq_len_param(indirect), ("max_len", "u32"),
              ("min_chunk", "u32"), ("grow_rows", "u32")]
    k = m.kernel(f"flash_decoding_{layout_name(lay)}{'_ind' if indirect else ''}", params)
    _set_meta(k, lay)
    k.meta.update(group_chunks=GROUP_CHUNKS)
    S = GROUP_CHUNKS
    batch = combine_batch(lay)
    kvh, head0 = block_heads(k, lay)
    lanes = lane_setup(k, lay, "fd")
    qv = load_q(k, lay, lanes, head0)
    seq_len, nch, cidx, rows, start, end = _chunk_span(k, indirect, grow=True)
    nact = k.div(k.add(seq_len, k.sub(rows, 1, "u32")), rows, "u32")  # active chunks (0 when L = 0)
    out = k.global_ptr("out")
    part_acc, part_ml = k.global_ptr("part_acc"), k.global_ptr("part_ml")

    def out_addr(i, c4):
        head = k.add(head0, i) if i is not None else head0
        return k.add(out, k.mul_wide(k.mad(head, lay.nc, c4), 16))

    def write_out(i, c4, mx, total, acc4):
        inv = safe_reciprocal(k, total)
        k.store("global", "f32", out_addr(i, c4), [k.mul(a, inv) for a in acc4])

    # inactive chunks leave at once; with L = 0 chunk 0 writes the zeros (block-uniform branches)
    with k.if_(k.setp("ge", cidx, nact)):
        with k.if_(k.setp("eq", cidx, 0)):
            _slot_loop(k, lay, lambda i, c4: k.store("global", "f32", out_addr(i, c4), [0.0] * 4))
        k.ret()

    st = build_decode_pass(k, lay, lanes, qv, kvh, head0, start, end, "fd")
    with k.if_(k.setp("eq", nact, 1)):  # the whole sequence in one chunk: no partials
        emit_combine(k, st, write_out)
        k.ret()

    ngroups_max = k.div(k.add(nch, S - 1), S, "u32")
    slots_per_head = k.add(nch, ngroups_max)

    def write_partial(slot):
        return partial_writer(k, lay, head0, part_acc, part_ml, slots_per_head, slot)

    emit_combine(k, st, write_partial(cidx))
    # level 1: the last of each set of S active chunks combines the set
    gidx = k.div(cidx, S, "u32")
    first = k.mul(gidx, S)
    gsize = k.min(k.sub(nact, first, "u32"), S, "u32")
    ngroups = k.div(k.add(nact, S - 1), S, "u32")
    counters = k.global_ptr("counters")
    cnt_row = k.mul(k.ctaid("x"), k.add(ngroups_max, 1))
    flag = k.shared_array("fd_flag", "u32", 1, align=4)
    arrive(k, k.add(counters, k.mul_wide(k.add(cnt_row, gidx), 4)), gsize, flag)
    with k.if_(k.setp("eq", ngroups, 1)):
        combine_partials(k, lay, head0, slots_per_head, first, gsize, write_out, batch)
        k.ret()
    combine_partials(k, lay, head0, slots_per_head, first, gsize, write_partial(k.add(nch, gidx)), batch)
    # level 2: the last set to finish combines the sets' results
    arrive(k, k.add(counters, k.mul_wide(k.add(cnt_row, ngroups_max), 4)), ngroups, flag)
    combine_partials(k, lay, head0, slots_per_head, nch, ngroups, write_out, batch)
    k.ret()
    return k


def fused_buffer_sizes(num_heads: int, grid_x: int, num_chunks: int, head_dim: int) -> tuple[int, int, int]:
    """(part_acc floats, part_ml floats, counters u32) that ``flash_decoding`` needs."""
    ngroups = -(-num_chunks // GROUP_CHUNKS)
    slots = num_chunks + ngroups
    return num_heads * slots * head_dim, num_heads * slots * 2, grid_x * (ngroups + 1)


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
