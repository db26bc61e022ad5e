"""Paged split-KV decode attention of a batch: B query rows, each over its own length through its own
block table, in one launch on a grid that depends only on B (graph-capturable).

``q [B, H, D]`` f32 (rows ``q_stride`` floats apart); pools ``[num_blocks, KVH, block_size, D]`` of ``kv_dtype``
(:mod:`ptx_gen.kernels.kv.paged_kv`); ``seq_lens`` u32[B]; ``block_tables`` u32[B, table_stride]; ``out
[B, H, D]`` f32 or f16 (``out_f16``: rounded to nearest even, token-major: the O projection's A operand).
Query head ``h`` reads KV head ``h // group``; scores ``q . k / sqrt(D)`` (q pre-scaled by ``log2(e) /
sqrt(D)``, softmax with ``ex2``, log2 domain throughout as in :mod:`ptx_gen.kernels.attention.decode_core`).

Grid ``(B * KVH, num_chunks)``, block 128 (4 warps): block ``(b, kvh, c)`` serves the ``group`` query heads
of ``kvh`` over chunk ``c`` of sequence ``b``. Each sequence is split on the device from its own length
``L = min(seq_lens[b], table_stride * block_size)``: ``rows = roundup(max(ceil(L / num_chunks),
min_chunk), block_size)`` rows per chunk (whole blocks), ``nact = ceil(L / rows)`` active chunks; the other
blocks of the row return at once, so a short sequence next to a long one costs one chunk while the long
one spreads over all of them. Inside a chunk a row of K/V is read by a lane group of ``T`` lanes
(``lanes``; 0: the largest power of two <= 32 giving each lane a multiple of 4 values; fewer lanes a row
mean fewer shuffles and softmax updates per row, more registers; ``EPL = D / T`` values each, 8- or
16-byte loads), ``U`` rows per lane group per step; each row's block
id comes from the table. Scores are reduced over the lane group (butterfly), every lane keeps the online
softmax of every head of the group, lane groups and warps are merged in registers / shared memory
(:func:`ptx_gen.kernels.attention.decode_core.emit_combine`).

One active chunk writes the normalised output itself. Otherwise every active chunk writes its partial
``(max, sum, acc)`` (``part_ml [B * H, num_chunks, 2]``, ``part_acc [B * H, num_chunks, D]``) and the last of
them to finish (a u32 counter per (b, kvh), ``counters [B * KVH]``, zero before the first launch and left
at zero) combines all ``nact`` exactly (:mod:`ptx_gen.kernels.attention.decode_combine`). ``L = 0`` writes zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.decode_combine import arrive, combine_partials, partial_writer
from ptx_gen.kernels.attention.decode_core import (
    LOG2E, BlockState, butterfly_heads, emit_combine, merge_lane_groups, safe_reciprocal,
)
from ptx_gen.kernels.attention.paged_decode_ring import (Ring, check_ring, lane_roles, pass_state, publish, ring_bytes,
                                                          scatter_applies, scatter_lanes)
from ptx_gen.kernels.kv.paged_kv import (
    ELEM_BYTES, QK, check_paged, f16_bits_to_f32, kv_params, load_values, load_words, log2, narrow, q8_values,
)

WARPS = 4
THREADS = 32 * WARPS
HEAD_DIMS = (32, 48, 64, 80, 96, 112, 128, 256)
MAX_GROUP = 16


@dataclass(frozen=True)
class _Layout:
    """The fields of :class:`ptx_gen.kernels.attention.decode_plan.DecodeLayout` the shared combine code reads."""

    head_dim: int
    heads_per_block: int
    warps: int = WARPS

    @property
    def nc(self) -> int:
        return self.head_dim // 4

    @property
    def threads(self) -> int:
        return self.warps * 32


def lanes_per_row(head_dim: int) -> int:
    """T: the largest power of two <= 32 that splits a row into lane slices of a multiple of 4 values."""
    t = 32
    while head_dim % (4 * t):
        t //= 2
    return t


def check_shape(head_dim: int, group: int, block_size: int, kv_dtype: str, unroll: int, lanes: int = 0) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"paged decode attention takes head_dim in {HEAD_DIMS}, got {head_dim!r}")
    if not isinstance(group, int) or not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group must be an integer in 1..{MAX_GROUP}, got {group!r}")
    if unroll not in (1, 2, 4):
        raise ValueError(f"unroll must be 1, 2 or 4, got {unroll!r}")
    if lanes not in (0, 4, 8, 16, 32) or (lanes and head_dim % (4 * lanes)):
        raise ValueError(f"lanes must be 0 (auto) or 4, 8, 16, 32 lanes of a multiple of 4 values each, got "
                         f"{lanes!r} for head_dim {head_dim}")
    check_paged(block_size, kv_dtype, head_dim)


def _pass(k: KernelBuilder, lay: _Layout, q_regs: list, kvh, n_kv, table, start, end, block_size: int,
          kv_dtype: str, unroll: int, T: int, prefetch: bool = False) -> BlockState:
    """Rows [start, end) of the sequence for the block's heads; per-warp results to shared memory. ``prefetch``: each
    step's block ids are loaded during the step before (its K/V loads then wait on one load, not two in a row)."""
    D, G = lay.head_dim, lay.heads_per_block
    EPL, R, U = D // T, 32 // T, unroll
    lane, warp, g, j = lane_roles(k, k.tid(), T)
    lane_off = k.mul_wide(j, EPL * ELEM_BYTES[kv_dtype])
    k_pool, v_pool = k.global_ptr("k_pool"), k.global_ptr("v_pool")
    q8 = kv_dtype == "q8_0"
    if q8:  # the lane's values [j EPL, (j + 1) EPL) use scale g_lo, or g_lo + 1 past a group's end
        k_sc, v_sc = k.global_ptr("k_scales"), k.global_ptr("v_scales")
        first = k.mul(j, EPL)
        g_lo = k.shr(first, log2(QK))
        s_off = k.mul_wide(g_lo, 2)
        straddle = QK % EPL != 0
        upper = s_off2 = None
        if straddle:  # the group of the lane's last value (the same as g_lo where the slice does not cross)
            s_off2 = k.mul_wide(k.shr(k.add(first, EPL - 1), log2(QK)), 2)
            # a group boundary falls on a multiple of 4 values: a whole code word takes one scale
            upper = [k.setp("ge", k.add(first, 4 * w), k.shl(k.add(g_lo, 1), log2(QK))) for w in range(EPL // 4)]

    def load_row(pool, scales, a, r_in, ok):
        if not q8:
            return load_values(k, k.add(pool, a), EPL, kv_dtype, ok)
        words = load_words(k, k.add(pool, a), EPL, ok)
        srow = k.add(scales, k.mul_wide(r_in, D // QK * 2))
        sc = f16_bits_to_f32(k, k.load("global", "b16", k.add(srow, s_off), pred=ok, other=0))
        if not straddle:
            return q8_values(k, words, sc)
        sc2 = f16_bits_to_f32(k, k.load("global", "b16", k.add(srow, s_off2), pred=ok, other=0))
        per_word = [k.selp(sc2, sc, u) for u in upper]
        return q8_values(k, words, [per_word[e // 4] for e in range(EPL)])

    acc, m, l, warp_row0 = pass_state(k, G, EPL, warp, g, R * U)
    last = k.sub(end, 1, "u32")
    step = WARPS * R * U

    def step_rows(sb) -> list:
        base = k.add(sb, warp_row0)
        return [k.add(base, u * R) if u else base for u in range(U)]

    def page(rc):  # (rows past the end re-read the last row's block id: loads are guarded)
        return k.load("global", "u32", k.add(table, k.mul_wide(k.shr(rc, log2(block_size)), 4)))

    ahead = None
    if prefetch:  # the first step's block ids before the loop, each next step's during the step
        ahead = [k.var("u32", 0) for _ in range(U)]
        for var, r in zip(ahead, step_rows(start)):
            k.assign(var, page(k.min(r, last, "u32")))
    with k.loop(start, end, step) as sb:
        rows = step_rows(sb)
        valid = [k.setp("lt", r, end) for r in rows]
        addrs, r_ins = [], []
        for u, r in enumerate(rows):
            rc = k.min(r, last, "u32")
            r_in = k.mad(k.mad(ahead[u] if prefetch else page(rc), n_kv, kvh), block_size, k.and_(rc, block_size - 1))
            addrs.append(k.add(k.mul_wide(r_in, D * ELEM_BYTES[kv_dtype]), lane_off))
            r_ins.append(r_in)
        krows = [load_row(k_pool, k_sc if q8 else None, a, ri, v) for a, ri, v in zip(addrs, r_ins, valid)]
        vrows = [load_row(v_pool, v_sc if q8 else None, a, ri, v) for a, ri, v in zip(addrs, r_ins, valid)]
        nxt = [page(k.min(r, last, "u32")) for r in step_rows(k.add(sb, step))] if prefetch else []
        butterfly_heads(k, T, q_regs, krows, vrows, valid, m, l, acc)
        for var, pg in zip(ahead or [], nxt):
            k.assign(var, pg)
    merge_lane_groups(k, T, m, l, acc)  # the lane groups of a warp
    sm_acc = k.shared_array("pd_acc", "f32", WARPS * G * D)
    sm_ml = k.shared_array("pd_ml", "f32", WARPS * G * 2)
    return publish(k, lay, T, (lane, warp, j), m, l, acc, sm_acc, sm_ml)


_GRID = [
    {"head_dim": 128, "group": 4, "block_size": 32, "kv_dtype": "f16", "out_f16": False, "unroll": 2},
    {"head_dim": 128, "group": 8, "block_size": 32, "kv_dtype": "f16", "out_f16": True, "unroll": 2},
    {"head_dim": 128, "group": 1, "block_size": 16, "kv_dtype": "f32", "out_f16": False, "unroll": 4},
    {"head_dim": 64, "group": 3, "block_size": 64, "kv_dtype": "bf16", "out_f16": True, "unroll": 2},
    {"head_dim": 64, "group": 8, "block_size": 32, "kv_dtype": "f32", "out_f16": False, "unroll": 1},
    {"head_dim": 256, "group": 2, "block_size": 32, "kv_dtype": "f16", "out_f16": False, "unroll": 2},
    {"head_dim": 32, "group": 6, "block_size": 16, "kv_dtype": "f16", "out_f16": False, "unroll": 2},
    {"head_dim": 96, "group": 4, "block_size": 32, "kv_dtype": "f16", "out_f16": False, "unroll": 2},
    {"head_dim": 128, "group": 4, "block_size": 32, "kv_dtype": "q8_0", "out_f16": True, "unroll": 2},
    {"head_dim": 96, "group": 2, "block_size": 16, "kv_dtype": "q8_0", "out_f16": False, "unroll": 2},
    {"head_dim": 128, "group": 4, "block_size": 32, "kv_dtype": "f16", "out_f16": True, "unroll": 2, "lanes": 16},
    {"head_dim": 128, "group": 8, "block_size": 32, "kv_dtype": "q8_0", "out_f16": True, "unroll": 2, "lanes": 16},
    {"head_dim": 64, "group": 3, "block_size": 32, "kv_dtype": "f16", "out_f16": False, "unroll": 4, "lanes": 8},
    {"head_dim": 128, "group": 4, "block_size": 32, "kv_dtype": "f16", "out_f16": True, "unroll": 4, "lanes": 16,
     "prefetch": True},
    {"head_dim": 96, "group": 2, "block_size": 16, "kv_dtype": "q8_0", "out_f16": False, "unroll": 2, "prefetch": True},
]


@kernel("paged_decode_attention", grid=_GRID)
def paged_decode_attention(m: Module, head_dim: int = 128, group: int = 1, block_size: int = 32,
                           kv_dtype: str = "f16", out_f16: bool = False, unroll: int = 2,
                           lanes: int = 0, prefetch: bool = False, ring: int = 0,
                           scatter: bool = False) -> KernelBuilder:
    """Split-KV decode attention of B rows through their block tables (see the module doc). Params: q,
    k_pool, v_pool, out, part_acc, part_ml, counters, seq_lens, block_tables, table_stride, n_kv,
    min_chunk, q_stride (floats from one row of q to the next: H * D packed, or (H + 2 KVH) * D to read Q
    straight from the rows of a qkv buffer). Launch: grid (B * n_kv, num_chunks), block 128. ``seq_lens``
    is read before the wait of programmatic dependent launch: it must not be written by the kernels just
    before this one (the batched decode step copies it from the host before the step). ``ring`` (sm_90; f32, f16,
    bf16 K/V): the rows come through a ring of that many stages in shared memory filled by bulk copies
    (:mod:`ptx_gen.kernels.attention.paged_decode_ring`; dynamic shared memory meta["dyn_smem"]) instead of
    loads into registers; with ``scatter`` (where :func:`scatter_applies`) its scores are reduce-scattered over the
    lane group and each lane runs one head's softmax."""
    check_shape(head_dim, group, block_size, kv_dtype, unroll, lanes)
    D, G = head_dim, group
    T = lanes or lanes_per_row(D)
    if ring:
        check_ring(ring, kv_dtype, m.target)
        if prefetch:
            raise ValueError("prefetch (block ids a step ahead) is the register pass's; the ring reads them itself")
    if scatter and not (ring and scatter_applies(D, G, T, unroll)):
        raise ValueError(f"scatter scores take the ring, a power-of-two group whose heads x unroll fit the lanes of a "
                         f"row and lanes of whole 4-value pieces; got ring {ring}, group {G}, unroll {unroll}, {T} "
                         f"lanes of head_dim {D}")
    lay = _Layout(D, G)
    EPL = D // T
    name = (f"paged_decode_attention_d{D}_g{G}_b{block_size}_{kv_dtype}_u{unroll}"
            + (f"_t{lanes}" if lanes else "") + ("_pp" if prefetch else "") + (f"_r{ring}" if ring else "")
            + ("_sc" if scatter else "") + ("_outf16" if out_f16 else ""))
    params = [("q", "u64"), *kv_params(kv_dtype), ("out", "u64"), ("part_acc", "u64"),
              ("part_ml", "u64"), ("counters", "u64"), ("seq_lens", "u64"), ("block_tables", "u64"),
              ("table_stride", "u32"), ("n_kv", "u32"), ("min_chunk", "u32"), ("q_stride", "u32")]
    # (prefetching where a lane holds at most 32 accumulators, group x values a lane, as the 8B shape: held to the 4
    # blocks an SM the kernel has there without it; larger groups take more registers either way)
    k = m.kernel(name, params, max_threads=THREADS,
                 min_blocks=4 if (prefetch or ring and unroll <= 2) and G * (D // T) <= 32 else None)
    k.meta.update(block=THREADS, lanes_per_row=T, rows_per_step=WARPS * (32 // T) * unroll)
    if ring:
        k.meta["dyn_smem"] = ring_bytes(ring, D, G, block_size, kv_dtype, k.meta["rows_per_step"], WARPS)
    n_kv, stride = k.param("n_kv"), k.param("table_stride")
    bx = k.ctaid("x")
    b = k.div(bx, n_kv)
    kvh = k.sub(bx, k.mul(b, n_kv))
    n_heads = k.mul(n_kv, G)
    head0 = k.add(k.mul(b, n_heads), k.mul(kvh, G))  # global (row, head) index of the block's first head
    tid = k.tid()
    lane = k.and_(tid, 31)
    j = k.and_(lane, T - 1) if T < 32 else lane
    # this sequence's chunk
    cap = k.mul(stride, block_size)
    seq_len = k.min(k.load("global", "u32", k.add(k.global_ptr("seq_lens"), k.mul_wide(b, 4))), cap, "u32")
    nch, cidx = k.sreg("nctaid.y"), k.ctaid("y")
    per = k.div(k.add(seq_len, k.sub(nch, 1, "u32")), nch, "u32")
    rows = k.max(k.max(per, k.param("min_chunk"), "u32"), 1, "u32")
    rows = k.shl(k.shr(k.add(rows, block_size - 1), log2(block_size)), log2(block_size))  # whole blocks
    nact = k.div(k.add(seq_len, k.sub(rows, 1, "u32")), rows, "u32")
    start = k.mul(cidx, rows)
    end = k.min(k.add(start, rows), seq_len, "u32")
    rp = Ring(k, lay, kvh, n_kv, start, end, block_size, kv_dtype, unroll, T, ring) if ring else None
    out = k.global_ptr("out")
    ob = 2 if out_f16 else 4

    def out_addr(i, c4):
        head = k.add(head0, i) if i is not None else head0
        return k.add(out, k.mul_wide(k.mad(head, lay.nc, c4), 4 * ob))

    def store_out(i, c4, vals):
        if out_f16:
            h = [narrow(k, v, "f16") for v in vals]
            k.store("global", "b32", out_addr(i, c4), [k.pack_b32(h[0], h[1]), k.pack_b32(h[2], h[3])])
        else:
            k.store("global", "f32", out_addr(i, c4), vals)

    def write_out(i, c4, mx, total, acc4):
        inv = safe_reciprocal(k, total)
        store_out(i, c4, [k.mul(a, inv) for a in acc4])

    def slots(body):
        n = G * lay.nc
        for it in range(-(-n // THREADS)):
            slot = k.add(tid, it * THREADS) if it else tid
            with k.if_(k.setp("lt", slot, n)):
                i = k.div(slot, lay.nc) if G > 1 else None
                c4 = k.rem(slot, lay.nc) if G > 1 else slot
                body(i, c4)

    with k.if_(k.setp("ge", cidx, nact)):  # inactive chunk (block-uniform); L = 0: chunk 0 writes zeros
        with k.if_(k.setp("eq", cidx, 0)):
            k.grid_dependency_wait()
            zero = k.mov(0.0, "f32")
            slots(lambda i, c4: store_out(i, c4, [zero] * 4))
        k.ret()
    # Everything above read only the lengths, written by the host before the step (the wait of programmatic
    # dependent launch comes here, so inactive chunks leave and the chunk arithmetic is done while the kernel
    # before, which writes q and this position's K/V, finishes)
    k.grid_dependency_wait()
    def table_row() -> Reg:  # (the block's row of the block tables)
        return k.add(k.global_ptr("block_tables"), k.mul_wide(k.mul(b, stride), 4))

    if rp is not None:  # (the first stages' copies before q's loads)
        rp.begin(table_row())
    # q of the block's heads: this lane's EPL values, pre-scaled into the log2 domain (scatter: slot i holds head i ^ hi)
    sc = scatter_lanes(k, D, G, T, unroll, WARPS) if scatter else None
    qscale = LOG2E / math.sqrt(D)
    q_regs = []
    q_row = k.add(k.global_ptr("q"), k.mul_wide(k.mad(b, k.param("q_stride"), k.mul(kvh, G * D)), 4))
    for i in range(G):
        if sc is not None:
            qaddr = k.add(q_row, k.mul_wide(k.mad(k.xor(sc.hi, i) if i else sc.hi, D, k.mul(j, EPL)), 4))
        else:
            qaddr = k.add(q_row, k.mul_wide(k.add(k.mul(j, EPL), i * D) if i else k.mul(j, EPL), 4))
        q_regs.append([k.mul(x, qscale) for x in load_values(k, qaddr, EPL, "f32")])

    if rp is not None:
        st = rp.run(q_regs, sc)
    else:
        st = _pass(k, lay, q_regs, kvh, n_kv, table_row(), start, end, block_size, kv_dtype, unroll, T, prefetch)
    with k.if_(k.setp("eq", nact, 1)):
        emit_combine(k, st, write_out)
        k.ret()
    part_acc, part_ml = k.global_ptr("part_acc"), k.global_ptr("part_ml")

    emit_combine(k, st, partial_writer(k, lay, head0, part_acc, part_ml, nch, cidx))
    flag = k.shared_array("pd_flag", "u32", 1, align=4)
    arrive(k, k.add(k.global_ptr("counters"), k.mul_wide(bx, 4)), nact, flag)
    combine_partials(k, lay, head0, nch, 0, nact, write_out, 8)
    k.ret()
    return k


def buffer_sizes(rows: int, num_heads: int, num_kv_heads: int, num_chunks: int, head_dim: int) -> tuple[int, int, int]:
    """(part_acc floats, part_ml floats, counters u32) of a launch of ``rows`` rows on ``num_chunks`` chunks."""
    return rows * num_heads * num_chunks * head_dim, rows * num_heads * num_chunks * 2, rows * num_kv_heads
