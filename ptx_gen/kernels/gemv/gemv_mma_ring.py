"""The tensor-core GEMV's warps and their rings of weight stages (:mod:`ptx_gen.kernels.gemv.gemv_mma`).

:class:`Warp` holds what the phases of a warp share; :func:`setup_warp` emits its coordinates and
addresses. :func:`weight_copies` emits the copies of a weight unit into a ring slot, one of four ways
(bulk copies on sm_90, ``cp.async`` of a tile-major stage, of Q6_K's unaligned units, or of GGUF
rows); :func:`fill_ring` requests the first ``stages`` units before the grid wait, and
:func:`unit_step` is the ring's part of every step over a unit, in both the one-column and the
columns kernel (:mod:`ptx_gen.kernels.gemv.gemv_mma_cols`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.gemv.gemv_mma_layout import BLOCK32, Q6K_CHUNKS, TILE_ROWS, stage_bytes
from ptx_gen.kernels.gemv.gemv_mma_units import div_by, mod_by


@dataclass
class Warp:
    """What the phases of the tensor-core GEMV's :func:`~ptx_gen.kernels.gemv.gemv_mma.build` share: the
    builder, the shape, and the registers that :func:`setup_warp` sets up for the warp."""
    k: KernelBuilder
    lay: dict
    wtype: str
    kparts: int
    stages: int
    tiles: int
    bulk: bool
    glu: bool
    tiled: bool
    out_dim: Reg
    lane: Reg
    warp: Reg
    row_base: Reg  # the warp's first output
    kp: Reg | None  # the warp's K part (None: one part)
    last: Reg  # out_dim - 1
    smem: Reg | None = None
    ring: Reg | None = None  # the warp's ring of ``stages`` weight stages
    w: Reg | None = None  # the weights
    wbase: Reg | None = None
    wpol: Reg | None = None  # the weights' L2 policy (evict first)
    tile0: Reg | None = None  # tile-major: the warp's tile
    n: Reg | int = 0  # the warp's units (a register where kparts does not divide the units)
    late: bool = False  # the next kernel's launch triggered when the warp has issued its last copy
    ahead: int = 0  # ring stages requested before the grid wait (0: all), the others after x's first loads
    deferred: list = field(default_factory=list)  # (those others' copies, emitted after x's first loads)
    l2pre: int = 0  # tile-major, sm_90: the warp's units past the ring asked of the L2 before the grid wait

    @property
    def U(self) -> int:  # bytes between two staged rows in shared memory
        return self.lay["stride"]

    @property
    def G(self) -> int:  # a row's bytes of a unit in W (U less ROW_PAD)
        return self.lay["unit"]

    @property
    def R(self) -> int:  # rows per warp
        return self.lay["rows"]

    @property
    def n_units(self) -> int:  # units per warp, at most (see ``n``)
        return self.lay["per_warp"]

    @property
    def n_min(self) -> int:  # units every warp has
        return self.lay["per_warp_min"]

    def has(self, j: Reg | int) -> Reg | None:
        """Whether the warp has a j-th unit (None: statically true; j an int below ``n_min``)."""
        if isinstance(j, int) and j < self.n_min:
            return None
        return self.k.setp("lt", j, self.n)

    @property
    def stage_bytes(self) -> int:
        return stage_bytes(self.R, self.U, self.G, self.tiled)

    @property
    def hints(self) -> dict:
        return dict(prefetch="128B", policy=self.wpol)

    def weight_row(self, r: Reg) -> Reg:
        """The weight row of the warp's row ``r`` (rows past the end re-read the last one, not stored);
        with ``glu`` rows 0..15 are gate rows and 16..31 the up rows of the same outputs."""
        k = self.k
        if not self.glu:
            return k.min(k.add(self.row_base, r), self.last)
        o = k.min(k.add(self.row_base, k.and_(r, 15)), self.last)
        return k.mad(k.shr(r, 4), self.out_dim, o)

    def unit_of(self, j: Reg | int) -> Reg | int:
        """The row's unit index of the warp's j-th unit."""
        k, kp0 = self.k, self.kp if self.kp is not None else 0
        if isinstance(j, int) and self.kp is None:
            return j * self.kparts
        return k.mad(j, self.kparts, kp0) if isinstance(j, Reg) else k.add(kp0, j * self.kparts)

    def tile_src(self, j: Reg | int) -> Reg:
        """Tile-major: the address of the warp's stage of its j-th unit."""
        k, u = self.k, self.unit_of(j)
        return k.add(self.tile0, k.mul_wide(u, TILE_ROWS * self.G) if isinstance(u, Reg) else u * TILE_ROWS * self.G)


def first_output(k: KernelBuilder, warp: Reg, mtiles: int, outs: int) -> Reg:
    """The first output of ``warp``: warps mt = warp % mtiles of a CTA take ``outs`` outputs each."""
    group = k.add(k.mul(k.ctaid(), mtiles), k.rem(warp, mtiles)) if mtiles > 1 else k.ctaid()
    return k.mul(group, outs)


def setup_warp(k: KernelBuilder, lay: dict, wtype: str, mtiles: int, kparts: int, stages: int, tiles: int,
              bulk: bool, glu: bool, tiled: bool) -> Warp:
    """Emits the warp's coordinates (lane, warp, first output, K part), its ring's address in shared
    memory, the weights' pointer and L2 policy, and (tile-major) the address of its tile: everything
    the copies and the unit loop address from."""
    out_dim = k.param("out_dim")
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    row_base = first_output(k, warp, mtiles, 16 if glu else lay["rows"])
    kp = k.div(warp, mtiles) if kparts > 1 else None
    last = k.sub(out_dim, 1)
    s = Warp(k, lay, wtype, kparts, stages, tiles, bulk, glu, tiled, out_dim, lane, warp, row_base, kp, last)
    # the warp's units kp, kp + kparts, ... below the row's units: where kparts does not divide them, the
    # first parts take one more
    s.n = lay["per_warp"] if lay["per_warp"] == lay["per_warp_min"] else \
        div_by(k, k.sub(lay["units"] + kparts - 1, kp), kparts)
    R, G = s.R, s.G
    s.smem = k.dynamic_shared()
    s.ring = k.add(s.smem, k.add(k.mul(warp, stages * s.stage_bytes), lay["off"]["ring"]))
    s.w = w = k.global_ptr("w")
    # the weights' copies: each miss fetches the whole 128-byte line (a staged row of a unit is 144-240
    # bytes at any offset, and the K parts of a tile read the neighbouring units soon after), and the
    # bytes, read once, are evicted first, so that they leave L2 to x and the outputs (128 bytes: the
    # line; tile-major bulk copies take the same policy)
    s.wpol = k.create_policy("evict_first") if not bulk or tiled else None
    k.global_ptr("y")
    # the warp's units of a row are kp, kp + kparts, kp + 2 kparts, ...: at any time the K parts of a
    # tile read neighbouring units, i.e. kparts * U contiguous bytes of each row
    s.wbase = w if kp is None or wtype == "Q6_K" else k.add(w, k.mul_wide(kp, G))
    if tiled:
        # W tile-major (tile_major): the warp's R rows of unit u are R U contiguous bytes of tile T, the
        # tile of its first row (glu: of its first output, 16 a tile). Stored like that, each stage is one
        # stream of bytes, and the launch reads whole tiles side by side (on GGUF rows a stage is R
        # pieces of U bytes, a row apart)
        # (warps whose rows all lie past out_dim read the last rows instead, and store nothing)
        rt = 16 if glu else R
        first = k.min(row_base, k.and_(last, (0xFFFFFFFF // rt) * rt))
        s.tile0 = k.add(w, k.mul_wide(k.mul(k.shr(first, 4 if glu else 5), lay["units"]), TILE_ROWS * G))
        if not glu and R < TILE_ROWS:  # 16-row warps: the second half of a tile starts 16 G in
            s.tile0 = k.add(s.tile0, k.cvt(k.mul(k.and_(first, TILE_ROWS - 1), G), "u64"))
    return s


def weight_copies(s: Warp):
    """Emits the per-lane setup of the weights' copies and returns ``(issue, wait)``:
    ``issue(j, slot_off, valid)`` emits the copies of the warp's j-th unit into the ring slot at
    ``slot_off``, ``wait(j)`` waits until unit j's stage has landed. Four ways: bulk copies (sm_90),
    cp.async of a tile-major stage, of Q6_K's unaligned units, or of GGUF rows."""
    k, stages = s.k, s.stages
    if s.bulk:
        return _bulk_copies(s)
    if s.tiled:
        issue = _tiled_copies(s)
    elif s.wtype == "Q6_K":
        issue = _q6k_copies(s)
    elif s.wtype in BLOCK32:
        issue = _b32_row_copies(s)
    else:
        issue = _row_copies(s)

    def wait(j: Reg) -> None:  # (cp.async groups: the oldest of the stages in flight has landed)
        k.cp_async_wait_group(stages - 1)
        k.bar_warp_sync()
    return issue, wait


def _bulk_copies(s: Warp):
    """sm_90 ``bulk``: emits the ring's mbarriers (one a slot, initialised by lane 0) and the lanes'
    row addresses; returns ``(issue, wait)`` for bulk copies. Lane r < R copies row r's U bytes of a
    unit with one bulk copy (the tensor memory accelerator: no per-16-byte instructions, no load-store
    queue), or (tile-major) lane 0 the whole stage; lane 0 announces the stage's bytes to the slot's
    mbarrier, whose phase completes when they have all landed. Copies of 144-272 bytes are small for
    it: it pays where a warp has only a unit or two to stream, not on long rows, so the launch policy
    picks it by shape."""
    k, lane, U, G, R, stages, kparts = s.k, s.lane, s.U, s.G, s.R, s.stages, s.kparts
    mbar = k.add(s.smem, k.add(k.mul(s.warp, 8 * stages), s.lay["off"]["mbar"]))
    lane0 = k.setp("eq", lane, 0)
    for i in range(stages):
        k.mbarrier_init(k.add(mbar, 8 * i) if i else mbar, 1, pred=lane0)
    k.fence_mbarrier_init()
    k.bar_warp_sync()
    row_lane = k.setp("lt", lane, R)
    if not s.tiled:
        src_lane = k.add(s.wbase, k.mul_wide(s.weight_row(lane), s.lay["row_bytes"]))
        dst_lane = k.add(s.ring, k.mul(lane, U))

    def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
        slot = mod_by(k, j, stages) if isinstance(j, Reg) else j % stages
        mb = k.add(mbar, k.shl(slot, 3)) if isinstance(slot, Reg) else k.add(mbar, 8 * slot)
        k.mbarrier_expect_tx(mb, R * G, pred=k.both(lane0, valid))
        if s.tiled:  # the whole stage, one copy
            k.cp_async_bulk(k.add(s.ring, slot_off) if isinstance(slot_off, Reg) or slot_off else s.ring,
                            s.tile_src(j), s.stage_bytes, mb, pred=k.both(lane0, valid), policy=s.wpol)
            return
        dst = k.add(dst_lane, slot_off) if isinstance(slot_off, Reg) or slot_off else dst_lane
        src = k.add(src_lane, k.mul_wide(j, G * kparts) if isinstance(j, Reg) else j * G * kparts)
        k.cp_async_bulk(dst, src, G, mb, pred=k.both(row_lane, valid))

    def wait(j: Reg) -> None:
        slot = mod_by(k, j, stages)
        k.mbarrier_wait(k.add(mbar, k.shl(slot, 3)), k.and_(div_by(k, j, stages), 1))  # the slot's use count
        k.bar_warp_sync()  # (the x slot the warp's lanes wrote last step)
    return issue, wait


def _tiled_copies(s: Warp):
    """Tile-major cp.async: emits the lanes' chunk offsets and returns ``issue``. 16-byte chunk
    c = lane + 32 q of the stage goes from the tile's bytes to the same offset in the ring."""
    k, lane = s.k, s.lane
    nchunks = s.stage_bytes // 16
    lane16w = k.cvt(k.shl(lane, 4), "u64")
    dst0 = k.add(s.ring, k.shl(lane, 4))
    oks = [k.setp("lt", k.add(lane, 32 * q), nchunks) if (q + 1) * 32 > nchunks else None
           for q in range(-(-nchunks // 32))]

    def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
        src = k.add(s.tile_src(j), lane16w)
        dst = k.add(dst0, slot_off) if isinstance(slot_off, Reg) or slot_off else dst0
        for q, ok in enumerate(oks):
            k.cp_async(dst, src, pred=k.both(ok, valid), dst_offset=512 * q, src_offset=512 * q, **s.hints)
        k.cp_async_commit()
    return issue


def _b32_row_copies(s: Warp):
    """The 32-value block types on GGUF rows (LayerOps stores them tile-major for this kernel, but a
    tied output projection keeps the embedding's rows): chunk c = lane + 32 q of a unit is row
    c / (G / 16), col c % (G / 16), as :func:`_row_copies` reads it (consecutive lanes, consecutive
    chunks of a row), landing at 16 c (+ 16 (c / (G / 16)) past each padded row, see ``ROW_PAD``).
    The source offsets are kept as 32-bit offsets from the warp's first row (64-bit ones, one per 32
    chunks, crowded out these types' registers), the padded destinations two to a register."""
    k, lane, G, U = s.k, s.lane, s.G, s.U
    cpr = G // 16
    nchunks = s.R * cpr
    nq = -(-nchunks // 32)
    offs, dsts, oks = [], [], []
    for q in range(nq):
        c = k.add(lane, 32 * q) if q else lane
        row = k.div(c, cpr)
        col16 = k.shl(k.sub(c, k.mul(row, cpr)), 4)
        off = k.add(k.mul(k.sub(s.weight_row(row), s.row_base), s.lay["row_bytes"]), col16)  # may be < 0: s32
        offs.append(k.bitcast(off, "s32"))
        if U != G:
            dsts.append(k.shl(k.add(c, row), 4))
        oks.append(k.setp("lt", c, nchunks) if (q + 1) * 32 > nchunks else None)
    packed = [k.or_(dsts[q], k.shl(dsts[q + 1], 16)) if q + 1 < nq else dsts[q] for q in range(0, len(dsts), 2)]
    wrow = k.add(s.w, k.mul_wide(s.row_base, s.lay["row_bytes"]))
    dst0 = k.add(s.ring, k.shl(lane, 4))

    def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
        u = s.unit_of(j)
        base = k.add(wrow, k.mul_wide(u, G) if isinstance(u, Reg) else u * G)
        moved = isinstance(slot_off, Reg) or slot_off
        ring = (k.add(s.ring, slot_off) if moved else s.ring) if U != G else None
        plain = (k.add(dst0, slot_off) if moved else dst0) if U == G else None
        for q, (off, ok) in enumerate(zip(offs, oks)):
            src = k.add(base, k.cvt(off, "s64"))
            if U == G:
                k.cp_async(plain, src, pred=k.both(ok, valid), dst_offset=512 * q, **s.hints)
                continue
            word = packed[q // 2]
            d = k.shr(word, 16) if q % 2 else k.and_(word, 0xFFFF) if q + 1 < nq else word
            k.cp_async(k.add(ring, d), src, pred=k.both(ok, valid), **s.hints)
        k.cp_async_commit()
    return issue


def _q6k_copies(s: Warp):
    """Q6_K on GGUF rows: emits the lanes' chunk offsets and ring addresses, returns ``issue``.

    Unit u of a row is 210 u.. (phase p = 210 u % 16 = 2 (u % 8), the same for all rows as rows are
    16-byte multiples): the 14 chunks from 210 u - p, chunk c = lane + 32 q of the unit being row
    c / 14, col c % 14, at row * 240 + 16 col in the ring. The last unit of a row has p = 14, so its
    chunks end exactly at the row's end: nothing past the tensor is read. Each copy instruction
    covers few, contiguous rows (consecutive lanes take consecutive chunks of one row).
    The chunks' offsets are kept as 32-bit offsets from the warp's first row (3 registers per
    copy otherwise: 178 registers at 32 rows, spills on sm_80): < 32 row_bytes, or with glu up
    to (out_dim + 16) row_bytes: see q6k_glu_offsets_fit."""
    k, lane, U = s.k, s.lane, s.U
    nchunks = s.R * Q6K_CHUNKS
    chunks = []
    for q in range(-(-nchunks // 32)):
        c = k.add(lane, 32 * q) if q else lane
        row = k.div(c, Q6K_CHUNKS)
        col16 = k.shl(k.sub(c, k.mul(row, Q6K_CHUNKS)), 4)
        off = k.add(k.mul(k.sub(s.weight_row(row), s.row_base), s.lay["row_bytes"]), col16)  # may be < 0: s32
        chunks.append((k.bitcast(off, "s32"), k.add(s.ring, k.add(k.mul(row, U), col16)),
                       k.setp("lt", c, nchunks) if (q + 1) * 32 > nchunks else None))
    wrow = k.add(s.w, k.mul_wide(s.row_base, s.lay["row_bytes"]))

    def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
        u = s.unit_of(j)
        u = u if isinstance(u, Reg) else k.mov(u, "u32")
        base = k.add(wrow, k.cvt(k.sub(k.mul(u, 210), k.shl(k.and_(u, 7), 1)), "u64"))
        for off, dst, ok in chunks:
            pred = k.both(ok, valid)
            k.cp_async(k.add(dst, slot_off) if isinstance(slot_off, Reg) or slot_off else dst,
                       k.add(base, k.cvt(off, "s64")), pred=pred, **s.hints)
        k.cp_async_commit()
    return issue


def _row_copies(s: Warp):
    """Q4_K / Q8_0 on GGUF rows: emits the lanes' source offsets, returns ``issue``. 16-byte chunk
    c = lane + 32 q of a unit is row c / (U / 16), col c % (U / 16), copied with cp.async; in the ring
    it lands at 16 c (rows of U bytes, back to back)."""
    k, lane, U, kparts = s.k, s.lane, s.U, s.kparts
    cpr = U // 16
    nchunks = s.R * cpr
    srcs = []
    for q in range(-(-nchunks // 32)):
        c = k.add(lane, 32 * q) if q else lane
        row = k.div(c, cpr)
        off = k.add(k.mul_wide(s.weight_row(row), s.lay["row_bytes"]), k.cvt(k.shl(k.sub(c, k.mul(row, cpr)), 4), "u64"))
        srcs.append((off, k.setp("lt", c, nchunks) if (q + 1) * 32 > nchunks else None))
    dst0 = k.add(s.ring, k.shl(lane, 4))

    def issue(j: Reg | int, slot_off: Reg | int, valid: Reg | None) -> None:
        base = k.add(s.wbase, k.mul_wide(j, U * kparts) if isinstance(j, Reg) else j * U * kparts)
        dst = k.add(dst0, slot_off) if isinstance(slot_off, Reg) or slot_off else dst0
        for q, (off, ok) in enumerate(srcs):
            pred = k.both(ok, valid)
            k.cp_async(dst, k.add(base, off), pred=pred, dst_offset=512 * q, **s.hints)
        k.cp_async_commit()
    return issue


def fill_ring(s: Warp, issue) -> None:
    """Emits the copies of the warp's first ``stages`` units, then ``griddepcontrol.wait``: they are
    weights (no kernel writes them), so under programmatic dependent launch they stream in while the
    previous kernel ends. Empty cp.async groups keep the group count uniform past the last unit.

    With ``ahead``, only the first ``ahead`` stages come before the wait; the others are kept in
    ``s.deferred`` (in order, cp.async groups included) for the kernel to emit right after x's
    first loads. x is read after the wait, and its loads queue behind every weight byte the SM asked for
    before them: a full ring (e.g. 147 KB an SM for 16 warps of 2 x 4.6 KB) holds them back until those
    bytes have landed, and meanwhile no unit can start and so no stage is refilled."""
    k = s.k
    for j in range(s.stages):
        if j < s.n_units:
            copy = (lambda j=j: issue(j, j * s.stage_bytes, s.has(j)))
        elif not s.bulk:
            copy = k.cp_async_commit
        else:
            continue
        if s.ahead and j >= s.ahead:
            s.deferred.append(copy)
        else:
            copy()
    for j in range(s.stages, min(s.stages + s.l2pre, s.n_units)):  # (one stage of R U contiguous bytes each)
        with k.if_(k.both(k.setp("eq", s.lane, 0), s.has(j))):
            k.prefetch_l2(s.tile_src(j), s.stage_bytes)
    k.grid_dependency_wait()


def unit_step(s: Warp, j: Reg, wait, issue, slots, body) -> None:
    """The ring's part of a step over unit j, shared by both kernels: wait for the unit's stage, run
    ``body(j, stage, slots(j))`` on it (``slots``: the unit's x slot, or one a column), then, every lane
    done with the ring slot and the x slots, refill the slot with unit j + stages (and, ``late``, trigger
    the next kernel's launch at the warp's last copy; warps with fewer units than stages trigger by
    exiting)."""
    k = s.k
    slot_off = k.mul(mod_by(k, j, s.stages), s.stage_bytes)
    sbase = k.add(s.ring, slot_off)
    xslots = slots(j)
    wait(j)
    body(j, sbase, xslots)
    k.bar_warp_sync()
    if s.bulk:
        k.fence_proxy_async()  # (the reads above come before the bulk copy's writes)
    nxt = k.add(j, s.stages)
    issue(nxt, slot_off, s.has(nxt))
    if s.late:
        k.launch_dependents(k.setp("eq", nxt, s.n))
