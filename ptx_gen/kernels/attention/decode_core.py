"""The shared core of the decode attention kernels (one query per head against a KV cache).

``incremental_attention`` (one pass over the whole sequence, normalised output), ``flash_decoding``
(single launch: chunks plus an in-kernel combine) and ``flash_decoding_chunk`` (one chunk, an
unnormalised partial for the reduce kernel) are all built from :func:`build_decode_pass`.
Conventions shared by every attention kernel:

* f32 throughout; the cache of one layer is ``[num_kv_heads, max_len, head_dim]``;
* GQA: query head ``h`` reads KV head ``h // group`` (``group = num_heads // num_kv_heads``);
* scores are ``(q . k) / sqrt(head_dim)``; q is pre-multiplied by ``log2(e) / sqrt(head_dim)`` so
  the softmax uses ``ex2`` directly, and every running max / partial max is in that log2 domain;
* online softmax with the old and new max in different registers; an exponent base that is
  ``-inf`` is replaced by 0 (all terms are then ``ex2(-inf) = 0``), so ``-inf - -inf`` never occurs.

Work layout (see :class:`DecodeLayout`): one block serves one KV head and ``heads_per_block`` of its
query heads, so each K/V byte is read once per block, not once per query head. A row of the cache
(``head_dim`` floats = ``head_dim / 4`` float4 chunks) is read by a *lane group* of ``T`` lanes,
each lane holding ``C`` float4 chunks (chunk ``c * T + j`` for lane ``j`` of the group); a warp
therefore holds ``32 / T`` rows at once and, unrolled ``U`` times, ``(32 / T) * U`` rows per step, all
loaded (K and V, 16 bytes per load) before any of them is used.

Scores (the ``HB x U`` dot products of a step, each spread over the ``T`` lanes of a group) are summed
over the group in one of two ways:

* ``butterfly``: every dot is reduced on its own (``log2 T`` shuffles each) and every lane then runs
  the softmax of every head -- simple, but shuffle- and ``ex2``-bound for large GQA groups;
* ``scatter`` (default): a *reduce-scatter*. The ``V = HBpad * U`` dots (heads padded to a power of
  two, index ``idx = head * U + row``) are halved at every shuffle level: a lane keeps one half and
  receives the partner's copy of it. Lane ``j`` stores index ``s XOR M(j)`` in list slot ``s`` (its q
  registers and K rows are permuted accordingly, once), which makes "keep the first half, send the
  second" right for every lane -- no selects. After ``log2 min(V, T)`` levels a lane holds the full
  scores of ``E = max(1, V / T)`` consecutive indices ``M(j) .. M(j) + E - 1`` (one head), runs the
  online softmax for that head only (2 ``ex2`` instead of ``HB * (U + 1)``) and publishes its
  probabilities and rescale factor through a small per-warp shared buffer, from which every lane
  reads what the ``P @ V`` update of its dims needs. About half the instructions per cache byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.attention.decode_plan import (
    DEFAULT_L2_PREFETCH,
    LOG2E,
    MAX_HEAD_DIM,
    NEG_INF,
    SCORE_MODES,
    DecodeLayout,
    active_chunks,
    check_head_dim,
    choose_lanes,
    chunk_rows,
    decode_layout,
    default_decode_warps,
    layout_name,
    loop_registers,
    round4,
)

# The geometry lives in decode_plan; the kernels, the runtime and the tests take it from here.
__all__ = ["DEFAULT_L2_PREFETCH", "LOG2E", "MAX_HEAD_DIM", "NEG_INF", "SCORE_MODES", "DecodeLayout", "choose_lanes",
           "active_chunks", "check_head_dim", "chunk_rows", "decode_layout", "default_decode_warps", "layout_name",
           "loop_registers", "build_decode_pass", "emit_combine"]


def emit_chunk_rows(k: KernelBuilder, seq_len: Reg, num_chunks: Reg, min_chunk: Reg, grow_rows: Reg | None = None,
                    set_chunks: int = 1) -> Reg:
    """The device-side twin of :func:`chunk_rows` (u32 arithmetic; seq_len <= max_len < 2**31)."""
    per = k.div(k.add(seq_len, k.sub(num_chunks, 1, "u32")), num_chunks, "u32")
    rows = k.max(k.max(per, min_chunk, "u32"), 1, "u32")
    if grow_rows is None:
        return rows
    grown = k.div(k.add(seq_len, set_chunks - 1), set_chunks, "u32")
    return k.max(rows, k.selp(grown, 0, k.setp("le", grown, grow_rows, "u32"), "u32"), "u32")


def guard_base(k: KernelBuilder, m: Reg) -> Reg:
    """The exponent base for a running max ``m``: ``m``, or 0 when ``m`` is -inf (no finite term yet),
    so that ``ex2(x - base)`` is ``ex2(-inf) = 0`` for every -inf ``x`` instead of NaN."""
    return k.selp(0.0, m, k.setp("eq", m, NEG_INF))


def online_softmax(k: KernelBuilder, m_old: Reg, l: Reg, mx: Reg, scores: list) -> tuple[Reg, list]:
    """One online-softmax update to the new running max ``mx`` (the max of ``m_old`` and ``scores``):
    the factor ``alpha`` that rescales the terms kept so far, the probabilities of ``scores``, and
    ``l = l * alpha + sum(probs)`` assigned in place (base guarded by :func:`guard_base`)."""
    b = guard_base(k, mx)
    alpha = k.ex2(k.sub(m_old, b))
    probs = [k.ex2(k.sub(s, b)) for s in scores]
    psum = probs[0]
    for p in probs[1:]:
        psum = k.add(psum, p)
    k.assign(l, k.fma(l, alpha, psum))
    return alpha, probs


def merge_lane_groups(k: KernelBuilder, T: int, m: list, l: list, acc: list) -> None:
    """Combine the (max, sum, acc) of the ``32 / T`` lane groups of a warp by butterflies over lanes
    ``T, 2T, ..``: afterwards every lane holds its warp's result. ``m``, ``l``: per head (entries
    replaced); ``acc[head]``: the lane's values of that head, flat (assigned in place)."""
    off = T
    while off < 32:
        for i in range(len(m)):
            mo = k.shfl("bfly", m[i], off)
            lo = k.shfl("bfly", l[i], off)
            ao = [k.shfl("bfly", a, off) for a in acc[i]]
            mx = k.max(m[i], mo)
            b = guard_base(k, mx)
            fa, fb = k.ex2(k.sub(m[i], b)), k.ex2(k.sub(mo, b))
            nl = k.fma(lo, fb, k.mul(l[i], fa))
            for a, o in zip(acc[i], ao):
                k.assign(a, k.fma(o, fb, k.mul(a, fa)))
            m[i], l[i] = mx, nl
        off *= 2


def butterfly_heads(k: KernelBuilder, T: int, q: list, krows: list, vrows: list, valid: list, m: list, l: list,
                    acc: list) -> None:
    """One step of rows for every head: each dot ``q[head] . krows[u]`` summed over the lane group of
    ``T`` lanes (butterfly), masked to -inf where ``valid[u]`` is false, then the head's online softmax
    and ``acc[head] = acc[head] * alpha + sum_u p_u vrows[u]``. Per-lane value lists are flat."""
    for i in range(len(m)):
        scores = []
        for u in range(len(krows)):
            dot = _dot(k, q[i], krows[u])
            off = T // 2
            while off >= 1:
                dot = k.add(dot, k.shfl("bfly", dot, off))
                off //= 2
            scores.append(k.selp(dot, NEG_INF, valid[u]))
        mx = m[i]
        for s in scores:
            mx = k.max(mx, s)
        alpha, probs = online_softmax(k, m[i], l[i], mx, scores)
        _pv_update(k, acc[i], alpha, probs, vrows)
        k.assign(m[i], mx)


def _flat(chunks: list) -> list:
    """A lane's ``[chunk][4]`` values as one list (the same registers, chunk by chunk)."""
    return [x for c in chunks for x in c]


def safe_reciprocal(k: KernelBuilder, total: Reg) -> Reg:
    """1 / total, or 0 when total is 0 (an empty sequence writes zeros, not NaN)."""
    return k.selp(0.0, k.rcp(total), k.setp("eq", total, 0.0))


def load_seq_len(k: KernelBuilder, indirect: bool) -> Reg:
    """seq_len from the ``seq_len`` parameter or from the u32 at ``seq_len_ptr``, clamped to max_len."""
    if indirect:
        raw = k.load("global", "u32", k.global_ptr("seq_len_ptr"))
    else:
        raw = k.param("seq_len")
    return k.min(raw, k.param("max_len"), "u32")


def seq_len_param(indirect: bool) -> tuple[str, str]:
    return ("seq_len_ptr", "u64") if indirect else ("seq_len", "u32")


@dataclass
class BlockState:
    """Per-block results after :func:`build_decode_pass`: for head ``i`` of the block and output
    float4 slot, the combined max, sum and unnormalised accumulator are produced by ``combine``."""

    lay: DecodeLayout
    head0: Reg  # first query head of this block
    sm_acc: Reg
    sm_ml: Reg


def block_heads(k: KernelBuilder, lay: DecodeLayout) -> tuple[Reg, Reg]:
    """(kv_head, first query head) of this block from ctaid.x = kv_head * subgroups + sub."""
    bx = k.ctaid("x")
    if lay.subgroups == 1:
        kvh = bx
        head0 = k.mul(kvh, lay.group)
    else:
        kvh = k.div(bx, lay.subgroups)
        sub = k.rem(bx, lay.subgroups)
        head0 = k.mad(kvh, lay.group, k.mul(sub, lay.heads_per_block))
    return kvh, head0


@dataclass
class Scatter:
    """A lane's place in the reduce-scatter (see the module doc): it ends up holding the scores of
    indices ``M .. M + E - 1``, all of head ``hi`` (relative to the block's first head) and rows
    ``mu .. mu + E - 1`` of the step. q slot ``s`` holds head ``s ^ hi`` and K slot ``u`` row ``u ^ mu``."""

    M: Reg
    hi: Reg
    mu: Reg | None  # None when U = 1
    kperm: list  # per K slot u: (u ^ mu) * R, the row offset within the step (0 when U = 1)
    entry_rows: list  # per entry e: (mu + e) * R (0 when U = 1)
    u_masks: list  # xor lane masks joining the lanes that share a head
    writer: Reg | None  # one lane of each set of identical lanes (None: every lane)
    head_writer: Reg | None  # ... that also holds the head's first row (None: every lane)
    xbase: Reg  # shared address of this lane group's exchange buffer (parity 0)


@dataclass
class Lanes:
    """Per-thread lane-group coordinates: lane group ``g`` (None when T = 32), lane ``j`` in it, and
    this lane's float4 chunk indices with their validity (None: always valid)."""

    tid: Reg
    lane: Reg
    warp: Reg
    g: Reg | None
    j: Reg
    chunk_idx: list
    chunk_ok: list
    scatter: Scatter | None = None


def lane_setup(k: KernelBuilder, lay: DecodeLayout, tag: str = "dec") -> Lanes:
    T, C, NC = lay.lanes_per_row, lay.chunks_per_lane, lay.nc
    tid = k.tid()
    lane = k.and_(tid, 31)
    warp = k.shr(tid, 5)
    if T == 32:
        g, j = None, lane
    else:
        g, j = k.shr(lane, int(math.log2(T))), k.and_(lane, T - 1)
    chunk_ok: list[Reg | None] = []
    chunk_idx: list[Reg] = []
    for c in range(C):
        ch = k.add(j, c * T) if c else j
        chunk_idx.append(ch)
        chunk_ok.append(k.setp("lt", ch, NC) if (c + 1) * T > NC else None)
    lanes = Lanes(tid, lane, warp, g, j, chunk_idx, chunk_ok)
    if lay.scatter:
        lanes.scatter = _scatter_setup(k, lay, lanes, tag)
    return lanes


def _scatter_setup(k: KernelBuilder, lay: DecodeLayout, lanes: Lanes, tag: str) -> Scatter:
    T, U, E, V = lay.lanes_per_row, lay.unroll, lay.scatter_entries, lay.scatter_values
    R = 32 // T
    lt, lv, le, lu = (int(math.log2(x)) for x in (T, V, E, U))
    levels = min(lt, lv)
    drop = lt - levels  # low lane bits reduced by plain butterflies (identical lanes)
    M = k.shl(k.shr(lanes.j, drop), le) if drop else (k.shl(lanes.j, le) if le else lanes.j)
    hi = k.shr(M, lu) if lu else M
    mu = k.and_(M, U - 1) if U > 1 else None
    kperm = [k.mul(k.xor(mu, u) if u else mu, R) for u in range(U)] if mu is not None else [0]
    entry_rows = [k.mul(k.add(mu, e) if e else mu, R) for e in range(E)] if mu is not None else [0]
    # index bit b (le <= b < lu) of a lane's entries sits in lane bit b - le + drop
    u_masks = [1 << (b - le + drop) for b in range(le, lu)]
    writer = k.setp("eq", k.and_(lanes.j, (1 << drop) - 1), 0) if drop else None
    first_row = k.setp("eq", mu, 0) if mu is not None and E < U else None
    head_writer = k.both(writer, first_row)
    xs = lay.exchange_floats
    buf = k.shared_array(f"{tag}_x", "f32", lay.warps * R * 2 * xs)
    slot = k.mul(lanes.warp, R)
    if lanes.g is not None:
        slot = k.add(slot, lanes.g)
    xbase = k.add(buf, k.mul(slot, 2 * xs * 4))
    return Scatter(M, hi, mu, kperm, entry_rows, u_masks, writer, head_writer, xbase)


def load_q(k: KernelBuilder, lay: DecodeLayout, lanes: Lanes, head0: Reg) -> list:
    """This lane's chunks of q for the block's heads, pre-scaled into the log2 domain
    (``qv[slot][chunk]`` = 4 registers; with scatter scores slot ``s`` holds head ``s ^ hi`` and
    padding heads are 0). Independent of seq_len: emit it early so the loads overlap."""
    D, C = lay.head_dim, lay.chunks_per_lane
    row_bytes = D * 4
    qscale = LOG2E / math.sqrt(D)
    q_ptr = k.global_ptr("q")
    sc = lanes.scatter
    qv: list[list[tuple[Reg, ...]]] = []
    for s in range(lay.heads_pad if sc is not None else lay.heads_per_block):
        if sc is not None:
            rel = k.xor(sc.hi, s) if s else sc.hi
            head_ok = k.setp("lt", rel, lay.heads_per_block) if lay.heads_pad != lay.heads_per_block else None
            qrow = k.add(q_ptr, k.mul_wide(k.add(head0, rel), row_bytes))
        else:
            head_ok = None
            qrow = k.add(q_ptr, k.mul_wide(k.add(head0, s), row_bytes)) if s else \
                k.add(q_ptr, k.mul_wide(head0, row_bytes))
        per_c = []
        for c in range(C):
            addr = k.add(qrow, k.mul_wide(lanes.chunk_idx[c], 16))
            ok = k.both(lanes.chunk_ok[c], head_ok)
            vals = k.load("global", "f32", addr, vec=4, pred=ok, other=0.0) if ok is not None \
                else k.load("global", "f32", addr, vec=4)
            per_c.append(tuple(k.mul(x, qscale) for x in vals))
        qv.append(per_c)
    return qv


def _plus(k: KernelBuilder, a: Reg, b: Reg | int) -> Reg:
    return a if isinstance(b, int) and b == 0 else k.add(a, b)


def build_decode_pass(
    k: KernelBuilder, lay: DecodeLayout, lanes: Lanes, qv: list, kvh: Reg, head0: Reg, start: Reg, end: Reg, tag: str
) -> BlockState:
    """Emit the pass over cache rows ``[start, end)`` for the block's heads and the in-block combine.

    On return every warp's (max, sum, accumulator) per head is in shared memory (``sm_ml`` holds
    ``[warp][head][max, sum]``, ``sm_acc`` holds ``[warp][head][head_dim]``) and a barrier has been
    passed; :func:`emit_combine` turns them into per-head results."""
    D, T, C, U = lay.head_dim, lay.lanes_per_row, lay.chunks_per_lane, lay.unroll
    W, HB = lay.warps, lay.heads_per_block
    R = 32 // T
    row_bytes = D * 4
    lane, warp, g = lanes.lane, lanes.warp, lanes.g
    chunk_idx, chunk_ok = lanes.chunk_idx, lanes.chunk_ok
    sc = lanes.scatter

    # per-lane base addresses of the KV head's rows
    kv_row0 = k.mul_wide(kvh, k.param("max_len"))  # u64 row index of (kvh, 0)
    kv_off0 = k.mul(kv_row0, row_bytes, "u64")
    k_lane, v_lane = [], []
    for c in range(C):
        off = k.add(kv_off0, k.mul_wide(chunk_idx[c], 16))
        k_lane.append(k.add(k.global_ptr("k_cache"), off))
        v_lane.append(k.add(k.global_ptr("v_cache"), off))

    acc = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(C)] for _ in range(HB)]
    if sc is None:
        m = [k.var("f32", NEG_INF) for _ in range(HB)]
        l = [k.var("f32", 0.0) for _ in range(HB)]
    else:  # this lane's head only
        m_lane, l_lane = k.var("f32", NEG_INF), k.var("f32", 0.0)
        parity = k.var("u32", 0)

    warp_row0 = k.mul(warp, R * U)
    if g is not None:
        warp_row0 = k.add(warp_row0, g)
    last = k.sub(end, 1, "u32")  # clamps row indices; only used where end > start >= 0 (or under a guard)

    def load_rows(kv_lane, row_offs, guard):
        rows = []
        for roff in row_offs:
            per_c = []
            for c in range(C):
                addr = k.add(kv_lane[c], roff)
                ok = k.both(chunk_ok[c], guard)
                per_c.append(k.load("global", "f32", addr, vec=4, pred=ok, other=0.0) if ok is not None
                             else k.load("global", "f32", addr, vec=4))
            rows.append(per_c)
        return rows

    def step_loads(sb_reg, guard=None):
        """K and V of this lane's U rows of the step starting at ``sb_reg``; rows past the end re-read
        the last row (their scores are masked to -inf), so every address stays inside the sequence.
        With scatter scores K slot u holds row ``u ^ mu`` (V stays in row order)."""
        base = k.add(sb_reg, warp_row0)

        def offs(row_offsets):
            return [k.mul_wide(k.min(_plus(k, base, r), last, "u32"), row_bytes) for r in row_offsets]

        v_offs = offs([u * R for u in range(U)])
        k_offs = offs(sc.kperm) if sc is not None else v_offs
        return load_rows(k_lane, k_offs, guard), load_rows(v_lane, v_offs, guard)

    l2 = _l2_prefetcher(k, lay, lanes, kv_off0, start, end)
    if lay.prefetch:  # software pipelining: the next step's loads are in flight while this one computes
        k0, v0 = step_loads(start, guard=k.setp("lt", start, end))
        kcur = [[[k.var("f32", x) for x in vals] for vals in row] for row in k0]
        vcur = [[[k.var("f32", x) for x in vals] for vals in row] for row in v0]
    with k.loop(start, end, lay.rows_per_step) as sb:
        if lay.prefetch:
            knext, vnext = step_loads(k.add(sb, lay.rows_per_step))
            krows, vrows = kcur, vcur
        else:
            krows, vrows = step_loads(sb)
        if l2 is not None:
            l2(k.add(sb, lay.l2_prefetch * lay.rows_per_step))
        base = k.add(sb, warp_row0)
        if sc is None:
            _butterfly_step(k, lay, qv, krows, vrows, base, end, m, l, acc)
        else:
            _scatter_step(k, lay, sc, qv, krows, vrows, base, end, m_lane, l_lane, parity, acc)
        if lay.prefetch:
            for cur, nxt in ((kcur, knext), (vcur, vnext)):
                for u in range(U):
                    for c in range(C):
                        for e in range(4):
                            k.assign(cur[u][c][e], nxt[u][c][e])
    if sc is not None:
        m, l = _scatter_publish_ml(k, lay, sc, m_lane, l_lane, parity)

    # combine the lane groups of a warp (rows were split over them)
    merge_lane_groups(k, T, m, l, [_flat(a) for a in acc])

    # each warp's result to shared memory: [warp][head][D] and [warp][head][max, sum]
    sm_acc = k.shared_array(f"{tag}_acc", "f32", W * HB * D)
    sm_ml = k.shared_array(f"{tag}_ml", "f32", W * HB * 2)
    in_group0 = k.setp("lt", lane, T)
    with k.if_(in_group0):
        for i in range(HB):
            wh = k.mad(warp, HB, i) if i else k.mul(warp, HB)
            row = k.add(sm_acc, k.mul(wh, D * 4))
            for c in range(C):
                addr = k.add(row, k.shl(chunk_idx[c], 4))
                vals = [acc[i][c][e] for e in range(4)]
                if chunk_ok[c] is not None:
                    k.store("shared", "f32", addr, vals, pred=chunk_ok[c])
                else:
                    k.store("shared", "f32", addr, vals)
            with k.if_(k.setp("eq", lane, 0)):
                k.store("shared", "f32", k.add(sm_ml, k.shl(wh, 3)), [m[i], l[i]])
    k.bar_sync()
    return BlockState(lay, head0, sm_acc, sm_ml)


def _l2_prefetcher(k: KernelBuilder, lay: DecodeLayout, lanes: Lanes, kv_off0: Reg, start: Reg, end: Reg):
    """With ``l2_prefetch`` on sm_90: thread 0 asks the L2 for the block's first ``l2_prefetch`` steps of
    K and V rows now and returns ``ahead(a)``, which requests the step of rows from ``a`` (clipped to
    ``end``): the demand loads of the row loop then find their rows in the L2. None otherwise."""
    if not lay.l2_prefetch or k.target.compute_capability < (9, 0):
        return None
    row_bytes = lay.head_dim * 4
    t0 = k.setp("eq", lanes.tid, 0)
    kbase = k.add(k.global_ptr("k_cache"), kv_off0)
    vbase = k.add(k.global_ptr("v_cache"), kv_off0)

    def fetch(a: Reg, b: Reg) -> None:
        with k.if_(k.and_(t0, k.setp("lt", a, b))):
            off = k.mul_wide(a, row_bytes)
            nbytes = k.mul(k.sub(b, a), row_bytes)
            k.prefetch_l2(k.add(kbase, off), nbytes)
            k.prefetch_l2(k.add(vbase, off), nbytes)

    fetch(start, k.min(end, k.add(start, lay.l2_prefetch * lay.rows_per_step), "u32"))

    def ahead(a: Reg) -> None:
        fetch(a, k.min(end, k.add(a, lay.rows_per_step), "u32"))

    return ahead


def _dot(k: KernelBuilder, q: list, kr: list) -> Reg:
    """The lane's part of ``q . k`` (flat value lists, multiplied and summed in order)."""
    dot = None
    for x, y in zip(q, kr):
        dot = k.mul(x, y) if dot is None else k.fma(x, y, dot)
    return dot


def _pv_update(k: KernelBuilder, acc_i: list, alpha: Reg, probs: list, vrows: list) -> None:
    """acc_i = acc_i * alpha + sum_u probs[u] * V[u] for this lane's values (flat lists)."""
    for e, var in enumerate(acc_i):
        a = k.mul(var, alpha)
        for u, p in enumerate(probs):
            a = k.fma(p, vrows[u][e], a)
        k.assign(var, a)


def _butterfly_step(k, lay, qv, krows, vrows, base, end, m, l, acc) -> None:
    """Scores reduced dot by dot over the lane group; every lane runs every head's softmax."""
    U, R = lay.unroll, 32 // lay.lanes_per_row
    valid = [k.setp("lt", k.add(base, u * R) if u else base, end) for u in range(U)]
    butterfly_heads(k, lay.lanes_per_row, [_flat(x) for x in qv], [_flat(r) for r in krows],
                    [_flat(r) for r in vrows], valid, m, l, [_flat(a) for a in acc])


def _scatter_step(k, lay, sc: Scatter, qv, krows, vrows, base, end, m_lane, l_lane, parity, acc) -> None:
    """Reduce-scatter the step's scores, the lane's own head's online softmax, the exchange of
    probabilities and rescale factors through shared memory, then every head's P @ V update."""
    T, U, E, HB = lay.lanes_per_row, lay.unroll, lay.scatter_entries, lay.heads_per_block
    aoff = round4(lay.scatter_values)
    vals = [_dot(k, _flat(qv[s // U]), _flat(krows[s % U])) for s in range(lay.scatter_values)]
    off = T // 2
    while len(vals) > E:  # keep the first half, receive the partner's copy of it
        half = len(vals) // 2
        vals = [k.add(vals[x], k.shfl("bfly", vals[x + half], off)) for x in range(half)]
        off //= 2
    while off >= 1:  # lanes beyond the index space: plain butterflies (identical lanes)
        vals = [k.add(v, k.shfl("bfly", v, off)) for v in vals]
        off //= 2
    scores = [k.selp(v, NEG_INF, k.setp("lt", _plus(k, base, sc.entry_rows[e]), end)) for e, v in enumerate(vals)]
    mx = scores[0]
    for s in scores[1:]:
        mx = k.max(mx, s)
    for mask in sc.u_masks:
        mx = k.max(mx, k.shfl("bfly", mx, mask))
    new_m = k.max(m_lane, mx)
    alpha, probs = online_softmax(k, m_lane, l_lane, new_m, scores)
    k.assign(m_lane, new_m)
    # publish: probabilities at [idx], the head's rescale factor at [aoff + head]
    xb = k.add(sc.xbase, parity)
    _store_floats(k, k.add(xb, k.shl(sc.M, 2)), probs, sc.writer)
    k.store("shared", "f32", k.add(xb, k.shl(k.add(sc.hi, aoff), 2)), alpha, pred=sc.head_writer)
    k.bar_warp_sync()
    alphas = _load_floats(k, xb, aoff * 4, HB)
    for i in range(HB):
        p_i = _load_floats(k, xb, i * U * 4, U)
        _pv_update(k, _flat(acc[i]), alphas[i], p_i, [_flat(r) for r in vrows])
    k.assign(parity, k.xor(parity, lay.exchange_floats * 4))


def _store_floats(k: KernelBuilder, addr: Reg, vals: list, pred: Reg | None) -> None:
    """Consecutive floats to shared memory in 16/8/4-byte pieces (``addr`` aligned to the piece)."""
    i = 0
    while i < len(vals):
        w = 4 if len(vals) - i >= 4 else (2 if len(vals) - i >= 2 else 1)
        part = vals[i:i + w]
        a = k.add(addr, i * 4) if i else addr
        k.store("shared", "f32", a, part if w > 1 else part[0], pred=pred)
        i += w


def _load_floats(k: KernelBuilder, addr: Reg, offset: int, n: int) -> list:
    """n consecutive floats from shared ``addr + offset`` (a broadcast: every lane of the group reads
    the same words), in 16/8/4-byte pieces."""
    out: list = []
    while len(out) < n:
        left = n - len(out)
        w = 4 if left >= 4 else (2 if left >= 2 else 1)
        got = k.load("shared", "f32", addr, offset + 4 * len(out), vec=w)
        out.extend(got if w > 1 else [got])
    return out


def _scatter_publish_ml(k: KernelBuilder, lay: DecodeLayout, sc: Scatter, m_lane: Reg, l_lane: Reg, parity: Reg):
    """After the row loop: each head's (max, sum) from its lanes to every lane of the group, as the
    per-head registers the butterfly layout keeps."""
    total = l_lane
    for mask in sc.u_masks:
        total = k.add(total, k.shfl("bfly", total, mask))
    aoff = round4(lay.scatter_values)
    xb = k.add(sc.xbase, parity)  # the buffer the last step did not use
    k.store("shared", "f32", k.add(xb, k.shl(sc.hi, 2)), total, pred=sc.head_writer)
    k.store("shared", "f32", k.add(xb, k.shl(k.add(sc.hi, aoff), 2)), m_lane, pred=sc.head_writer)
    k.bar_warp_sync()
    l = _load_floats(k, xb, 0, lay.heads_per_block)
    m = _load_floats(k, xb, aoff * 4, lay.heads_per_block)
    return m, l


def emit_combine(k: KernelBuilder, st: BlockState, write) -> None:
    """For every (head i of the block, float4 slot c4) combine the warps' partials and call
    ``write(i, c4, max, sum, acc4)`` (``acc4`` unnormalised, relative to ``ex2(max)``; ``max`` is
    -inf and sum 0 when no row was seen). Slots are spread over the block's threads."""
    lay = st.lay
    HB, NC, W, D = lay.heads_per_block, lay.nc, lay.warps, lay.head_dim
    slots = HB * NC
    tid = k.tid()
    for it in range(-(-slots // lay.threads)):
        slot = k.add(tid, it * lay.threads) if it else tid
        with k.if_(k.setp("lt", slot, slots)):
            i = k.div(slot, NC) if HB > 1 else None
            c4 = k.rem(slot, NC) if HB > 1 else slot
            ms, ls = [], []
            for w in range(W):
                wh = k.add(i, w * HB) if i is not None else None
                ml_addr = k.add(st.sm_ml, k.shl(wh, 3)) if wh is not None else None
                if ml_addr is None:
                    mv, lv = k.load("shared", "f32", st.sm_ml, w * HB * 8, vec=2)
                else:
                    mv, lv = k.load("shared", "f32", ml_addr, vec=2)
                ms.append(mv)
                ls.append(lv)
            mx = ms[0]
            for mv in ms[1:]:
                mx = k.max(mx, mv)
            b = guard_base(k, mx)
            total = None
            acc4 = None
            for w in range(W):
                wt = k.ex2(k.sub(ms[w], b))
                total = k.mul(ls[w], wt) if total is None else k.fma(ls[w], wt, total)
                wh = k.add(i, w * HB) if i is not None else None
                if wh is not None:
                    addr = k.add(st.sm_acc, k.shl(k.mad(wh, NC, c4), 4))
                    vals = k.load("shared", "f32", addr, vec=4)
                else:
                    addr = k.add(st.sm_acc, k.shl(c4, 4))
                    vals = k.load("shared", "f32", addr, w * HB * D * 4, vec=4)
                acc4 = [k.mul(x, wt) for x in vals] if acc4 is None else [k.fma(x, wt, a) for x, a in zip(vals, acc4)]
            write(i, c4, mx, total, acc4)
