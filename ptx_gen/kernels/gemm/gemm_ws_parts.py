"""gemm_ws's pipeline pieces (:mod:`ptx_gen.kernels.gemm.gemm_ws`): the consumers' X copies (16-byte ``cp.async`` or a
tensor map, with or without multicast to a cluster pair), the cluster's release of a slot, the ring position of a
stage and the sum of a K split's parts."""

from __future__ import annotations

import contextlib

from ptx_gen.builder import KernelBuilder, Reg

__all__ = ["RingPosition", "StreamUnits", "cluster_release", "sum_parts", "x_by_cp_async", "x_by_tensor_map"]


def x_by_cp_async(k: KernelBuilder, tid: Reg, group: int, tok0: Reg, m_all: Reg, x0: Reg, xb: int, mt: int, bar):
    """The consumers' X copies: 8 threads a token (the thread's 16-byte piece xp), group / 8 tokens a pass, each
    thread's copies arriving on the stage's full barrier (``cp.async.mbarrier.arrive.noinc``). Returns
    ``copy_x(c, h, slot, ok)``: X of stage (chunk ``c``, ``h``) into ``slot`` where ``ok``."""
    tpp = group // 8
    xp, xn = k.and_(tid, 7), k.shr(tid, 3)
    lda2 = k.shl(k.param("lda"), 1)
    t_first = k.add(tok0, xn)
    x_src = k.add(k.global_ptr("x"), k.add(k.mul_wide(t_first, lda2), k.cvt(k.shl(xp, 4), "u64")))
    x_pass = k.mul_wide(lda2, tpp)
    left = k.sub(m_all, t_first, "s32")  # tokens from the thread's first one to m (past m: not copied, not written)
    x_live = [k.setp("gt", left, v * tpp, "s32") for v in range(mt // tpp)]
    x_dst = k.add(k.add(x0, k.shl(xn, 7)), k.shl(k.xor(xp, k.and_(xn, 7)), 4))

    def copy_x(c: Reg, h: int, slot: Reg | int, ok: Reg | None) -> None:
        src = k.add(x_src, k.cvt(k.add(k.shl(c, 9), 128 * h), "u64"))  # (chunk c's X starts 512 c bytes into a row)
        dst, off = (x_dst, slot * xb) if isinstance(slot, int) else (k.mad(slot, xb, x_dst), 0)
        for v, live in enumerate(x_live):
            if v:
                src = k.add(src, x_pass)
            k.cp_async(dst, src, pred=k.both(ok, live), dst_offset=off + v * tpp * 128)
        k.cp_async_mbarrier_arrive(bar(slot), pred=ok)

    return copy_x


def x_by_tensor_map(k: KernelBuilder, tid: Reg, tok0: Reg, x0: Reg, xb: int, mt: int, bar, rank: Reg | None = None,
                xcast: int = 1, skip: bool = False):
    """X by the tensor map ``xmap``: consumer thread 0 announces a stage's ``mt`` x 128 bytes on its full barrier
    (its one arrival there) and copies the box (k ``256 c + 64 h`` .., tokens ``tok0`` ..), which lands in the
    128-byte swizzle the B tile is read in; tokens past m land as zeros. With ``xcast`` (the map's boxes ``mt /
    xcast`` tokens) it copies tokens ``tok0 + rank mt / xcast`` .. into that part of the B tile of every CTA of its
    cluster, whose copies fill the rest. ``skip`` (a diagnostic launch): thread 0 only arrives. Returns ``copy_x`` as
    :func:`x_by_cp_async`."""
    lead = k.setp("eq", tid, 0)
    xmap = k.param_address("xmap")
    if rank is not None:
        part = mt // xcast
        tok0 = k.mad(rank, part, tok0)
        x0 = k.mad(rank, part * 128, x0)

    def copy_x(c: Reg, h: int, slot: Reg | int, ok: Reg | None) -> None:
        go = k.both(ok, lead)
        at = bar(slot)
        if skip:
            k.mbarrier_arrive(at, pred=go)
            return
        dst = (k.add(x0, slot * xb) if slot else x0) if isinstance(slot, int) else k.mad(slot, xb, x0)
        k.mbarrier_expect_tx(at, mt * 128, pred=go)
        k.cp_async_bulk_tensor_2d(dst, xmap, k.add(k.shl(c, 8), 64 * h), tok0, at, pred=go,
                                  multicast=(1 << xcast) - 1 if rank is not None else None)

    return copy_x


def cluster_release(k: KernelBuilder, xbar: Reg, peer: Reg, parity: Reg | int, had: Reg | None) -> None:
    """X multicast, consumer thread 0 once its CTA released a slot (``had``: there was a use to release): arrive on
    the slot's cluster-release barrier here, then on the other CTA's (in that order: the other cannot see this phase
    complete before this CTA's own arrival is in), and wait until both have (the other's copy into this CTA's slot,
    and this one's into the other's, may then start)."""
    with (k.if_(had) if had is not None else contextlib.nullcontext()):
        k.mbarrier_arrive(xbar)
        k.mbarrier_arrive_cluster(k.mapa(xbar, peer))
        k.mbarrier_wait(xbar, parity)


class RingPosition:
    """The ring slot of stage ``4 i + h`` (chunk ``i``, its 64-k part ``h``) and the parity of the slot's use: immediates
    (and ``i``'s low bit) where ``stages`` divides a chunk's 4 stages, else registers that :meth:`advance` moves on
    one stage (the stages taken in order, each once). ``dynamic``: registers whatever the depth (a ring that goes on
    over several ranges of chunks, each counting its own ``i`` from zero)."""

    def __init__(self, k: KernelBuilder, stages: int, dynamic: bool = False):
        self.k, self.stages = k, stages
        self.dynamic = dynamic or 4 % stages != 0
        if self.dynamic:
            self.slot, self.parity = k.var("u32", 0), k.var("u32", 0)

    def at(self, i: Reg, h: int) -> tuple[Reg | int, Reg | int]:
        if self.dynamic:
            return self.slot, self.parity
        if self.stages == 4:
            return h, self.k.and_(i, 1)
        return h & 1, (h >> 1) & 1

    def prev(self, slot: Reg | int) -> Reg | int:
        """The slot of the stage before the one in ``slot``."""
        if isinstance(slot, int):
            return (slot - 1) % self.stages
        k = self.k
        return k.selp(self.stages - 1, k.sub(slot, 1), k.setp("eq", slot, 0), "u32")

    def prev_parity(self, h: int, slot: Reg | int, parity: Reg | int) -> Reg | int:
        """The parity of the previous stage's use of its slot, given stage ``4 i + h``'s ``slot`` and ``parity``."""
        k = self.k
        if self.dynamic:  # (the same pass of the ring unless this stage opened one)
            return k.selp(k.xor(parity, 1), parity, k.setp("eq", slot, 0), "u32")
        if self.stages == 4:
            return parity if h else k.xor(parity, 1)
        return ((h - 1) // 2) & 1

    def advance(self) -> None:
        if not self.dynamic:
            return
        k = self.k
        wrap = k.setp("eq", self.slot, self.stages - 1)
        k.assign(self.slot, k.selp(0, k.add(self.slot, 1), wrap, "u32"))
        k.assign(self.parity, k.selp(k.xor(self.parity, 1), self.parity, wrap, "u32"))


class StreamUnits:
    """Stream-K: the launch's ``T`` = output tiles x ``nct`` chunks of K taken as one sequence, CTA ``b`` of ``G``
    multiplying chunks ``b T / G`` .. ``(b + 1) T / G`` of it, tile by tile (tile ``t``: row tile ``t % ntiles``, token
    tile ``t / ntiles``), each tile's chunks in a *unit*. With no more CTAs than tiles a CTA's range is at least a
    tile long, so a tile is either one CTA's whole unit or split between two: the part starting at chunk 0 (part 0)
    and the rest (part 1), summed like a K split in two. Every role of the CTA walks the same units: :meth:`begin`
    opens one (the loop's head), :meth:`end` closes it (every thread of the CTA meets there, so that the next unit's
    stages reuse shared memory only once the epilogue is done with it)."""

    def __init__(self, k: KernelBuilder, nct: int, mt: int, m_all: Reg):
        self.k, self.nct = k, nct
        self.ntiles = k.param("ntiles")
        ntok = k.shr(k.add(m_all, mt - 1), mt.bit_length() - 1)
        total = k.mul(k.mul(self.ntiles, ntok), nct)
        ctas, b = k.sreg("nctaid.x"), k.ctaid()
        self.cur = k.var("u32", k.div(k.mul(b, total), ctas))
        self.stop = k.div(k.mul(k.add(b, 1), total), ctas)
        self.head, self.done = k.new_label("unit"), k.new_label("units_done")

    def begin(self) -> tuple[Reg, Reg]:
        """Open the next unit (leaving the loop past the last): (its first chunk of K, its chunks); sets ``tile``,
        ``col_tile`` and ``tok_tile``, ``split`` (the tile is shared with another CTA) and ``part``."""
        k = self.k
        k.label(self.head)
        k.bra(self.done, k.setp("ge", self.cur, self.stop))
        self.tile = k.div(self.cur, self.nct)
        c0 = k.sub(self.cur, k.mul(self.tile, self.nct))
        self.n = k.min(k.sub(self.nct, c0), k.sub(self.stop, self.cur))
        self.col_tile, self.tok_tile = k.rem(self.tile, self.ntiles), k.div(self.tile, self.ntiles)
        first = k.setp("ne", c0, 0)
        self.split = k.or_(first, k.setp("ne", self.n, self.nct))
        self.part = k.selp(1, 0, first, "u32")
        return c0, self.n

    def end(self) -> None:
        """Close the unit: every thread of the CTA meets, then the next one."""
        k = self.k
        k.bar_sync()
        k.assign(self.cur, k.add(self.cur, self.n))
        k.bra(self.head)
        k.label(self.done)


def sum_parts(k: KernelBuilder, acc: list, tid: Reg, group: int, flag_at: Reg, kparts: int = 2,
               leave: str | None = None, tile: Reg | None = None, part: Reg | None = None) -> None:
    """K split over ``kparts`` CTAs (grid z): each writes its accumulators to ``part`` (16-byte pieces, piece ``j`` of
    every consumer thread side by side: coalesced), the consumers' threads fence and meet, thread 0 counts the CTA at
    its output tile's counter (``atom.inc`` with bound kparts - 1: it wraps back to zero on the last arrival); all but
    the last return, the last sums and runs the epilogue. Two parts: the other's floats added to its own (the same
    whichever CTA comes last); four: the four read back and added in the order of z. ``flag_at``: a shared u32 free
    after the main loop (it tells the consumers which CTA they are in). ``leave``: the label the others branch to
    instead of returning. ``tile`` and ``part`` (Stream-K: a CTA's range of chunks ends or starts inside the tile): the
    output tile and the part instead of the grid's."""
    n = len(acc)
    if tile is None:
        tile = k.add(k.mul(k.ctaid("y"), k.sreg("nctaid.x")), k.ctaid())
    base, part = k.global_ptr("part"), k.ctaid("z") if part is None else part

    def pieces_of(p: Reg | int) -> Reg:  # (the CTA's n / 4 pieces of group threads: piece j of thread t at 16 (j group
        # + t))
        first = k.shl(tile, kparts.bit_length() - 1)
        return k.add(base, k.mul_wide(k.mad(k.add(first, p) if p else first, group * n // 4, tid), 16))

    mine = pieces_of(part)
    for j in range(0, n, 4):
        k.store("global", "f32", mine, acc[j:j + 4], 4 * j * group)
    k.fence("gl")  # (this thread's partial sums are visible GPU-wide before its CTA is counted)
    k.bar_sync(1, group)
    counter = k.add(k.global_ptr("counters"), k.mul_wide(tile, 4))
    with k.if_(k.setp("eq", tid, 0)):
        second = k.setp("eq", k.atom("global", "inc", "u32", counter, kparts - 1), kparts - 1)  # (the last: the
        # counter is back at zero)
        with k.if_(second):
            k.fence("gl")  # (acquire: the first CTA's partial sums are visible from here on)
        k.store("shared", "u32", flag_at, k.selp(1, 0, second, "u32"))
    k.bar_sync(1, group)
    with k.if_(k.setp("eq", k.load("shared", "u32", flag_at), 0)):
        if leave is None:
            k.ret()
        else:
            k.bra(leave)
    if kparts == 2:
        other = pieces_of(k.xor(part, 1))
        for j in range(0, n, 4):
            vals = k.load("global", "f32", other, 4 * j * group, vec=4, cache="cg")
            for e in range(4):
                k.assign(acc[j + e], k.add(acc[j + e], vals[e]))
        return
    first = pieces_of(0)  # (part p's pieces 4 p group n bytes further)
    for j in range(0, n, 4):  # (the sum in the accumulators, a part at a time: four registers more)
        for p in range(kparts):
            vals = k.load("global", "f32", first, 4 * j * group + 4 * p * group * n, vec=4, cache="cg")
            for e in range(4):
                k.assign(acc[j + e], k.add(acc[j + e], vals[e]) if p else vals[e])
