"""Batch GEMM straight from the quantized weights on Hopper's warpgroup MMA, warp-specialized:
``Y[M, N] = X[M, K] W^T`` for the batched decode step and prefill chunks, W the GGUF weight exactly as the
decode GEMV stores it (GGUF rows, "tiles" or "glu-tiles"), X f16 row-major (row stride ``lda``), f32
accumulation on ``wgmma.mma_async`` m64nNk16 f16 with both operands in shared memory (sm_90a). No f16 copy of
W exists: a weight byte is read from DRAM once per token tile and decoded into a shared-memory stage.

**Roles.** A CTA owns ``64 rgroups`` weight rows and ``mt`` tokens. Its first ``rgroups`` warpgroups are
*consumers*: warpgroup ``g`` issues the MMAs of rows ``64 g ..`` over all ``mt`` tokens, and the consumers copy the
tokens' X into the stages' B tiles (16-byte ``cp.async``). The next ``rgroups`` warpgroups (one for two consumers
of 256 tokens, :func:`producer_groups`) are *producers*: producer warp ``p`` streams the 16-row strips ``p``
(rows ``16 p ..`` of the CTA's weight) and, with one producer warpgroup for two consumers, ``p + 4``, each through
its own ``cp.async`` ring of chunks (256 values, :class:`~ptx_gen.kernels.gemm.qstream.WeightStream`, the copy plan and
block decoders ``gemm_q`` and ``gemm_wg`` use, so the MMA multiplies exactly the f16 weights ``dequant_f16`` would
write), decodes them and stores the f16 values into the stage's A tile (strip row ``r`` at A row ``4 (r % 2) +
r / 2`` of its 8, so that a quarter warp's stores meet no bank conflict; the epilogue maps the rows back).

**Stages.** A stage is 64 k: the A tile (``64 rgroups`` rows x 128 bytes) and the B tile (``mt`` tokens x
128 bytes), both K-major in the 128-byte swizzle (row ``n`` at ``128 n``, its 16-byte piece ``p`` = k ``8 p ..
8 p + 7`` at ``(p ^ n % 8) * 16``; descriptor stride 1024 bytes per 8 rows), ``stages`` of them in a ring.
Two mbarriers a stage: *full* (every consumer thread once its X copies have landed, ``cp.async.mbarrier.arrive``;
every producer thread after its A stores and ``fence.proxy.async``) and *empty* (every consumer
thread, once ``wgmma.wait_group`` says the MMAs that read the stage are done; the consumers then copy the X of
the stage that takes the slot next). The consumers keep one stage's MMAs in flight while they wait for the next;
the producers run up to ``stages`` stages ahead of them.

**Edges.** Tokens past M are not copied (their B rows hold stale values; their outputs are never written); rows
past N are not copied (their outputs are never written). K must be a multiple of 256 (whole chunks). Epilogue
(consumers, per output ``Y[t, c]``, f32 or f16 with ``out_f16``, row stride ``ldy``): ``+ bias[c]``,
``+ residual[t, c]`` (may be Y itself); ``glu``: W is [gate; up] and ``Y[t, j] = silu(gate) * up`` (a producer
warp's rows 0-7 gate, 8-15 up); through shared memory, so that Y is written a row of the tile at a time
(:mod:`ptx_gen.kernels.gemm.staged_epilogue`).

**X by a tensor map** (``xtma``): consumer thread 0 copies each stage's X with one ``cp.async.bulk.tensor`` (the
tensor map ``xmap``, passed by value: X as m rows of K f16 values ``lda`` apart, boxes of 64 x ``mt`` landing in the
128-byte swizzle; tokens past m land as zeros) after announcing its bytes on the full barrier, instead of every
consumer thread copying 16-byte pieces through the load/store unit.

**K split over CTAs** (``kparts`` 2 or 4, grid z): CTA z multiplies chunks ``z K / (256 kparts) ..`` (its share of
K's chunks), writes its accumulators to ``part`` (``meta["part_floats"]`` floats an output tile), and the last of them
to count itself at the tile's ``counters`` entry (u32, zero before the launch and left at zero) sums the parts and runs
the epilogue: with two, the other's floats added to its own (the sum of two addends does not depend on which CTA comes
last); with four, all four read back and added in the order of z (the same bits whichever CTA comes last). With two
consumer warpgroups a CTA it keeps the CTA count of one warpgroup without the split (o and down, 4096 outputs, at a few
hundred tokens: 128 CTAs), each CTA reading half of X for twice the rows.

**Stream-K** (``streamk``, with ``xtma``, K whole, no multicast or producer split): the launch's T = tiles x chunks of
K taken as one sequence, CTA b of the G launched (at most the tiles) multiplies chunks ``b T / G .. (b + 1) T / G``
tile by tile, a *unit* per tile (:class:`~ptx_gen.kernels.gemm.gemm_ws_parts.StreamUnits`); a CTA's range is at least
a tile long, so a tile is one CTA's or split between two, whose parts are summed as a K split in two (``part``,
``counters``, part 0 the one starting at chunk 0). Both roles walk the same units in one loop and meet at one CTA
barrier after each, so that the next unit's stages take the shared memory only once the epilogue is done with it;
the ring's position goes on over the units.

**X multicast** (``xcast`` 2, with ``xtma``): the grid runs as clusters of two CTAs along the weight rows
(``.reqnctapercluster``; the host pads the row tiles to whole pairs), which share every token tile: thread 0 of rank
``r`` copies tokens ``r mt / 2 ..`` of each stage's box into both CTAs' B tiles (``.multicast::cluster``) and announces
the whole box's bytes on its own full barrier, which both halves complete. Before it copies into a slot again, it
waits for its own consumers' release of the slot (the empty barrier) and then for the other CTA's: each thread 0
arrives on its own and the other's cluster-release barrier of the slot (two arrivals a phase) and waits on its own.
Both CTAs meet at a cluster barrier after the mbarriers' initialisation and before leaving (a K split's CTAs that do
not sum branch there instead of returning). A token tile's X then leaves L2 once for two weight tiles.

**f16 decoding** (``f16dec``, Q4_K): the producers decode in f16x2 arithmetic (``qstream._decode_q4k_f16x2``: ``d sc``
and ``-dmin mn`` rounded to f16 first, one FMA for two values) instead of in f32 with one rounding: fewer decode
instructions, each weight within about an f16 rounding of the exact decode's terms.

**Producer splits and fence groups** (``psplit``, ``pfence``): ``psplit`` producer warpgroups a strip, each streaming
the whole of K and filling the stages ``h`` of a chunk with ``h % psplit`` its own; ``pfence`` stages a producer stores
before one ``fence.proxy.async`` and its arrivals on them.

**Ablations** (``ablate``, diagnostic launches only: their results are meaningless): ``wload`` the producers copy no
weights, ``decode`` they store zeros instead of decoding, ``mma`` the consumers issue no MMAs, ``xload`` no X is
copied, ``fence`` the producers skip ``fence.proxy.async``, ``xwait`` the X copy's thread skips its wait for the slot's
release (X by a tensor map), ``epilogue`` no outputs are written (the epilogue behind a test no launch passes, so
that ptxas keeps the MMAs); every other barrier and the rest of the work stay, so the time left out says what that part costs
(``tools/bench_gemm_wg.py --ablate``).

Params: w, x, y, [bias], [residual], m (tokens), n (weight rows), lda, ldy, [part, counters], [xmap]. Requirements:
X 16-byte aligned, ``lda`` a multiple of 8, the weight's bytes below 2**32. Launch: grid (ceil(rows_out /
meta["rows_per_cta"]), ceil(m / mt), kparts), block meta["block"], dynamic shared memory meta["dyn_smem"]. Tested on the GPU and in the
emulator (``tests/test_gemm_ws_ptx.py``).
"""

from __future__ import annotations

import contextlib
import types

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.operands import TENSOR_MAP
from ptx_gen.catalog import kernel
from ptx_gen.kernels.dequant.dequant import check_weight_layout
from ptx_gen.kernels.gemm.signature import epilogue_signature
from ptx_gen.kernels.gemm.gemm_ws_grid import grid
from ptx_gen.kernels.gemm.qstream import CHUNK, WeightStream, seg_bytes, warp_bytes
from ptx_gen.kernels.gemm.gemm_ws_parts import (RingPosition, StreamUnits, cluster_release, sum_parts, x_by_cp_async,
                                                x_by_tensor_map)
from ptx_gen.kernels.gemm.staged_epilogue import stage_bytes, staged_epilogue, tile_cols

__all__ = ["WS_MTS", "check_shape", "gemm_ws", "part_floats", "smem_bytes", "threads"]

WS_MTS = (64, 128, 256)
WS_STAGES = (2, 3, 4, 5, 6, 7, 8)
WS_WSTAGES = (2, 3, 4)
WS_KPARTS = (1, 2, 4)
WS_PSPLIT = (1, 2, 4)
WS_PFENCE = (1, 2, 4)
WS_XCAST = (1, 2)
# (diagnostic launches: the work left out, the results meaningless)
ABLATIONS = ("wload", "decode", "mma", "xload", "fence", "xwait", "epilogue")
CONSUMER_REGS = 30  # registers a consumer thread needs beside its accumulators (descriptors, barriers, epilogue)
FULL, EMPTY, RELEASE = 0, 1, 2  # a stage's mbarriers: its tiles landed, its slot freed, the cluster's release (xcast)
MAX_DYN_SMEM = 227 * 1024
SK = 64  # k values of a stage (one 128-byte swizzle row)
ALIGN = 1024  # the swizzle pattern repeats every 8 rows of 128 bytes: tiles start 1024-aligned
DESC_FIXED = (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)  # leading offset 1 (unused), 1024 bytes per 8 rows, 128B swizzle


def producer_groups(mt: int, rgroups: int) -> int:
    """Producer warpgroups: one a consumer warpgroup, except for two consumers of 256 tokens (each holding 128
    accumulators a thread): one, whose warps then stream two 16-row strips each, so that the CTA's 384 threads
    have the registers."""
    return 1 if mt == 256 else rgroups


def threads(mt: int, rgroups: int, psplit: int = 1) -> int:
    """A CTA's threads: its consumer warpgroups and ``psplit`` times its producer warpgroups."""
    return 128 * (rgroups + producer_groups(mt, rgroups) * psplit)


def consumers_fit(mt: int, rgroups: int, psplit: int = 1) -> bool:
    """Whether a consumer thread keeps its ``mt / 2`` accumulators and :data:`CONSUMER_REGS` more registers when the
    CTA's threads share an SM's 64K registers."""
    return 65536 // threads(mt, rgroups, psplit) // 8 * 8 >= mt // 2 + CONSUMER_REGS


def part_floats(mt: int, rgroups: int, kparts: int) -> int:
    """The partial sums an output tile of a launch splitting K over ``kparts`` CTAs writes (``part``)."""
    return 0 if kparts == 1 else kparts * 128 * rgroups * mt // 2


def a_bytes(rgroups: int) -> int:
    return 64 * rgroups * 2 * SK


def x_bytes(mt: int) -> int:
    return mt * 2 * SK


def tiles_bytes(mt: int, rgroups: int, stages: int) -> int:
    """The stages' A and B tiles, which the epilogue's staged output tile takes over (as large, if that is larger)."""
    return max(stages * (a_bytes(rgroups) + x_bytes(mt)), stage_bytes(mt, rgroups))


def smem_bytes(wtype: str, in_dim: int, layout: str, mt: int, rgroups: int, stages: int, wstages: int,
               psplit: int = 1, xcast: int = 1) -> int:
    """Alignment slack, the stages' A and B tiles (or the epilogue's output tile), every producer warp's weight stream,
    two mbarriers a stage (three with X multicast: the cluster's release of the slot)."""
    return (ALIGN + tiles_bytes(mt, rgroups, stages)
            + 4 * rgroups * psplit * warp_bytes(wtype, in_dim, layout, wstages) + (24 if xcast > 1 else 16) * stages)


def check_shape(wtype: str, in_dim: int, layout: str, mt: int, rgroups: int, stages: int, wstages: int,
                kparts: int = 1, psplit: int = 1, pfence: int = 1, xcast: int = 1, xtma: bool = True,
                streamk: bool = False) -> None:
    check_weight_layout(wtype, in_dim, layout)
    if wtype == "F32":
        raise ValueError("gemm_ws takes the quantized and 16-bit weight types, not F32")
    if mt not in WS_MTS:
        raise ValueError(f"mt (tokens per CTA) must be one of {WS_MTS}, got {mt}")
    if rgroups not in (1, 2):
        raise ValueError(f"rgroups (consumer warpgroups) must be 1 or 2, got {rgroups}")
    if stages not in WS_STAGES:
        raise ValueError(f"stages must be one of {WS_STAGES}, got {stages}")
    if wstages not in WS_WSTAGES:
        raise ValueError(f"wstages (weight chunks in a producer warp's ring) must be one of {WS_WSTAGES}, got {wstages}")
    if in_dim % CHUNK:
        raise ValueError(f"gemm_ws needs K a multiple of {CHUNK}, got {in_dim}")
    if kparts not in WS_KPARTS or (in_dim // CHUNK) % kparts:
        raise ValueError(f"kparts (CTAs splitting K) must be one of {WS_KPARTS} and divide the {in_dim // CHUNK} chunks "
                         f"of K, got {kparts}")
    regs = 65536 // threads(mt, rgroups, psplit) // 8 * 8  # (a thread's registers with the CTA alone on an SM)
    if psplit not in WS_PSPLIT or psplit > stages or not consumers_fit(mt, rgroups, psplit):
        raise ValueError(f"psplit (producer warpgroups sharing a strip's stages) must be one of {WS_PSPLIT}, at most the "
                         f"{stages} stages (a warp's empty-barrier wait at stage s must follow its wait for stage "
                         f"s - stages: its parity names a phase only within one phase of the barrier's) and leave a "
                         f"consumer thread its {mt // 2} accumulators and {CONSUMER_REGS} registers more, got {psplit} "
                         f"({threads(mt, rgroups, psplit)} threads at mt={mt} rgroups={rgroups}: {regs} registers)")
    if pfence not in WS_PFENCE or (pfence > 1 and (pfence >= stages or psplit > 1)):
        raise ValueError(f"pfence (stages a producer fences and announces together) must be one of {WS_PFENCE}, below "
                         f"the {stages} stages (the consumers free a slot once they hold the stage after it: a producer "
                         f"holding that one too would wait on itself) and 1 with psplit, got {pfence} (psplit {psplit})")
    if xcast not in WS_XCAST or (xcast > 1 and not xtma):
        raise ValueError(f"xcast (CTAs of a cluster sharing X by multicast) must be one of {WS_XCAST}, and 1 without X "
                         f"by a tensor map, got {xcast} (xtma {xtma})")
    if streamk and (kparts > 1 or psplit > 1 or xcast > 1 or not xtma):
        raise ValueError(f"streamk (the tiles' chunks of K shared out over the CTAs) takes X by a tensor map, no K "
                         f"split over grid z, no producer split and no multicast, got xtma {xtma}, kparts {kparts}, "
                         f"psplit {psplit}, xcast {xcast}")
    smem = smem_bytes(wtype, in_dim, layout, mt, rgroups, stages, wstages, psplit, xcast)
    if smem > MAX_DYN_SMEM:
        raise ValueError(f"{wtype} mt={mt} rgroups={rgroups} stages={stages} wstages={wstages} psplit={psplit} needs "
                         f"{smem} bytes of shared memory, more than {MAX_DYN_SMEM}")


def _issue_next(k: KernelBuilder, wss: list, wbases: list, chunk0: Reg, nc: int, i: Reg, wstages: int, wr: Reg) -> None:
    """Copy chunk ``i + wstages - 1`` of each of a producer warp's streams into its ring at ``wr``."""
    nxt_i = k.add(i, wstages - 1)
    for ws, wbase in zip(wss, wbases):
        ws.issue(chunk0, nc, nxt_i, k.add(wbase, wr))
    k.cp_async_commit()


def _a_row(k: KernelBuilder, r: Reg) -> Reg:
    """The A row (within its 8) of a producer lane's strip row ``r`` (0..7): ``pi(r) = 4 (r % 2) + r / 2``. The 8
    lanes of a quarter warp (rows 2 j, 2 j + 1, pieces 4 b + q) then store into 8 distinct 16-byte bank groups of
    the swizzled rows (piece ^ row): rows 2 j and 2 j + 1 differ in bit 2 of their A rows."""
    return k.or_(k.shl(k.and_(r, 1), 2), k.shr(r, 1))


@kernel("gemm_ws", grid=grid(), arch="sm_90a")
def gemm_ws(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, layout: str = "tiles", mt: int = 128,
            rgroups: int = 1, stages: int = 4, wstages: int = 2, bias: bool = False,
            residual: bool = False, out_f16: bool = False, glu: bool = False, xtma: bool = False,
            f16dec: bool = False, kparts: int = 1, psplit: int = 1, pfence: int = 1, xcast: int = 1,
            streamk: bool = False, ablate: str = "") -> KernelBuilder:
    """Y[:m] = X[:m] W^T (+ bias) (+ residual), or with ``glu`` silu(X G^T) * (X U^T) for W = [gate; up];
    W of ``wtype`` in ``layout``, X f16, f32 accumulation on wgmma from shared memory. Params: w, x, y, [bias],
    [residual], m, n, lda, ldy, [part, counters: kparts 2, 4; part, counters, ntiles: streamk], [xmap: xtma]. Launch:
    grid (ceil(rows_out / meta["rows_per_cta"]), ceil(m / mt), kparts), block meta["block"], dyn_smem
    meta["dyn_smem"]; with ``streamk`` grid (G, 1, 1), G at most the output tiles (``ntiles`` row tiles x the token
    tiles)."""
    check_shape(wtype, in_dim, layout, mt, rgroups, stages, wstages, kparts, psplit, pfence, xcast, xtma, streamk)
    cut = set(ablate.split("+")) - {""}  # (a diagnostic launch: these parts of the work left out)
    if cut - set(ABLATIONS) or (cut & {"xload", "xwait"} and (not xtma or xcast > 1)):
        raise ValueError(f"ablate takes '+'-joined parts of {ABLATIONS} (xload, xwait with X by a tensor map, no multicast), "
                         f"got {ablate!r}")
    flags, params = epilogue_signature(["w", "x", "y"], ["m", "n", "lda", "ldy"], bias=bias, residual=residual,
                                       out_f16=out_f16, glu=glu, layout=layout)
    if kparts > 1 or streamk:  # (K split over the CTAs of grid z, or Stream-K: partial sums, a counter per output tile)
        params = params + [("part", "u64"), ("counters", "u64")] + ([("ntiles", "u32")] if streamk else [])
    if xtma:  # (the tokens' X by a tensor map: rows of in_dim f16 values, lda apart, boxes of 64 x mt)
        params = params + [("xmap", TENSOR_MAP)]
    name = (f"gemm_ws_{wtype.lower()}_k{in_dim}_{layout.replace('-', '_')}_m{mt}_r{rgroups}_s{stages}_w{wstages}"
            f"{'_tma' if xtma else ''}{'_hd' if f16dec else ''}{f'_split{kparts}' if kparts > 1 else ''}"
            f"{'_sk' if streamk else ''}"
            f"{f'_p{psplit}' if psplit > 1 else ''}{f'_f{pfence}' if pfence > 1 else ''}"
            f"{f'_c{xcast}' if xcast > 1 else ''}{''.join(f'_no{c}' for c in sorted(cut))}{flags}")
    group = 128 * rgroups  # consumer threads
    pg = producer_groups(mt, rgroups)
    spw = rgroups // pg  # 16-row strips a producer warp streams
    block = threads(mt, rgroups, psplit)
    k = m.kernel(name, params, max_threads=block, cluster=(xcast, 1, 1) if xcast > 1 else None)
    slot_bytes = 16 * seg_bytes(wtype, in_dim, layout)
    wbytes = warp_bytes(wtype, in_dim, layout, wstages)
    ab, xb = a_bytes(rgroups), x_bytes(mt)
    k.meta.update(block=block, dyn_smem=smem_bytes(wtype, in_dim, layout, mt, rgroups, stages, wstages, psplit, xcast),
                  rows_per_cta=(8 if glu else 16) * 4 * rgroups, mt=mt,
                  part_floats=part_floats(mt, rgroups, 2 if streamk else kparts))
    nc = in_dim // CHUNK // kparts  # the chunks of K a CTA multiplies: c_base ..

    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    r, q = k.shr(lane, 2), k.and_(lane, 3)
    n_rows = k.param("n")
    m_all = k.param("m")
    tok0 = k.var("u32", 0) if streamk else k.mul(k.ctaid("y"), mt)  # (Stream-K: the unit's, set as it opens)
    smem0 = k.and_(k.add(k.dynamic_shared(), ALIGN - 1), -ALIGN & 0xFFFFFFFF)
    a0 = smem0  # stage s: A tile at a0 + s ab, B tile at x0 + s xb
    x0 = k.add(smem0, stages * ab)
    ring0 = k.add(smem0, tiles_bytes(mt, rgroups, stages))
    full0 = k.add(ring0, 4 * rgroups * psplit * wbytes)  # barrier s of kind K (bar) at full0 + 8 (K stages + s)
    with k.if_(k.setp("eq", tid, 0)):
        for s in range(stages):
            k.mbarrier_init(k.add(full0, 8 * s) if s else full0, (1 if xtma else group) + 128 * pg)
            k.mbarrier_init(k.add(full0, 8 * (stages + s)), group)
            if xcast > 1:  # (the cluster's release of slot s: each CTA's consumer thread 0, once its own released it)
                k.mbarrier_init(k.add(full0, 8 * (RELEASE * stages + s)), xcast)
    k.fence_mbarrier_init()
    k.bar_sync()
    if xcast > 1:  # (every CTA's barriers exist before another arrives on them or copies into its shared memory)
        k.cluster_sync()

    ring_pos = RingPosition(k, stages, streamk)

    def chunk_base() -> Reg:
        """The CTA's first chunk of K."""
        return k.mul(k.ctaid("z"), nc) if kparts > 1 else k.mov(0, "u32")

    def bar(slot: Reg | int, kind: int = FULL) -> Reg:
        """The mbarrier of ``slot`` of ``kind``: FULL, EMPTY or (X multicast) RELEASE, each kind ``stages`` of them."""
        at = slot + stages * kind if isinstance(slot, int) else k.add(slot, stages * kind) if kind else slot
        return (k.add(full0, 8 * at) if at else full0) if isinstance(at, int) else k.add(full0, k.shl(at, 3))

    S = types.SimpleNamespace()  # (what a role's setup leaves for its units)

    def consumer_setup() -> None:
        """Consumers: rows 64 g .. of the CTA (their descriptors, accumulators and X copies)."""
        S.g = k.shr(warp, 2)
        S.desc_a = [k.or_(k.cvt(k.shr(k.add(k.add(a0, k.shl(S.g, 13)), s * ab), 4), "u64"), DESC_FIXED, "b64")
                    for s in range(stages)]
        S.desc_b = [k.or_(k.cvt(k.shr(k.add(x0, s * xb), 4), "u64"), DESC_FIXED, "b64") for s in range(stages)]
        S.scale_d = k.setp("ne", k.mov(1, "u32"), 0)
        S.acc = [k.var("f32", 0.0) for _ in range(mt // 2)]
        k.grid_dependency_wait()  # X (and the residual) come from the kernels before
        S.rank = S.peer = S.x_lead = None
        if xtma:
            if xcast > 1:  # (X multicast: this CTA copies rows rank mt / 2 .. of each box into both CTAs of its pair)
                S.rank = k.cluster_rank()
                S.peer = k.xor(S.rank, 1)
            S.copy_x = x_by_tensor_map(k, tid, tok0, x0, xb, mt, bar, S.rank, xcast, "xload" in cut)
            S.x_lead = k.setp("eq", tid, 0)
        else:
            S.copy_x = x_by_cp_async(k, tid, group, tok0, m_all, x0, xb, mt, bar)

    def consumer_unit(units: StreamUnits | None, c_base: Reg | None, nc: Reg | int, leaving: bool) -> str | None:
        """The consumers' MMAs over chunks ``c_base`` .. (``nc`` of them) of their tile, then its epilogue; with
        ``leaving`` a K split's or a split unit's CTAs that do not sum branch to the label returned, past the
        epilogue."""
        acc, copy_x = S.acc, S.copy_x
        if units:  # (a unit's first stages go into the ring where the last unit left it)
            k.assign(tok0, k.mul(units.tok_tile, mt))
            for a in acc:
                k.assign(a, 0.0)
            firsts = [(k.add(ring_pos.slot, s) if s else ring_pos.slot, k.setp("gt", nc, s // 4))
                      for s in range(stages)]
            firsts = [(k.selp(k.sub(t, stages), t, k.setp("ge", t, stages), "u32") if s else t, ok)
                      for s, (t, ok) in enumerate(firsts)]
        else:
            c_base = chunk_base()
            firsts = [(s, None) for s in range(min(stages, 4 * nc))]
        for s, (slot, ok) in enumerate(firsts):  # (the first stages: chunk s / 4, its 64-k part s % 4; none past K)
            copy_x(k.add(c_base, s // 4) if s >= 4 else c_base, s % 4, slot, ok)
        with k.loop(0, nc) as i:
            for h in range(4):
                slot, parity = ring_pos.at(i, h)
                k.mbarrier_wait(bar(slot), parity)
                if not xtma:  # (the X copies' generic-proxy writes before the MMAs' async-proxy reads; a tensor map's
                    k.fence_proxy_async()  # copies are async-proxy writes, and the producers fence their A stores)
                k.wgmma_fence()
                if isinstance(slot, int):
                    da, db = S.desc_a[slot], S.desc_b[slot]
                else:  # (descriptors count 16-byte units)
                    sl = k.cvt(slot, "u64")
                    da, db = k.mad(sl, ab >> 4, S.desc_a[0], "u64"), k.mad(sl, xb >> 4, S.desc_b[0], "u64")
                for j in range(4):  # k16 steps: 32 bytes along the swizzled rows
                    if "mma" not in cut:
                        k.wgmma_f16_ss(acc, k.add(da, 2 * j, "u64") if j else da,
                                       k.add(db, 2 * j, "u64") if j else db, S.scale_d)
                k.wgmma_commit()
                k.wgmma_wait(1)  # the previous stage's MMAs are done: its slot is free
                prev = ring_pos.prev(slot)
                had = k.setp("ne", i, 0) if h == 0 else None
                k.mbarrier_arrive(bar(prev, EMPTY), pred=had)
                # the slot's X is rewritten only once every consumer thread has released it: a warp's
                # wgmma.wait_group covers its own wgmma groups, and another warp's (or the other consumer warpgroup's)
                # MMAs may still read the B tile (at i = 0, h = 0: a fresh barrier, passed at once, or the last unit's
                # last slot, released); with X by a tensor map only thread 0 writes it, and only it waits (the other
                # warps go on to the next stage)
                if xtma:
                    with k.if_(S.x_lead):
                        empty, prev_parity = bar(prev, EMPTY), ring_pos.prev_parity(h, slot, parity)
                        if "xwait" not in cut:
                            k.mbarrier_wait(empty, prev_parity)
                        if S.peer is not None:  # (and the other CTA's: its thread 0 arrives here, this one there)
                            cluster_release(k, bar(prev, RELEASE), S.peer, prev_parity, had)
                else:
                    k.mbarrier_wait(bar(prev, EMPTY), ring_pos.prev_parity(h, slot, parity))
                # X of the stage that takes the slot next (stages after the previous one), with its A from the
                # producers
                c_next = k.add(i, (h - 1 + stages) // 4)
                live = k.setp("lt", c_next, nc)
                if had is not None:  # (at i = 0 there was no previous stage: that X is in the prologue)
                    live = k.both(live, had)
                copy_x(k.add(c_base, c_next) if kparts > 1 or units else c_next, (h - 1 + stages) % 4, prev, live)
                ring_pos.advance()
        k.wgmma_wait(0)
        leave = k.new_label("leave") if leaving else None
        if kparts > 1:
            sum_parts(k, acc, tid, group, a0, kparts, leave)
        if units:  # (the unit's last stage released; a tile shared with another CTA summed by the later of the two)
            k.mbarrier_arrive(bar(ring_pos.prev(ring_pos.slot), EMPTY))
            with k.if_(units.split):
                sum_parts(k, acc, tid, group, a0, 2, leave, units.tile, units.part)
        r_strip = k.or_(k.shl(k.and_(r, 3), 1), k.shr(r, 2))  # (the strip row whose A row is r: _a_row's inverse)
        # (ablated: behind a test no launch passes, so that ptxas keeps the MMAs whose results it would write)
        with k.if_(k.setp("eq", m_all, 0xFFFFFFFF)) if "epilogue" in cut else contextlib.nullcontext():
            staged_epilogue(k, acc, a0, group, tid, k.add(k.shl(S.g, 2), k.and_(warp, 3)), r_strip, q, m_all,
                            k.shr(n_rows, 1) if glu else n_rows,
                            k.mul(units.col_tile if units else k.ctaid(), tile_cols(rgroups, glu)), tok0, mt, rgroups,
                            glu, bias, residual, out_f16)
        if leave is not None:
            k.label(leave)
        return leave

    # ---- producers: warp p streams the strips p + 4 pg u (rows 16 (p + 4 pg u) .. of the CTA's weight, u < spw), each
    # through its own ring; with psplit, warp p + 4 pg v (v < psplit) streams them too and fills the stages h of each
    # chunk with h % psplit = v ------------------------------------------------------------------------------------------
    def producer_setup() -> None:
        S.pw = k.shr(k.sub(tid, group), 5)
        S.phase, S.pl = None, S.pw
        if psplit > 1:  # (the warp's rings are its own; its strips those of warp pw % 4 pg)
            S.phase, S.pl = k.shr(S.pw, (4 * pg).bit_length() - 1), k.and_(S.pw, 4 * pg - 1)
        if spw == 1:
            S.wbases = [k.add(ring0, k.mul(S.pw, wbytes))]
        else:
            wfirst = k.add(ring0, k.mul(S.pw, spw * wbytes))
            S.wbases = [k.add(wfirst, u * wbytes) if u else wfirst for u in range(spw)]

    def producer_unit(units: StreamUnits | None, c_base: Reg | None, nc: Reg | int, pos: RingPosition | None) -> None:
        """The producers' chunks ``c_base`` .. (``nc`` of them) of their tile's weight rows, decoded into the stages
        (``pos``: the ring's position, going on from the last unit's; else a new one)."""
        wbases, phase = S.wbases, S.phase
        if not units:
            c_base = chunk_base()
        chunk0, p = c_base, S.pl  # (the producers stream the CTA's chunks of K)
        strips = [p] + [k.add(p, 4 * pg * u) for u in range(1, spw)]  # (the strips' indices in the CTA)
        cta_strip = k.mul(units.col_tile if units else k.ctaid(), 4 * rgroups)
        wss = [WeightStream(k, wtype, in_dim, layout, glu, lane, r, k.add(cta_strip, st), n_rows, f16dec)
               for st in strips]
        for ws in wss:
            ws.decode_setup(lane, q)
        streamed = [] if "wload" in cut else wss  # (the streams whose weights are copied)
        for s in range(wstages - 1):
            for ws, wbase in zip(streamed, wbases):
                ws.issue(chunk0, nc, k.mov(s, "u32"), k.add(wbase, s * slot_bytes) if s else wbase)
            k.cp_async_commit()
        k.grid_dependency_wait()  # (the producers read only weights; their first chunks are requested before this;
        # Stream-K: each unit's, a second wait passing at once)

        # A stores: the lane's rows r and r + 8 of strip st go to A rows 16 st + pi(r) and + 8 (pi: see _a_row), block
        # b of a stage at piece 4 b + q
        ar = _a_row(k, r)
        a_dst = []
        for st in strips:
            arow = k.add(a0, k.shl(k.add(k.shl(st, 4), ar), 7))
            a_dst.append([k.add(arow, k.shl(k.xor(k.add(q, 4 * b), ar), 4)) for b in range(2)])

        ring = wstages * slot_bytes
        rd = k.var("u32", 0)
        wr = k.var("u32", (wstages - 1) * slot_bytes)
        ring_pos = pos or RingPosition(k, stages)
        pending = []  # (the slots a producer has filled and not yet announced)
        with k.loop(0, nc) as i:  # (chunk i)
            k.cp_async_wait_group(wstages - 2)
            k.bar_warp_sync()
            c_abs = k.add(c_base, i) if kparts > 1 or units else i
            chs = [ws.prep(k.add(wbase, rd), c_abs, (wbase, ring)) for ws, wbase in zip(wss, wbases)]
            for h in range(4):
                slot, parity = ring_pos.at(i, h)
                if psplit > 1 and h == 0:  # (every warp streams the whole chunk; only the stage's own warps fill it)
                    _issue_next(k, streamed, wbases, chunk0, nc, i, wstages, wr)
                with (k.if_(k.setp("eq", phase, h % psplit)) if psplit > 1 else contextlib.nullcontext()):
                    prev = k.xor(parity, 1) if not isinstance(parity, int) else parity ^ 1
                    k.mbarrier_wait(bar(slot, EMPTY), prev)
                    if h == 0 and psplit == 1:
                        _issue_next(k, streamed, wbases, chunk0, nc, i, wstages, wr)
                    soff = None if isinstance(slot, int) else k.mul(slot, ab)
                    for ws, ch, dst in zip(wss, chs, a_dst):
                        for b in range(2):
                            r_words, r8_words = (ws.words(ch, 2 * h + b) if "decode" not in cut
                                                 else [[k.mov(0, "b32")] * 4] * 2)
                            at, off = (dst[b], slot * ab) if soff is None else (k.add(dst[b], soff), 0)
                            k.store("shared", "u32", at, r_words, off)
                            k.store("shared", "u32", at, r8_words, off + 8 * 128)
                    # (pfence stages' stores fenced at once, then announced; a slot held over a stage is copied:
                    # advance moves the register)
                    pending.append(slot if isinstance(slot, int) or pfence == 1 else k.mov(slot, "u32"))
                    if (h + 1) % pfence == 0:
                        if "fence" not in cut:
                            k.fence_proxy_async()  # (the stores' generic-proxy writes before the MMAs' async-proxy
                            # reads)
                        for sl in pending:
                            k.mbarrier_arrive(bar(sl))
                        pending.clear()
                ring_pos.advance()
            for v in (rd, wr):
                nxt = k.add(v, slot_bytes)
                k.assign(v, k.selp(0, nxt, k.setp("eq", nxt, ring), "u32"))
        k.cp_async_wait_all()

    if streamk:  # (one loop over the units for both roles, so that every thread meets at one barrier after each)
        producing = k.setp("ge", tid, group, "u32")
        with k.if_(producing, negate=True):
            consumer_setup()
        with k.if_(producing):
            producer_setup()
            ppos = RingPosition(k, stages, True)
        units = StreamUnits(k, in_dim // CHUNK, mt, m_all)
        c_base, nc = units.begin()
        with k.if_(producing, negate=True):
            consumer_unit(units, c_base, nc, True)
        with k.if_(producing):
            producer_unit(units, c_base, nc, ppos)
        units.end()
        k.ret()
        return k

    producer = k.new_label("producer")
    k.bra(producer, k.setp("ge", tid, group, "u32"))
    consumer_setup()
    if consumer_unit(None, None, nc, xcast > 1) is not None:  # (a cluster's CTAs leave together: none exits early)
        k.cluster_sync()
    k.ret()
    k.label(producer)
    producer_setup()
    producer_unit(None, None, nc, None)
    if xcast > 1:
        k.cluster_sync()
    k.ret()
    return k
