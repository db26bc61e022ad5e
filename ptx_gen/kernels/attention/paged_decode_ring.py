"""The K/V pass of :mod:`ptx_gen.kernels.attention.paged_decode` through a ring in shared memory filled by bulk
copies (sm_90): the registers hold no loads in flight, so a block keeps ``stages`` stages of its K/V rows coming
while its warps work on the one before.

A stage is the ``step`` positions the 4 warps take per step (``4 (32 / T) U``): their K rows, then their V rows, in
pieces of ``PR = min(block_size, step)`` rows, each one ``cp.async.bulk`` (a pool block of one KV head is contiguous,
so is any run of its rows; chunks start on whole blocks, so a piece never crosses one). Thread 0 asks for the
first ``stages`` stages, and for stage ``t + stages`` once every thread has released stage ``t``'s slot (its empty
barrier: one arrival a thread); a stage's full barrier takes thread 0's arrival with the stage's bytes. The warps
read their rows from the slot (16-byte shared loads; V rows past the chunk's end read as zeros and K rows' scores are
masked: the copies bring whole pieces, and a block's rows past the sequence hold whatever the pool has there) and
update the online softmax as the register pass does. After the last stage the ring holds the warps' results for the
block's combine.

Layout (dynamic shared memory, :func:`ring_bytes`): ``stages`` slots of ``2 step D`` values, then the full and empty
barriers."""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.attention.decode_core import (NEG_INF, BlockState, Lanes, Scatter, _scatter_publish_ml,
                                                   _scatter_setup, _scatter_step, butterfly_heads, merge_lane_groups)
from ptx_gen.kernels.attention.decode_plan import DecodeLayout
from ptx_gen.kernels.kv.paged_kv import ELEM_BYTES, load_values, log2

__all__ = ["RING_STAGES", "RING_DTYPES", "Ring", "check_ring", "lane_roles", "pass_state", "publish", "ring_bytes",
           "scatter_applies", "scatter_lanes"]

RING_STAGES = (2, 3, 4, 5, 6, 8)
RING_DTYPES = ("f32", "f16", "bf16")  # (q8_0's scales live in their own pool: the register pass reads them)


def check_ring(stages: int, kv_dtype: str, target) -> None:
    if stages not in RING_STAGES:
        raise ValueError(f"ring stages must be one of {RING_STAGES} (0: no ring), got {stages!r}")
    if kv_dtype not in RING_DTYPES:
        raise ValueError(f"the ring takes K/V of {RING_DTYPES}, got {kv_dtype!r}")
    if target.compute_capability < (9, 0):
        raise ValueError(f"the ring's bulk copies need sm_90 or newer, the target is {target}")


def ring_bytes(stages: int, head_dim: int, group: int, block_size: int, kv_dtype: str, step: int, warps: int) -> int:
    """Dynamic shared bytes: the slots (or the warps' results, where larger), then 2 ``stages`` barriers."""
    slots = stages * 2 * step * head_dim * ELEM_BYTES[kv_dtype]
    results = warps * group * (head_dim + 2) * 4
    return -(-max(slots, results) // 16) * 16 + 16 * stages


class Ring:
    """The ring of one block: built (its barriers initialised) in the kernel's prologue, :meth:`begin` once the
    kernel may read K/V (thread 0 asks for the first stages), :meth:`run` for the pass over rows [start, end)."""

    def __init__(self, k: KernelBuilder, lay, kvh: Reg, n_kv: Reg, start: Reg, end: Reg, block_size: int,
                 kv_dtype: str, unroll: int, T: int, stages: int):
        self.k, self.lay, self.kvh, self.n_kv, self.start, self.end = k, lay, kvh, n_kv, start, end
        self.bs, self.kv_dtype, self.U, self.T, self.stages = block_size, kv_dtype, unroll, T, stages
        D, W = lay.head_dim, lay.warps
        self.E = ELEM_BYTES[kv_dtype]
        self.step = W * (32 // T) * unroll
        self.PR = min(block_size, self.step)  # rows a piece
        self.NP = self.step // self.PR  # pieces a stage
        self.pb = self.PR * D * self.E  # bytes a piece
        self.slot_bytes = 2 * self.step * D * self.E
        self.tid = k.tid()
        self.ring = k.dynamic_shared(align=128)
        self.bars = k.add(self.ring, ring_bytes(stages, D, lay.heads_per_block, block_size, kv_dtype, self.step, W)
                          - 16 * stages)
        self.lead = k.setp("eq", self.tid, 0)
        with k.if_(self.lead):
            for s in range(stages):
                k.mbarrier_init(self.full(s), 1)
                k.mbarrier_init(self.empty(s), lay.threads)
        k.fence_mbarrier_init()
        k.bar_sync()
        self.nst = k.shr(k.add(k.sub(end, start, "u32"), self.step - 1), log2(self.step))  # stages of the chunk
        self.table = None

    def full(self, slot: Reg | int) -> Reg:
        k = self.k
        return k.add(self.bars, 8 * slot) if isinstance(slot, int) else k.add(self.bars, k.shl(slot, 3))

    def empty(self, slot: Reg | int) -> Reg:
        return self.k.add(self.full(slot), 8 * self.stages)

    def _issue(self, t: Reg | int, slot: Reg | int, go: Reg | None) -> None:
        """Thread 0 (``go``): stage ``t``'s pieces into ``slot`` (only those holding rows before ``end``)."""
        k, bs, PR, NP, pb = self.k, self.bs, self.PR, self.NP, self.pb
        row_bytes = self.lay.head_dim * self.E
        row0 = k.add(self.start, t * self.step) if isinstance(t, int) else k.mad(t, self.step, self.start)
        if isinstance(slot, int):
            dst = k.add(self.ring, slot * self.slot_bytes) if slot else self.ring
        else:
            dst = k.mad(slot, self.slot_bytes, self.ring)
        at = self.full(slot)
        if NP == 1:
            k.mbarrier_expect_tx(at, 2 * pb, pred=go)
        else:
            pieces = k.shr(k.add(k.sub(self.end, row0, "u32"), PR - 1), log2(PR))
            k.mbarrier_expect_tx(at, k.mul(k.min(pieces, NP, "u32"), 2 * pb), pred=go)
        for p in range(NP):
            row = k.add(row0, p * PR) if p else row0
            ok = k.both(go, k.setp("lt", row, self.end)) if p else go
            page = k.load("global", "u32", k.add(self.table, k.mul_wide(k.shr(row, log2(bs)), 4)), pred=ok, other=0)
            r_in = k.mad(k.mad(page, self.n_kv, self.kvh), bs, k.and_(row, bs - 1)) if PR < bs else \
                k.mul(k.mad(page, self.n_kv, self.kvh), bs)
            off = k.mul_wide(r_in, row_bytes)
            k.cp_async_bulk(k.add(dst, p * pb) if p else dst, k.add(k.global_ptr("k_pool"), off), pb, at, pred=ok)
            k.cp_async_bulk(k.add(dst, (NP + p) * pb), k.add(k.global_ptr("v_pool"), off), pb, at, pred=ok)

    def begin(self, table: Reg) -> None:
        """Thread 0 asks for the chunk's first stages (the block's row of the block tables at ``table``)."""
        self.table = table
        for s in range(self.stages):
            self._issue(s, s, self.k.both(self.lead, self.k.setp("gt", self.nst, s, "u32")))

    def run(self, q_regs: list, sc: Scatter | None = None) -> BlockState:
        """The pass (see the module doc); per-warp results to shared memory, as the register pass. ``sc`` (from
        :func:`scatter_lanes`): the step's scores reduce-scattered over the lane group, each lane running the softmax
        of one head (:func:`ptx_gen.kernels.attention.decode_core._scatter_step`; ``q_regs[s]`` then holds head ``s ^
        hi``) instead of every dot reduced on its own and every lane running every head's."""
        k, lay, T, U = self.k, self.lay, self.T, self.U
        D, G, W = lay.head_dim, lay.heads_per_block, lay.warps
        EPL, R, E, step = D // T, 32 // T, self.E, self.step
        lane, warp, g, j = lane_roles(k, self.tid, T)
        acc, m, l, warp_row = pass_state(k, G, EPL, warp, g, R * U)
        if sc is not None:  # (this lane's head only; its probabilities pass through an exchange buffer of two halves)
            slay = scatter_layout(D, G, T, U, W)
            m_lane, l_lane, half = k.var("f32", NEG_INF), k.var("f32", 0.0), k.var("u32", 0)
            quads, acc4 = [_quads(q) for q in q_regs], [_quads(a) for a in acc]
        lane_off = k.mul(j, EPL * E)
        slot, parity = k.var("u32", 0), k.var("u32", 0)
        with k.loop(0, self.nst) as t:
            k.mbarrier_wait(self.full(slot), parity)
            kbase = k.add(k.mad(slot, self.slot_bytes, self.ring), lane_off)
            first = k.mad(t, step, self.start)
            local = [k.add(warp_row, u * R) if u else warp_row for u in range(U)]
            valid = [k.setp("lt", k.add(first, r), self.end) for r in local]
            addrs = [k.mad(r, D * E, kbase) for r in local]
            # (a K row past the end gives a score masked to -inf; a V row's zeros keep its garbage out of the sums;
            # with sc K slot u holds row u ^ mu)
            kaddrs = addrs if sc is None else [k.mad(k.add(warp_row, r), D * E, kbase) for r in sc.kperm]
            krows = [load_values(k, a, EPL, self.kv_dtype, space="shared") for a in kaddrs]
            vrows = [load_values(k, k.add(a, step * D * E), EPL, self.kv_dtype, v, space="shared")
                     for a, v in zip(addrs, valid)]
            if sc is None:
                butterfly_heads(k, T, q_regs, krows, vrows, valid, m, l, acc)
            else:
                _scatter_step(k, slay, sc, quads, [_quads(r) for r in krows], [_quads(r) for r in vrows],
                              k.add(first, warp_row), self.end, m_lane, l_lane, half, acc4)
            k.mbarrier_arrive(self.empty(slot))
            nxt = k.add(t, self.stages)
            with k.if_(k.both(self.lead, k.setp("lt", nxt, self.nst))):  # (the slot's next stage, once every thread
                k.mbarrier_wait(self.empty(slot), parity)                # released it)
                self._issue(nxt, slot, None)
            wrap = k.setp("eq", slot, self.stages - 1)
            k.assign(slot, k.selp(0, k.add(slot, 1), wrap, "u32"))
            k.assign(parity, k.selp(k.xor(parity, 1), parity, wrap, "u32"))
        if sc is not None:
            m, l = _scatter_publish_ml(k, slay, sc, m_lane, l_lane, half)
        merge_lane_groups(k, T, m, l, acc)
        k.bar_sync()  # (every warp is done with the slots: the results take their place)
        sm_ml = k.add(self.ring, W * G * D * 4)
        return publish(k, lay, T, (lane, warp, j), m, l, acc, self.ring, sm_ml)


def _quads(values: list) -> list:
    """A lane's flat values as the 4-value pieces :func:`~ptx_gen.kernels.attention.decode_core._scatter_step` takes."""
    return [tuple(values[i:i + 4]) for i in range(0, len(values), 4)]


def scatter_layout(head_dim: int, group: int, T: int, unroll: int, warps: int) -> DecodeLayout:
    """The geometry the reduce-scatter of :mod:`~ptx_gen.kernels.attention.decode_core` reads for a ring block of
    ``warps`` warps, ``group`` heads, ``T`` lanes a row and ``unroll`` rows a lane group per step (the exchange buffer
    is sized by it)."""
    return DecodeLayout(head_dim, group, group, warps, T, head_dim // T // 4, unroll, scatter=True)


def scatter_applies(head_dim: int, group: int, T: int, unroll: int) -> bool:
    """Whether the ring takes reduce-scattered scores at this shape: a power-of-two group (no padding heads) whose
    scores of a step fit the lane group, lanes holding whole 4-value pieces."""
    return (group >= 1 and unroll >= 1 and group & (group - 1) == 0 and group * unroll <= T
            and (head_dim // T) % 4 == 0 and unroll & (unroll - 1) == 0)


def scatter_lanes(k: KernelBuilder, head_dim: int, group: int, T: int, unroll: int, warps: int) -> Scatter:
    """The lane's place in the reduce-scatter (its head ``hi``: the q it loads into slot ``s`` is head ``s ^ hi``)."""
    tid = k.tid()
    lane, warp, g, j = lane_roles(k, tid, T)
    return _scatter_setup(k, scatter_layout(head_dim, group, T, unroll, warps), Lanes(tid, lane, warp, g, j, [], []),
                          "ring")


def lane_roles(k: KernelBuilder, tid: Reg, T: int) -> tuple:
    """The thread's (lane, warp, lane group or None with one group a warp, lane in its group of ``T`` lanes)."""
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    g = k.shr(lane, log2(T)) if T < 32 else None
    j = k.and_(lane, T - 1) if T < 32 else lane
    return lane, warp, g, j


def pass_state(k: KernelBuilder, G: int, EPL: int, warp: Reg, g: Reg | None, warp_rows: int) -> tuple:
    """A pass's running state, zeroed: (acc [head][value], max [head], sum [head]), and the lane group's first row of
    each step (``warp_rows`` rows a warp takes per step, its lane groups one row apart)."""
    acc = [[k.var("f32", 0.0) for _ in range(EPL)] for _ in range(G)]
    m = [k.var("f32", NEG_INF) for _ in range(G)]
    l = [k.var("f32", 0.0) for _ in range(G)]
    warp_row = k.mul(warp, warp_rows)
    if g is not None:
        warp_row = k.add(warp_row, g)
    return acc, m, l, warp_row


def publish(k: KernelBuilder, lay, T: int, lanes: tuple, m: list, l: list, acc: list, sm_acc: Reg,
            sm_ml: Reg) -> BlockState:
    """Each warp's merged results to shared memory, acc [warp][head][D] at ``sm_acc`` and (max, sum) [warp][head] at
    ``sm_ml``, then the block's barrier. ``lanes``: the thread's (lane, warp, lane in its lane group)."""
    D, G = lay.head_dim, lay.heads_per_block
    EPL = D // T
    lane, warp, j = lanes
    with k.if_(k.setp("lt", lane, T)):
        for i in range(G):
            wh = k.mad(warp, G, i) if i else k.mul(warp, G)
            row = k.add(k.add(sm_acc, k.mul(wh, D * 4)), k.shl(j, log2(EPL * 4)) if EPL & (EPL - 1) == 0
                        else k.mul(j, EPL * 4))
            for c in range(EPL // 4):
                k.store("shared", "f32", row, [acc[i][4 * c + e] for e in range(4)], 16 * c)
            with k.if_(k.setp("eq", lane, 0)):
                k.store("shared", "f32", k.add(sm_ml, k.shl(wh, 3)), [m[i], l[i]])
    k.bar_sync()
    return BlockState(lay, None, sm_acc, sm_ml)
