"""Memory instructions: ``ld``/``st``, atomics, asynchronous copies (``cp.async``, bulk copies and
their mbarriers, L2 prefetches). Global accesses go through :class:`~ptx_gen.emulator.memory.Memory`
(memcheck); shared ones through the machine's bounds, landing and race checks."""

from __future__ import annotations

import numpy as np

from ptx_gen.emulator import cluster, tensormap
from ptx_gen.emulator.instructions import op
from ptx_gen.emulator.memory import HEAP_BASE, EmulatorError
from ptx_gen.emulator.parse import BITS, NP, Inst


@op("cp")
def cp(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """The ``cp.async`` family, by form: an L2 bulk prefetch, a bulk copy, a 16-byte async copy."""
    mods = inst.mods
    if mods[:4] == ["async", "bulk", "prefetch", "L2"]:
        return _prefetch(m, inst, act)
    if mods[:3] == ["async", "bulk", "tensor"]:
        return _cp_bulk_tensor(m, inst, act)
    if mods[:2] == ["async", "bulk"]:
        return _cp_bulk(m, inst, act)
    if mods[:4] == ["async", "mbarrier", "arrive", "noinc"]:
        return _cp_async_arrive(m, inst, act)
    if mods[0] == "async":
        return _cp_async(m, inst, act)
    raise EmulatorError(f"instruction not implemented by the emulator: {inst.text}")


def _cp_async_arrive(m, inst: Inst, act: np.ndarray) -> None:
    """``cp.async.mbarrier.arrive.noinc.shared::cta.b64 [mbar]``: the thread's cp.async copies land now (the
    earliest the hardware may complete them) and it arrives on the barrier (one of its expected arrivals). The
    landed bytes are clean for the race check: the barrier's wait orders them before the waiters' reads."""
    _land(m, inst, act, None, clean=True)
    addrs, _ = m.addr(inst.args[0], "shared")
    for t_ in np.flatnonzero(act):
        b = _bar_state(m, int(m.block_of[t_]), int(addrs[t_]), inst)
        b[1] -= 1
        _bar_complete(m, b, int(m.block_of[t_]))


def _prefetch(m, inst: Inst, act: np.ndarray) -> None:
    """An L2 prefetch changes nothing, but its whole range must lie inside one allocation (a
    stray prefetch is a bug even where the hardware would drop it) and be 16-byte granular."""
    addrs, _ = m.addr(inst.args[0], "global")
    sizes = m.read(inst.args[1], "u32").astype(np.int64)
    for a, n in zip(addrs[act], sizes[act]):
        if n % 16 or a % 16:
            raise EmulatorError(f"bulk prefetch of {int(n)} bytes at {int(a):#x} is not 16-byte granular: "
                                f"{inst.text}")
        off = int(a) - HEAP_BASE
        if n and (off < 0 or off + n > m.mem.heap.size or not m.mem.valid[off:off + n].all()):
            raise EmulatorError(f"bulk prefetch of {int(n)} bytes at {int(a):#x} leaves its allocation "
                                f"({m.mem.describe(int(a))}): {inst.text}")


def _cp_async(m, inst: Inst, act: np.ndarray) -> None:
    """``cp.async.{ca,cg}.shared.global [dst], [src], 16``: the global bytes are read (and checked)
    now and land in shared memory at the issuing thread's ``cp.async.wait_all`` (or
    ``commit_group`` + ``wait_group 0``), as that thread's write; touching them before is an error."""
    kind = inst.mods[1]
    if kind == "commit_group":
        m.cp_group[act] += 1
        return
    if kind == "wait_all":
        return _land(m, inst, act, None)
    if kind == "wait_group":  # every group but the newest N committed ones lands
        return _land(m, inst, act, m.cp_group - int(inst.args[0]))
    hints = inst.mods[4:]  # L2 hints change no result: a cache policy operand, a prefetch size
    policy = "L2::cache_hint" in hints
    sized = len(inst.args) == 4 + policy  # a source size: the bytes past it are zero-filled
    if (kind not in ("ca", "cg") or inst.mods[2:4] != ["shared", "global"] or len(inst.args) != 3 + policy + sized
            or not set(hints) <= {"L2::cache_hint", "L2::64B", "L2::128B", "L2::256B"}):
        raise EmulatorError(f"cp.async form not emulated: {inst.text}")
    if policy:
        m.read(inst.args[-1], "b64")  # (defined, like any operand)
    size = int(inst.args[2])
    dst, _ = m.addr(inst.args[0], "shared")
    src, _ = m.addr(inst.args[1], "global")
    if sized:
        data = _gather_sized(m, inst, src, act, size, m.read(inst.args[3], "u32").astype(np.int64))
    else:
        data = m.mem.gather(src[act], size, inst.text)
    rows, cols = m.shared_idx(dst, size, act, inst)
    m.check_landed(rows, cols, inst)
    m.inflight[rows[:, None], cols] = True
    tids = np.flatnonzero(act)
    m.pending.append((tids, rows, cols, data, m.cp_group[tids].copy()))


def _gather_sized(m, inst: Inst, src: np.ndarray, act: np.ndarray, size: int, n: np.ndarray) -> np.ndarray:
    """The ``size`` bytes each active thread's sized cp.async lands: its first ``n`` source bytes (read
    and checked like any load; none when ``n`` is 0), zeros after them."""
    n = n[act]
    if ((n < 0) | (n > size)).any():
        raise EmulatorError(f"cp.async source size outside 0..{size}: {inst.text}")
    data = np.zeros((int(act.sum()), size), np.uint8)
    for full in np.unique(n[n > 0]):
        sel = n == full
        data[sel, :full] = m.mem.gather(src[act][sel], int(full), inst.text)
    return data


def _cp_bulk(m, inst: Inst, act: np.ndarray) -> None:
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], n, [mbar]``:
    the global bytes are read now (and checked) and land when a thread waits on the barrier; the
    destination may not be touched before (the issuing thread's write, for the race check)."""
    hint = inst.mods[5:] == ["L2::cache_hint"]  # an L2 policy operand after [mbar]: changes no result
    if inst.mods[:5] != ["async", "bulk", "shared::cluster", "global", "mbarrier::complete_tx::bytes"] or \
            inst.mods[5:] not in ([], ["L2::cache_hint"]) or len(inst.args) != 4 + hint:
        raise EmulatorError(f"bulk copy form not emulated: {inst.text}")
    if hint:
        m.read(inst.args[4], "b64")
    size = int(inst.args[2])
    dst, _ = m.addr(inst.args[0], "shared")
    src, _ = m.addr(inst.args[1], "global")
    bar, _ = m.addr(inst.args[3], "shared")
    if size % 16 or (dst[act] % 16).any() or (src[act] % 16).any():
        raise EmulatorError(f"bulk copy not 16-byte granular: {inst.text}")
    data = np.concatenate([m.mem.gather(src[act] + 16 * q, 16, inst.text) for q in range(size // 16)], axis=1)
    _bulk_in_flight(m, inst, act, dst[act], bar[act], data)


def _cp_bulk_tensor(m, inst: Inst, act: np.ndarray) -> None:
    """``cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [tmap, {c0, c1}],
    [mbar]``: the box of the (emulated) tensor map at ``tmap`` is read now (and checked), lands as the map lays it
    out when a thread waits on the barrier, and completes its bytes there. ``.multicast::cluster`` with a last
    operand ``mask``: the box lands at ``dst`` in every CTA of the cluster whose rank has its bit set, completing
    on each one's barrier at ``mbar``."""
    mcast = inst.mods[8:] == ["multicast::cluster"]
    if inst.mods[:7] != ["async", "bulk", "tensor", "2d", "shared::cluster", "global", "tile"] or \
            inst.mods[7:8] != ["mbarrier::complete_tx::bytes"] or inst.mods[8:] not in ([], ["multicast::cluster"]) \
            or len(inst.args) != 3 + mcast:
        raise EmulatorError(f"bulk tensor copy form not emulated: {inst.text}")
    inner = inst.args[1].strip("[]")
    tmap_reg, coords = inner.split(",", 1)
    c0_text, c1_text = (x.strip() for x in coords.strip().strip("{}").split(","))
    dst, _ = m.addr(inst.args[0], "shared")
    bar, _ = m.addr(inst.args[2], "shared")
    where = m.read(tmap_reg.strip(), "u64").astype(np.int64)
    c0, c1 = m.read(c0_text, "s32").astype(np.int64), m.read(c1_text, "s32").astype(np.int64)
    rows = []
    for t_ in np.flatnonzero(act):
        t = tensormap.decode(m.mem.gather(np.array([where[t_]]), 128, inst.text)[0])
        if t.swizzle and dst[t_] % 1024:
            raise EmulatorError(f"a swizzled bulk tensor copy needs a 1024-byte aligned destination: {inst.text}")
        rows.append(tensormap.box(t, lambda a, n: _read16(m, a, n, inst), int(c0[t_]), int(c1[t_])))
    if not rows:
        return
    if len({r.size for r in rows}) != 1:
        raise EmulatorError(f"bulk tensor copies of different sizes in one instruction: {inst.text}")
    if not mcast:
        return _bulk_in_flight(m, inst, act, dst[act], bar[act], np.stack(rows))
    masks = m.read(inst.args[3], "u16").astype(np.int64)
    for i, t_ in enumerate(np.flatnonzero(act)):  # (each issuing thread's box into each CTA of its mask)
        ranks = [r for r in range(16) if masks[t_] >> r & 1]
        if not ranks or ranks[-1] >= m.cluster_x:
            raise EmulatorError(f"multicast mask {int(masks[t_]):#x} outside a cluster of {m.cluster_x}: {inst.text}")
        for r in ranks:
            _bulk_in_flight(m, inst, None, dst[t_:t_ + 1], bar[t_:t_ + 1], rows[i][None, :],
                            blocks=np.array([int(m.cluster_base[t_]) + r]))


def _read16(m, addr: int, nbytes: int, inst: Inst) -> np.ndarray:
    """``nbytes`` global bytes at ``addr`` read as 16-byte pieces (what a bulk copy moves)."""
    if addr % 16 or nbytes % 16:
        raise EmulatorError(f"bulk tensor copy rows not 16-byte granular at {addr:#x}: {inst.text}")
    return m.mem.gather(addr + 16 * np.arange(nbytes // 16), 16, inst.text).reshape(-1)


def _bulk_in_flight(m, inst: Inst, act: np.ndarray | None, a: np.ndarray, bars: np.ndarray, data: np.ndarray,
                    blocks: np.ndarray | None = None) -> None:
    """Record the bulk copies of the threads in ``act`` (shared destinations ``a``, barriers ``bars``, bytes
    ``data`` a thread) as in flight until a wait on their barrier lands them; ``blocks``: into these batch-local
    blocks instead of the threads' own (a multicast, ``act`` None: no race record of a thread)."""
    size = data.shape[1]
    if (a < 0).any() or (a + size > m.smem_size).any():
        raise EmulatorError(f"out-of-bounds bulk copy into shared memory: {inst.text}")
    rows = m.block_of[act] if blocks is None else blocks
    cols = a[:, None] + np.arange(size)[None, :]
    m.check_landed(rows, cols, inst)
    if m.racecheck and act is not None:
        m.race(rows, cols, act, inst, write=True)
    m.inflight[rows[:, None], cols] = True
    for i, (r, b) in enumerate(zip(rows, bars)):
        if (int(r), int(b)) not in m.mbars:
            raise EmulatorError(f"bulk copy completing on an uninitialised mbarrier: {inst.text}")
        m.bulk.append((int(r), int(b), cols[i], data[i]))


@op("mbarrier")
def mbarrier(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``mbarrier.init``, ``mbarrier.arrive.expect_tx`` and ``mbarrier.try_wait.parity`` in shared memory."""
    kind = inst.mods[0]
    tids = np.flatnonzero(act)
    if kind == "init":
        addrs, _ = m.addr(inst.args[0], "shared")
        for t_ in tids:
            m.mbars[(int(m.block_of[t_]), int(addrs[t_]))] = [int(inst.args[1])] * 2 + [0, 0]
        return None
    if kind == "arrive":  # (plain, announcing bulk-copy bytes with expect_tx, or on another CTA's: shared::cluster)
        addrs, _ = m.addr(inst.args[1], "shared")
        tx = m.read(inst.args[2], "u32") if inst.mods[1] == "expect_tx" else np.zeros(m.n, np.uint32)
        remote = "shared::cluster" in inst.mods
        for t_ in tids:
            blk, a = cluster.target(m, t_, int(addrs[t_]), inst) if remote else (int(m.block_of[t_]), int(addrs[t_]))
            b = _bar_state(m, blk, a, inst)
            b[2] += int(tx[t_])
            b[1] -= 1
            _bar_complete(m, b, blk)
        return None
    if kind == "try_wait" and inst.mods[1] == "parity":
        addrs, _ = m.addr(inst.args[1], "shared")
        parity = m.read(inst.args[2], "u32")
        res = np.zeros(m.n, bool)
        for t_ in tids:
            key = (int(m.block_of[t_]), int(addrs[t_]))
            b = _bar_state(m, *key, inst)
            _land_bulk(m, key, b)
            res[t_] = b[3] != (int(parity[t_]) & 1)
        failed = act & ~res
        if failed.any():
            m.waiting = failed if m.waiting is None else m.waiting | failed
        return m.write(inst.args[0], res, act, "pred")
    raise EmulatorError(f"mbarrier form not emulated: {inst.text}")


def _bar_state(m, block: int, addr: int, inst: Inst) -> list:
    b = m.mbars.get((block, addr))
    if b is None:
        raise EmulatorError(f"mbarrier at {addr} used before mbarrier.init: {inst.text}")
    return b

def _bar_complete(m, b: list, block: int) -> None:
    """Complete the barrier's phase once its arrivals and bytes are in. The block's race records are cleared then,
    as at a ``bar.sync``: what its waiters do next is ordered after what its arrivers did before (the records
    cannot tell which threads wait on which barrier, so a race across a phase can go unreported, never a false
    one)."""
    if b[1] < 0:
        raise EmulatorError("an mbarrier got more arrivals in a phase than it expects")
    if b[1] == 0 and b[2] == 0:  # all arrivals and bytes: the phase completes
        b[3] ^= 1
        b[1] = b[0]
        m.phase_ended = True
        if m.racecheck:
            m.writer[block] = -1
            m.reader[block] = -1


def _land_bulk(m, key: tuple, b: list) -> None:
    """Land the bulk copies of barrier ``key``; their bytes complete its transaction count. The
    bytes become clean for the race check (the wait orders them before every waiter's reads)."""
    keep = []
    for blk, bar, cols, data in m.bulk:
        if (blk, bar) != key:
            keep.append((blk, bar, cols, data))
            continue
        m.smem[blk, cols] = data
        m.inflight[blk, cols] = False
        if m.racecheck:
            m.writer[blk, cols] = -1
            m.reader[blk, cols] = -1
        b[2] -= cols.size
    m.bulk = keep
    _bar_complete(m, b, key[0])


def _land(m, inst: Inst, act: np.ndarray, before: np.ndarray | None, clean: bool = False) -> None:
    """Land the pending copies of the threads in ``act`` (those of groups < ``before[thread]``); ``clean``: and
    clear the landed bytes' race records (another thread's synchronisation orders them)."""
    keep = []
    for tids, rows, cols, data, groups in m.pending:
        mine = act[tids]
        if before is not None:
            mine = mine & (groups < before[tids])
        if mine.any():
            who = np.zeros(m.n, bool)
            who[tids[mine]] = True
            m.inflight[rows[mine][:, None], cols[mine]] = False
            if m.racecheck:
                m.race(rows[mine], cols[mine], who, inst, write=True)
                if clean:
                    m.writer[rows[mine][:, None], cols[mine]] = -1
            m.smem[rows[mine][:, None], cols[mine]] = data[mine]
        if (~mine).any():
            keep.append((tids[~mine], rows[~mine], cols[~mine], data[~mine], groups[~mine]))
    m.pending = keep


@op("atom", "red")
def atom(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """Global and shared ``atom`` (returns the old value) and ``red``, applied thread by thread in lane order."""
    space, op, t = inst.mods[0], inst.mods[1], inst.mods[-1]
    if space not in ("global", "shared"):
        raise EmulatorError(f"only global and shared atomics are emulated: {inst.text}")
    ret = inst.op == "atom"
    addr_text = inst.args[1] if ret else inst.args[0]
    addrs, _ = m.addr(addr_text, space)
    vals = m.read(inst.args[2] if ret else inst.args[1], t)
    cmp = m.read(inst.args[3], t) if ret and op == "cas" else None
    nbytes = BITS[t] // 8
    if space == "shared":
        rows, cols = m.shared_idx(addrs, nbytes, act, inst)
        m.check_landed(rows, cols, inst)
        slots = iter(zip(rows, cols))

        def get(a):
            r, c = next(slots)
            return (r, c), m.smem[r, c].copy().view(NP[t])[0]

        def put(where, new):
            m.smem[where[0], where[1]] = np.array([new], NP[t]).view(np.uint8)
    else:
        def get(a):
            a = np.array([a])
            return a, m.mem.gather(a, nbytes, inst.text).view(NP[t])[0, 0]

        def put(where, new):
            m.mem.scatter(where, np.array([new], NP[t]).view(np.uint8).reshape(1, -1), inst.text)
    old_all = np.zeros(m.n, NP[t])
    for i in np.flatnonzero(act):
        where, old = get(addrs[i])
        if op == "add":
            new = old + vals[i]
        elif op == "cas":
            new = vals[i] if old == cmp[i] else old
        elif op == "inc":  # (wraps: old >= b gives 0)
            new = NP[t](0) if old >= vals[i] else old + NP[t](1)
        elif op == "exch":
            new = vals[i]
        elif op == "max":
            new = max(old, vals[i])
        elif op == "min":
            new = min(old, vals[i])
        else:
            raise EmulatorError(f"unsupported atomic {inst.text}")
        put(where, new)
        old_all[i] = old
    if ret:
        m.write(inst.args[0], old_all, act, t)


@op("ld", "st")
def ld_st(m, inst: Inst, act: np.ndarray, mask: np.ndarray) -> None:
    """``ld``/``st`` of param, global and shared memory, scalar or ``.v2``/``.v4``."""
    mods = inst.mods
    space = mods[0]
    t = mods[-1]
    vec = 1
    for m_ in mods:
        if m_ in ("v2", "v4"):
            vec = int(m_[1])
    size = BITS[t] // 8
    if inst.op == "ld":
        dst_text, addr_text = inst.args
        dests = [x.strip() for x in dst_text.strip("{}").split(",")]
        if space == "param":
            base, off = m.addr(addr_text, "param")
            pname = base[len(m.k.name) + len("_param_"):]
            if pname not in m.params:
                raise EmulatorError(f"parameter {pname} was not passed")
            val = np.array([m.params[pname]]).astype(NP[t])
            return m.write(dests[0], np.broadcast_to(val, (m.n,)), act, t)
        addrs, _ = m.addr(addr_text, space)
        nbytes = size * vec
        if space == "global":
            data = m.mem.gather(addrs[act], nbytes, inst.text)
        elif space == "shared":
            rows, cols = m.shared_idx(addrs, nbytes, act, inst)
            m.check_landed(rows, cols, inst)
            if m.racecheck:
                m.race(rows, cols, act, inst, write=False)
            data = m.smem[rows[:, None], cols]
        else:
            raise EmulatorError(f"unsupported space in {inst.text}")
        vals = np.ascontiguousarray(data).view(NP[t]).reshape(-1, vec)
        wt = t
        if BITS[t] == 8:  # ld of an 8-bit type fills a 16-bit register, sign- or zero-extended
            wt = "s16" if t == "s8" else "u16"
            vals = vals.astype(NP[wt])
        for e, dname in enumerate(dests):
            full = np.zeros(m.n, NP[wt])
            full[act] = vals[:, e]
            m.write(dname, full, act, wt)
        return None
    addr_text, src_text = inst.args
    srcs = [x.strip() for x in src_text.strip("{}").split(",")]
    addrs, _ = m.addr(addr_text, space)
    vals = np.stack([np.asarray(m.read(s, t))[act] for s in srcs], axis=1).astype(NP[t])
    data = np.ascontiguousarray(vals).view(np.uint8).reshape(vals.shape[0], -1)
    if space == "global":
        m.mem.scatter(addrs[act], data, inst.text)
    elif space == "shared":
        rows, cols = m.shared_idx(addrs, data.shape[1], act, inst)
        m.check_landed(rows, cols, inst)
        if m.racecheck:
            m.race(rows, cols, act, inst, write=True)
        m.smem[rows[:, None], cols] = data
    else:
        raise EmulatorError(f"unsupported space in {inst.text}")

