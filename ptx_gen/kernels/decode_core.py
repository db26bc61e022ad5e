"""The shared core of the decode attention kernels (one query per head against a KV cache).

Both ``incremental_attention`` (one pass over the whole sequence, normalised output) and
``flash_decoding_chunk`` (one pass over one chunk of the sequence, unnormalised partial) are built
from :func:`build_decode_pass`. Conventions shared by every attention kernel:

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Reg

LOG2E = 1.4426950408889634
NEG_INF = float("-inf")
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DecodeLayout:
    """Compile-time work layout of a decode-attention block."""

    head_dim: int
    group: int  # query heads per KV head
    heads_per_block: int  # query heads of the group served by one block
    warps: int
    lanes_per_row: int  # T
    chunks_per_lane: int  # C (float4 chunks of a row per lane)
    unroll: int  # U (rows per lane group per step)
    prefetch: bool = False  # load step i+1 while computing step i

    @property
    def nc(self) -> int:
        """float4 chunks per row."""
        return self.head_dim // 4

    @property
    def rows_per_warp(self) -> int:
        return (32 // self.lanes_per_row) * self.unroll

    @property
    def rows_per_step(self) -> int:
        """Rows a block covers per loop iteration: the chunk-size quantum."""
        return self.warps * self.rows_per_warp

    @property
    def subgroups(self) -> int:
        """Blocks per KV head."""
        return self.group // self.heads_per_block

    @property
    def threads(self) -> int:
        return self.warps * 32

    def smem_bytes(self) -> int:
        return self.warps * self.heads_per_block * (self.head_dim + 2) * 4


def _choose_lanes(nc: int) -> tuple[int, int]:
    """(T, C): the lane-group width and chunks per lane that waste the fewest lanes for ``nc`` chunks,
    keeping C <= 3 where possible (registers) and preferring wider groups on ties."""
    cap = max(3, -(-nc // 32))
    best = None
    for t in (32, 16, 8, 4, 2, 1):
        c = -(-nc // t)
        if c > cap:
            continue
        waste = c * t - nc
        if best is None or waste < best[0]:
            best = (waste, t, c)
    assert best is not None
    return best[1], best[2]


def check_head_dim(head_dim: int) -> None:
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 4 or head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim must be a positive multiple of 4 up to {MAX_HEAD_DIM} (16-byte rows), got {head_dim!r}"
        )


def decode_layout(
    head_dim: int,
    group: int,
    heads_per_block: int | None = None,
    warps: int = 4,
    unroll: int | None = None,
    prefetch: bool = False,
) -> DecodeLayout:
    """The layout for ``head_dim`` and a GQA ``group``; ``None`` picks the defaults:
    ``heads_per_block`` = the largest divisor of ``group`` keeping <= 32 q and 32 accumulator floats
    per lane, ``unroll`` = about 8 float4 loads in flight per lane per step."""
    check_head_dim(head_dim)
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group (num_heads // num_kv_heads) must be a positive integer, got {group!r}")
    if warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"warps must be 1, 2, 4, 8 or 16, got {warps}")
    t, c = _choose_lanes(head_dim // 4)
    per_head = 4 * c
    if heads_per_block is None:
        heads_per_block = max(d for d in range(1, group + 1) if group % d == 0 and (d * per_head <= 32 or d == 1))
    if heads_per_block < 1 or group % heads_per_block:
        raise ValueError(f"heads_per_block must divide the group size {group}, got {heads_per_block}")
    if unroll is None:  # ~8 float4 loads in flight per lane, within a ~140-register estimate
        unroll = max(1, 4 // c)
        kv_sets = 2 if prefetch else 1
        while unroll > 1 and 8 * heads_per_block * c + 8 * kv_sets * unroll * c + heads_per_block * unroll + 24 > 140:
            unroll -= 1
    if unroll < 1 or unroll > 8:
        raise ValueError(f"unroll must be in 1..8, got {unroll}")
    return DecodeLayout(head_dim, group, heads_per_block, warps, t, c, unroll, bool(prefetch))


def chunk_rows(seq_len: int, num_chunks: int, quantum: int, min_chunk: int) -> int:
    """Rows per chunk for flash decoding, as the kernels compute it on the device:
    ``max(roundup(max(ceil(L / num_chunks), 1), quantum), min_chunk)``."""
    per = max(-(-seq_len // num_chunks), 1)
    return max(-(-per // quantum) * quantum, min_chunk)


def emit_chunk_rows(k: KernelBuilder, seq_len: Reg, num_chunks: Reg | int, quantum: int, min_chunk: Reg) -> Reg:
    """The device-side twin of :func:`chunk_rows` (u32 arithmetic; seq_len <= max_len < 2**31)."""
    per = k.div(k.add(seq_len, k.sub(num_chunks, 1, "u32") if isinstance(num_chunks, Reg) else num_chunks - 1),
                num_chunks, "u32")
    per = k.max(per, 1, "u32")
    rounded = k.mul(k.div(k.add(per, quantum - 1), quantum), quantum)
    return k.max(rounded, min_chunk, "u32")


def guard_base(k: KernelBuilder, m: Reg) -> Reg:
    """The exponent base for a running max ``m``: ``m``, or 0 when ``m`` is -inf (no finite term yet),
    so that ``ex2(x - base)`` is ``ex2(-inf) = 0`` for every -inf ``x`` instead of NaN."""
    return k.selp(0.0, m, k.setp("eq", m, NEG_INF))


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


def lane_setup(k: KernelBuilder, lay: DecodeLayout) -> Lanes:
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
    return Lanes(tid, lane, warp, g, j, chunk_idx, chunk_ok)


def load_q(k: KernelBuilder, lay: DecodeLayout, lanes: Lanes, head0: Reg) -> list:
    """This lane's chunks of q for the block's heads, pre-scaled into the log2 domain
    (``qv[head][chunk]`` = 4 registers). Independent of seq_len: emit it early so the loads overlap."""
    D, C, HB = lay.head_dim, lay.chunks_per_lane, lay.heads_per_block
    row_bytes = D * 4
    qscale = LOG2E / math.sqrt(D)
    q_ptr = k.global_ptr("q")
    qv: list[list[tuple[Reg, ...]]] = []
    for i in range(HB):
        qrow = k.add(q_ptr, k.mul_wide(k.add(head0, i), row_bytes)) if i else k.add(q_ptr, k.mul_wide(head0, row_bytes))
        per_c = []
        for c in range(C):
            addr = k.add(qrow, k.mul_wide(lanes.chunk_idx[c], 16))
            ok = lanes.chunk_ok[c]
            vals = k.load("global", "f32", addr, vec=4, nc=True, pred=ok, other=0.0) if ok is not None \
                else k.load("global", "f32", addr, vec=4, nc=True)
            per_c.append(tuple(k.mul(x, qscale) for x in vals))
        qv.append(per_c)
    return qv


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

    # per-lane base addresses of the KV head's rows
    kv_row0 = k.mul_wide(kvh, k.param("max_len"))  # u64 row index of (kvh, 0)
    kv_off0 = k.mul(kv_row0, row_bytes, "u64")
    k_lane, v_lane = [], []
    for c in range(C):
        off = k.add(kv_off0, k.mul_wide(chunk_idx[c], 16))
        k_lane.append(k.add(k.global_ptr("k_cache"), off))
        v_lane.append(k.add(k.global_ptr("v_cache"), off))

    m = [k.var("f32", NEG_INF) for _ in range(HB)]
    l = [k.var("f32", 0.0) for _ in range(HB)]
    acc = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(C)] for _ in range(HB)]

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
                ok = chunk_ok[c]
                if guard is not None:
                    ok = guard if ok is None else k.and_(ok, guard)
                per_c.append(k.load("global", "f32", addr, vec=4, nc=True, pred=ok, other=0.0) if ok is not None
                             else k.load("global", "f32", addr, vec=4, nc=True))
            rows.append(per_c)
        return rows

    def step_loads(sb_reg, guard=None):
        """K and V of this lane's U rows of the step starting at ``sb_reg``; rows past the end re-read
        the last row (their scores are masked to -inf), so every address stays inside the sequence."""
        base = k.add(sb_reg, warp_row0)
        offs = [k.mul_wide(k.min(k.add(base, u * R) if u else base, last, "u32"), row_bytes) for u in range(U)]
        return load_rows(k_lane, offs, guard), load_rows(v_lane, offs, guard)

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
        base = k.add(sb, warp_row0)
        valid = [k.setp("lt", k.add(base, u * R) if u else base, end) for u in range(U)]
        for i in range(HB):
            scores = []
            for u in range(U):
                dot = None
                for c in range(C):
                    for e in range(4):
                        if dot is None:
                            dot = k.mul(qv[i][c][e], krows[u][c][e])
                        else:
                            dot = k.fma(qv[i][c][e], krows[u][c][e], dot)
                off = T // 2
                while off >= 1:
                    dot = k.add(dot, k.shfl("bfly", dot, off))
                    off //= 2
                scores.append(k.selp(dot, NEG_INF, valid[u]))
            mx = m[i]
            for s in scores:
                mx = k.max(mx, s)
            base_i = guard_base(k, mx)
            alpha = k.ex2(k.sub(m[i], base_i))
            probs = [k.ex2(k.sub(s, base_i)) for s in scores]
            psum = probs[0]
            for p in probs[1:]:
                psum = k.add(psum, p)
            k.assign(l[i], k.fma(l[i], alpha, psum))
            for c in range(C):
                for e in range(4):
                    a = k.mul(acc[i][c][e], alpha)
                    for u in range(U):
                        a = k.fma(probs[u], vrows[u][c][e], a)
                    k.assign(acc[i][c][e], a)
            k.assign(m[i], mx)
        if lay.prefetch:
            for cur, nxt in ((kcur, knext), (vcur, vnext)):
                for u in range(U):
                    for c in range(C):
                        for e in range(4):
                            k.assign(cur[u][c][e], nxt[u][c][e])

    # combine the lane groups of a warp (rows were split over them)
    off = T
    while off < 32:
        for i in range(HB):
            mo = k.shfl("bfly", m[i], off)
            lo = k.shfl("bfly", l[i], off)
            ao = [[k.shfl("bfly", acc[i][c][e], off) for e in range(4)] for c in range(C)]
            mx = k.max(m[i], mo)
            b = guard_base(k, mx)
            fa, fb = k.ex2(k.sub(m[i], b)), k.ex2(k.sub(mo, b))
            k.assign(l[i], k.fma(lo, fb, k.mul(l[i], fa)))
            for c in range(C):
                for e in range(4):
                    k.assign(acc[i][c][e], k.fma(ao[c][e], fb, k.mul(acc[i][c][e], fa)))
            k.assign(m[i], mx)
        off *= 2

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
