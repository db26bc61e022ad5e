"""In-kernel combination of split-KV partials: the last block to finish combines.

Single-launch flash decoding (``flash_decoding`` in ``flash_decoding.py``) ends each block with a
partial ``(max, sum, acc)`` per query head in global memory. Instead of a second kernel, the block
that finishes *last* among those whose partials are needed combines them. Two pieces:

* :func:`arrive` -- every block of a set increments the set's u32 counter once; the block that sees
  ``count - 1`` is the last one, resets the counter to 0 (so the next launch, or graph replay, starts
  from 0 again) and carries on; the others return. Ordering follows the documented last-block pattern:
  every thread fences (``membar.gl``) after its partial stores, a block barrier, thread 0's atomic; the
  last block's thread 0 fences again (acquire) before a barrier lets its threads read the partials,
  which they do with ``ld.global.cg`` (from the L2, never a stale L1 line).
* :func:`combine_partials` -- the exact combination of ``count`` consecutive partials per head:
  ``M = max m_j``, ``sum = sum_j ex2(m_j - M) l_j``, ``acc = sum_j ex2(m_j - M) acc_j`` (log2 domain),
  read ``batch`` partials at a time (all loads of a batch in flight together, 6 registers each) with a
  running rescale between batches; never ``-inf - -inf``. :func:`combine_batch` sizes the batch to the
  registers the row loop needs anyway, so the combine never lowers the kernel's occupancy.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.attention.decode_core import NEG_INF, DecodeLayout, guard_base, loop_registers


def combine_batch(lay: DecodeLayout) -> int:
    """Partials loaded at once by :func:`combine_partials`: 16 (about 124 registers in all) where the
    row loop needs more than 100 registers anyway, else 8."""
    return 16 if loop_registers(lay) > 100 else 8


def arrive(k: KernelBuilder, counter_addr: Reg, count: Reg, flag: Reg) -> None:
    """Block-wide: count this block at ``counter_addr``; every block but the ``count``-th returns.
    ``flag`` is a shared u32 (reused: a barrier separates its uses)."""
    k.fence("gl")  # this thread's partial stores are visible GPU-wide before the block is counted
    k.bar_sync()
    with k.if_(k.setp("eq", k.tid(), 0)):
        old = k.atom("global", "add", "u32", counter_addr, 1)
        last = k.setp("eq", old, k.sub(count, 1, "u32"))
        with k.if_(last):
            k.store("global", "u32", counter_addr, 0)
            k.fence("gl")  # acquire: the partials of every counted block are visible from here on
        k.store("shared", "u32", flag, k.selp(1, 0, last, "u32"))
    k.bar_sync()
    with k.if_(k.setp("eq", k.load("shared", "u32", flag), 0)):
        k.ret()


def combine_partials(
    k: KernelBuilder, lay: DecodeLayout, head0: Reg, slots_per_head: Reg, first: Reg, count: Reg, write,
    batch: int,
) -> None:
    """For every (head i of the block, float4 column c4): combine partial slots ``first .. first +
    count - 1`` of head ``head0 + i`` (``part_ml[(head * slots_per_head + s) * 2]``, ``part_acc[(head *
    slots_per_head + s) * head_dim]``) and call ``write(i, c4, max, sum, acc4)``. ``count >= 1``."""
    HB, NC = lay.heads_per_block, lay.nc
    part_acc, part_ml = k.global_ptr("part_acc"), k.global_ptr("part_ml")
    tid = k.tid()
    slots = HB * NC
    for it in range(-(-slots // lay.threads)):
        slot = k.add(tid, it * lay.threads) if it else tid
        with k.if_(k.setp("lt", slot, slots)):
            i = k.div(slot, NC) if HB > 1 else None
            c4 = k.rem(slot, NC) if HB > 1 else slot
            head = k.add(head0, i) if i is not None else head0
            row0 = k.mad(head, slots_per_head, first)  # partial index of (head, first)
            m = k.var("f32", NEG_INF)
            total = k.var("f32", 0.0)
            acc = [k.var("f32", 0.0) for _ in range(4)]
            with k.loop(0, count, batch) as b0:
                loaded = []
                for j in range(batch):
                    rel = k.add(b0, j) if j else b0
                    ok = k.setp("lt", rel, count)
                    pidx = k.add(row0, rel)
                    mv, lv = k.load("global", "f32", k.add(part_ml, k.mul_wide(pidx, 8)), vec=2, cache="cg",
                                    pred=ok, other=0.0)
                    av = k.load("global", "f32", k.add(part_acc, k.mul_wide(k.mad(pidx, NC, c4), 16)), vec=4,
                                cache="cg", pred=ok, other=0.0)
                    loaded.append((k.selp(mv, NEG_INF, ok), lv, av))
                mx = m
                for mv, _, _ in loaded:
                    mx = k.max(mx, mv)
                base = guard_base(k, mx)
                fa = k.ex2(k.sub(m, base))
                t = k.mul(total, fa)
                a = [k.mul(x, fa) for x in acc]
                for mv, lv, av in loaded:
                    w = k.ex2(k.sub(mv, base))  # 0 for slots past count (-inf)
                    t = k.fma(lv, w, t)
                    a = [k.fma(x, w, y) for x, y in zip(av, a)]
                k.assign(total, t)
                for var, val in zip(acc, a):
                    k.assign(var, val)
                k.assign(m, mx)
            write(i, c4, m, total, acc)


def partial_writer(k: KernelBuilder, lay: DecodeLayout, head0: Reg, part_acc: Reg, part_ml: Reg, slots_per_head: Reg,
                   slot: Reg):
    """The ``write(i, c4, max, sum, acc4)`` (of :func:`ptx_gen.kernels.attention.decode_core.emit_combine` and
    :func:`combine_partials`) that stores head ``head0 + i``'s partial into ``slot``: its unnormalised
    ``acc4`` into ``part_acc``, ``(max, sum)`` (by the ``c4 = 0`` thread) into ``part_ml``, the layout
    :func:`combine_partials` reads."""

    def write(i, c4, mx, total, acc4):
        head = k.add(head0, i) if i is not None else head0
        pidx = k.mad(head, slots_per_head, slot)
        k.store("global", "f32", k.add(part_acc, k.mul_wide(k.mad(pidx, lay.nc, c4), 16)), acc4)
        with k.if_(k.setp("eq", c4, 0)):
            k.store("global", "f32", k.add(part_ml, k.mul_wide(pidx, 8)), [mx, total])

    return write
