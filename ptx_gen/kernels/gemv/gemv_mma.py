"""Tensor-core GEMV ``y = W x (+ bias) (+ residual)`` for decode, W in the blocks of ``MMA_TYPES``: the
weights' integer codes go into exact int8 MMAs (``mma.m16n8k32.s32.s8.s8``), so decoding a weight
costs a fraction of an instruction instead of a float conversion and an FMA each.

x as integers, exactly enough: each 256 values of x (a *unit*) are scaled by a power of two ``f`` (from
their max |x|, so that ``|x f| < 2**30``), rounded to ``X`` and written as four signed base-256 digits
``X = c0 + 256 c1 + 2**16 c2 + 2**24 c3`` (each in [-128, 127]) into shared memory, a few
instructions a value (see :func:`_digits`). The digits are four columns of the MMA's B operand (the
other four are zero), so one MMA gives, for 16 weight rows at once, the exact integer dot products of
a block's codes with each digit; rounding x to 31 bits of its unit's max is the only approximation
(finer than float32 for all but a unit's largest values); ``1 / f`` goes into the unit's scale.

Work split: a CTA has ``mtiles`` x ``kparts`` warps; warp (mt, kp) owns the 16 rows of tile ``mt``
and every ``kparts``-th unit of K from unit ``kp`` on (so the parts read neighbouring bytes at the
same time). K is walked in *units* of 256 values (one Q4_K super-block, or 8
Q8_0 blocks): a unit of 16 rows is 16 x 144 (or 272) bytes, copied with ``cp.async`` into a ring of
``stages`` per-warp buffers. The first ``stages`` units (or ``ahead`` of them) are requested before
``griddepcontrol.wait`` (they are weights: no kernel writes them), so under programmatic dependent launch
they stream in while the previous kernel ends; with ``ahead``, the rest of the ring right after the first
loads of x, which then do not queue behind a whole ring of weight bytes. Each warp turns the x units it
needs into digits itself, one unit ahead of its use (loaded two ahead), into a slot of its own (written
once every lane has read the unit before: one slot is enough): no CTA-wide step before the first MMA,
and x arrives alongside the weights.

Weight layout: GGUF rows, or (``tiled``) tile-major (:func:`tile_major`): tiles of 32 rows, each unit's
32 rows back to back, so that a warp's stage is one contiguous run of bytes (one bulk copy on sm_90)
and a launch reads whole tiles side by side; the 32-value block types' units are re-encoded there too
(scales side by side, fifth bits in lane order, aligned codes: ``TILED_B32``). On GGUF rows a stage is
16-32 pieces of a unit's bytes, one per row, a row apart, which the DRAM streams more slowly than one
run per stage.

Per unit (Q4_K): each row's 6-bit scales and mins are unpacked into a table by one lane; each of
the 4 sub-block pairs is one ``ldmatrix.x4`` (lane (g, t) gets 4 code bytes of rows g and g + 8 in
each half of the pair) feeding two MMAs that each take the low nibbles of sub-block 2i (class 0) as
k 0..15 and the high nibbles of 2i + 1 (class 1, masked in place) as k 16..31, against x digits in B's
columns 0..3 and 4..7 (see :func:`unit_q4k`); their int32 results are weighted by the integer
sub-block scales (``mad``), and once per unit converted to float and multiplied by the row's ``d``.
The mins contribute ``-dmin m_j sum(x over sub-block j)`` with the sums of x kept per 32 values in
shared memory.
Q8_0: the block's 32 signed codes are A directly (two-byte aligned, realigned with ``prmt``); one MMA
per block, scaled by the block's ``d`` in float. Q6_K (210-byte blocks, so a unit starts at any even
byte of a 16-byte chunk: the 14 chunks covering it are staged, words realigned with funnel shifts):
the 6-bit codes are assembled from their ql/qh bits as unsigned bytes; each MMA pairs two 16-value
sub-blocks, one per half of B's 8 columns, so every lane's sums carry one integer scale; the codes'
offset of 32 enters exactly, as the MMA's accumulator input (:func:`unit_q6k`). The 32-value block
types (Q4_0, Q4_1, Q5_0, Q5_1) pair two blocks per pair of MMAs as Q4_K pairs its sub-blocks, so that a
lane's results carry one block scale (:func:`unit_b32`). Their 160- and 192-byte rows (Q4_1, Q5_1)
would put rows an A word load reads in the same shared-memory banks: on GGUF rows they are staged 16
bytes apart more than they are stored (``ROW_PAD``); tile-major rows hold their 16-byte chunks permuted
by row (``SWIZZLE``), so a stage is still one contiguous run of bytes (one bulk copy).

End: each row's sum is spread over the 4 lanes of its group (digit columns) and weighted by
1, 256, 65536 and 2**24; with ``kparts > 1`` the parts meet in shared memory (one
``bar.sync``) and are added in order (deterministic).

Launch: grid ``ceil(out_dim / (16 tiles mtiles))``, block ``32 mtiles kparts``, dynamic shared memory
``meta["dyn_smem"]`` bytes (above 48 KiB: the launcher raises the limit). ``in_dim`` must be a
multiple of 256 with at least ``kparts`` units (Q6_K on GGUF rows: a multiple of 2048); W starts 16-byte
aligned.

Modules: the warps' setup and weight rings are :mod:`~ptx_gen.kernels.gemv.gemv_mma_ring`, x's digits
and the unit bodies :mod:`~ptx_gen.kernels.gemv.gemv_mma_units`, the columns kernel's bodies and epilogue
:mod:`~ptx_gen.kernels.gemv.gemv_mma_cols`, the geometry :mod:`~ptx_gen.kernels.gemv.gemv_mma_layout`;
this module emits the kernel from them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv import gemv_params
from ptx_gen.kernels.gemv.gemv_mma_layout import (
    BLOCK32,
    MINS,
    MMA_TYPES,
    PAIRED,
    PARTS,
    PLANE,
    Q6K_HALF,
    Q8_DIGITS,
    SOLO_SMEM,
    SWIZZLE,
    TILE_ROWS,
    TILE_UNIT,
    UNIT_BYTES,
    XSLOT,
    layout,
    q6k_glu_offsets_fit,
    table_row,
    tile_major,
)
from ptx_gen.kernels.gemv.gemv_mma_cols import (
    epilogue_cols,
    store_rows,
    load_x_cols,
    unit_b32_cols,
    unit_q4k_cols,
    unit_q6k_cols,
    unit_q8_0_cols,
)
from ptx_gen.kernels.gemv.gemv_mma_ring import Warp, fill_ring, first_output, setup_warp, unit_step, weight_copies
from ptx_gen.kernels.gemv.gemv_mma_units import (
    b32_ldmatrix_lanes,
    convert_x,
    load_x,
    unit_b32,
    unit_q4k,
    unit_q6k,
    unit_q8_0,
    x_lane_constants,
)

# The geometry lives in gemv_mma_layout; the GEMV launch policy and tests take it from here.
__all__ = ["gemv_mma", "build", "layout", "tile_major", "q6k_glu_offsets_fit", "MMA_TYPES", "SOLO_SMEM",
           "TILE_ROWS", "TILE_UNIT", "UNIT_BYTES"]


def build(m: Module, wtype: str, in_dim: int, mtiles: int, kparts: int, stages: int, bias: bool,
          residual: bool, tiles: int = 1, bulk: bool = False, glu: bool = False, tiled: bool = False,
          solo: bool = False, late: bool = False, cols: int = 1, xh: bool = False, out_f16: bool = False,
          l2pre: int = 0, ahead: int = 0) -> KernelBuilder:
    lay = layout(wtype, in_dim, mtiles, kparts, stages, tiles, tiled, solo, cols)
    multi = cols > 1 or xh or out_f16  # (the columns kernel, gemv_mma_cols; it takes one column too)
    if glu and (tiles != 2 or bias or residual):
        raise ValueError("glu needs tiles=2 (a warp's 16 gate rows and their 16 up rows) and no bias/residual")
    if bulk and m.target.compute_capability < (9, 0):
        raise ValueError(f"bulk copies need sm_90 or newer, the target is {m.target}")
    if bulk and wtype == "Q6_K" and not tiled:
        raise ValueError("Q6_K rows (210-byte blocks) are not 16-byte aligned: no bulk copies unless tile-major")
    warps, R = lay["warps"], lay["rows"]
    params = gemv_params(bias, residual) + ([("ldx", "u32"), ("ldy", "u32")] if multi else [])
    name = (f"gemv_mma_{wtype.lower()}_k{in_dim}_m{mtiles}_p{kparts}_s{stages}" + (f"_t{tiles}" if tiles > 1 else "")
            + ("_bulk" if bulk else "") + ("_tiled" if tiled else "") + ("_solo" if solo else "") + ("_late" if late else "")
            + (f"_pf{l2pre}" if l2pre else "") + (f"_a{ahead}" if ahead else "")
            + ("_glu" if glu else "")
            + ("_bias" if bias else "") + ("_res" if residual else "")
            + (f"_c{cols}" if multi else "") + ("_xh" if xh else "") + ("_h" if out_f16 else ""))
    k = m.kernel(name, params)
    k.max_threads = 32 * warps  # .maxntid: ptxas keeps the registers within what the whole CTA can get
    if multi:
        # one CTA an SM is budget enough: each column keeps the warp's accumulators, and ptxas's own
        # occupancy guess (two or three CTAs an SM) spilled them at 64-128 registers
        k.min_blocks = 1
    elif wtype in BLOCK32 and (tiled or warps < 8 or tiles == 1) and warps <= 8:
        # ptxas's own occupancy guess held some of these at 80 (8 warps, tile-major or 16-row warps) or 96
        # registers (4 warps) with spills: registers for two CTAs an SM, or for one where a second would not
        # fit the shared memory (solo). (8-warp CTAs of 32-row warps on GGUF rows keep ptxas's guess: two
        # CTAs' worth spills Q4_0's on sm_80)
        k.min_blocks = 1 if 2 * (lay["launch_smem"] + 1024) > 228 * 1024 else 2
    elif wtype == "Q6_K" and tiled:
        # ptxas's own guess held some at 128 registers with a few bytes spilled (8 warps solo on sm_89, 3
        # warps on sm_90): registers for as many CTAs as the shared memory lets an SM hold
        k.min_blocks = max(1, min(8, 228 * 1024 // (lay["launch_smem"] + 1024)))
    k.meta.update(block=32 * warps, rows_per_cta=(16 if glu else R) * mtiles, dyn_smem=lay["launch_smem"],
                  row_bytes=lay["row_bytes"], tiled=tiled, cols=cols)
    s = setup_warp(k, lay, wtype, mtiles, kparts, stages, tiles, bulk, glu, tiled)
    s.late = late
    if l2pre and (not tiled or m.target.compute_capability < (9, 0)):
        raise ValueError("l2pre (L2 prefetches of the units past the ring) needs tile-major weights and sm_90")
    s.l2pre = l2pre
    if ahead and (multi or not 0 < ahead < stages):
        raise ValueError(f"ahead (ring stages requested before the grid wait) must be 1..stages - 1 = {stages - 1} "
                         f"in the one-column kernel, got {ahead}" + (" for the columns kernel" if multi else ""))
    s.ahead = ahead
    issue, wait = weight_copies(s)
    fill_ring(s, issue)
    if multi:
        _build_cols(s, issue, wait, mtiles, kparts, cols, xh, out_f16, bias, residual)
        return k
    xs = _x_prologue(s)
    ctx = _lane_context(s)
    # [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1] (the 32-value block types: [g], [g+8], see unit_b32)
    acc = [[k.var("f32", 0.0) for _ in range(2 if wtype in BLOCK32 else 4)] for _ in range(tiles)]
    minacc = k.var("f32", 0.0) if wtype in MINS else None  # lane r: row r's min term
    _main_loop(s, ctx, xs, issue, wait, acc, minacc)
    if not bulk:
        k.cp_async_wait_all()
    sums, tid, lane, g, t = _row_sums(k, wtype, tiles, acc, minacc)
    _epilogue(k, lay, mtiles, kparts, sums, s.smem, tid, lane, g, t, s.out_dim, bias, residual, glu)
    k.ret()
    return k


def _build_cols(s: Warp, issue, wait, mtiles: int, kparts: int, cols: int, xh: bool, out_f16: bool, bias: bool,
                residual: bool) -> None:
    """The columns kernel's body (see :mod:`ptx_gen.kernels.gemv.gemv_mma_cols`) after the ring's first
    copies: the x slots of every column, the unit loop, each column's row sums and the epilogue."""
    k, wtype = s.k, s.wtype
    XS = XSLOT[wtype]
    x = k.global_ptr("x")
    ldxb = k.mul_wide(k.param("ldx"), 2 if xh else 4)
    xc = x_lane_constants(k, wtype, s.lane)
    xbuf = k.add(s.smem, k.add(k.mul(s.warp, cols * XS), s.lay["off"]["xbuf"]))  # a slot a column
    if wtype == "Q6_K":  # the B words that stay zero, in every slot (see _x_prologue)
        zero = k.add(xbuf, k.add(k.shl(s.lane, 4), k.selp(4, 0, k.setp("lt", s.lane, 16), "u32")))
        for off in (sl * XS + 512 * mp + 8 * m2 for sl in range(cols) for mp in range(4) for m2 in range(2)):
            k.store("shared", "u32", zero, k.mov(0, "u32"), off)

    def convert(j: Reg | int, valid: Reg | None) -> None:  # unit j's x, every column, into its slot
        vals = load_x_cols(k, x, ldxb, s.lane, s.unit_of(j), cols, xh, valid)
        for col, v in enumerate(vals):
            convert_x(k, wtype, v, k.add(xbuf, col * XS) if col else xbuf, xc)

    convert(0, None)
    ctx = _lane_context(s)
    accs = [[[k.var("f32", 0.0) for _ in range(2 if wtype in BLOCK32 else 4)] for _ in range(s.tiles)]
            for _ in range(cols)]
    minaccs = [k.var("f32", 0.0) for _ in range(cols)] if wtype in MINS else None

    def slots(j: Reg) -> list:  # the x slots, one a column (unit j's during its step)
        return [k.add(xbuf, col * XS) if col else xbuf for col in range(cols)]

    def body(j: Reg, sbase: Reg, xslots: list) -> None:
        if wtype in ("Q4_K", "Q5_K"):
            unit_q4k_cols(k, ctx, sbase, xslots, accs, minaccs, q5=wtype == "Q5_K")
        elif wtype == "Q6_K":
            unit_q6k_cols(k, ctx, sbase, xslots, accs, None if s.tiled else k.shl(k.and_(s.unit_of(j), 7), 1))
        elif wtype in BLOCK32:
            unit_b32_cols(k, wtype, ctx, sbase, xslots, accs, minaccs)
        else:
            unit_q8_0_cols(k, ctx, sbase, xslots, accs)

    def step(j: Reg) -> None:
        unit_step(s, j, wait, issue, slots, body)
        j1 = k.add(j, 1)
        more = s.has(j1)
        with k.if_(more) if more is not None else contextlib.nullcontext():
            convert(j1, None)

    n = s.n_units if isinstance(s.n, int) else s.n
    with k.loop(0, n, 1) as j:
        step(j)
    if not s.bulk:
        k.cp_async_wait_all()
    col_sums = []
    for col in range(cols):
        sums, tid, lane, g, t = _row_sums(k, wtype, s.tiles, accs[col], minaccs[col] if minaccs else None)
        col_sums.append(sums)
    epilogue_cols(k, s.lay, mtiles, kparts, col_sums, s.smem, tid, lane, g, t, s.row_base, s.out_dim, bias, residual,
                  s.glu, out_f16)
    k.ret()


@dataclass
class _XState:
    """x's per-warp state: its pointer, the lane's 16-byte offset, the conversion constants, the
    warp's digit slot, and the registers holding the loads of the next odd / even unit."""
    x: Reg
    lane16: Reg
    xc: dict
    xbuf: Reg
    xregs: list


def _x_prologue(s: Warp) -> _XState:
    """Emits x's setup: the warp's x slot (Q6_K: its B words that stay zero are zeroed), the
    loads of units 0, 1 and 2 (requested together), the ring's deferred copies (``ahead``), and unit
    0's conversion to digits. Units j + 1 and j + 2 then stay in flight in registers: odd units in
    xregs[1], even ones in xregs[0] (the loop is unrolled by two so no register is copied while its
    load is still in flight)."""
    k, lane, wtype = s.k, s.lane, s.wtype
    x = k.global_ptr("x")
    lane16 = k.cvt(k.shl(lane, 4), "u64")
    xc = x_lane_constants(k, wtype, lane)
    XS = XSLOT[wtype]
    xbuf = k.add(s.smem, k.add(k.mul(s.warp, XS), s.lay["off"]["xbuf"]))
    if wtype == "Q6_K":  # the B words that stay zero (lane (g, t): word [m / 2][g][t][m % 2][g < 4])
        zero = k.add(xbuf, k.add(k.shl(lane, 4), k.selp(4, 0, k.setp("lt", lane, 16), "u32")))
        for off in (512 * mp + 8 * m2 for mp in range(4) for m2 in range(2)):
            k.store("shared", "u32", zero, k.mov(0, "u32"), off)
    x0 = load_x(k, x, lane16, s.unit_of(0), None)
    xregs = [[k.var("f32", 0.0) for _ in range(8)] for _ in range(2)]
    for jj in (1, 2):
        if jj < s.n_units:
            load_x(k, x, lane16, s.unit_of(jj), s.has(jj), into=xregs[jj % 2])
    for copy in s.deferred:  # (the ring's stages past ``ahead``, behind x's loads)
        copy()
    convert_x(k, wtype, x0, xbuf, xc)
    return _XState(x, lane16, xc, xbuf, xregs)


def _lane_context(s: Warp) -> dict:
    """Emits the lane's fixed addresses and constants for the unit bodies (:func:`unit_q4k`,
    :func:`unit_q6k`, :func:`unit_q8_0`): the warp's scale table, the lane's rows in a stage, its A /
    B fragment offsets and masks, by weight type."""
    k, lane, wtype, U, R = s.k, s.lane, s.wtype, s.U, s.R
    g, t = k.shr(lane, 2), k.and_(lane, 3)
    TR = table_row(wtype, s.tiled)
    ctx = {
        "g": g, "R": R, "tiles": s.tiles, "U": U,
        "zeros": [k.mov(0, "s32")] * 4,
        # the per-unit table, row r at r * table_row, filled by lane r (< R)
        "table": k.add(s.smem, k.add(k.mul(s.warp, R * TR), s.lay["off"]["table"])), "TR": TR,
        # (32-row warps: every lane has a row; no branch, so the table's work can mix with the rest)
        "t_lane": k.setp("lt", lane, R) if R < 32 else None,
        "row_stage": k.mul(lane, U),  # lane r's row in a staged unit
        "t4": k.shl(t, 2),
        "tiled": s.tiled,
    }
    ctx["t_mine"] = k.add(ctx["table"], k.mul(lane, TR))
    ctx["t_g"] = k.add(ctx["table"], k.mul(g, TR))  # + 8 * TR * (2 r + h): row 16 r + 8 h + g
    if wtype in Q8_DIGITS:  # lane (g, t)'s B fragments: plane g (g < 4; zero columns past), word group t
        ctx["b_ok"] = k.setp("lt", g, PARTS)
        ctx["b_lane"] = k.add(k.mul(g, PLANE), k.shl(t, 4))
    if wtype in BLOCK32:
        zero = BLOCK32[wtype]["zero"]
        if zero:
            ctx["minus_zero"] = k.mov((-zero & 0xFF) * 0x01010101, "u32")  # -zero in every byte of A
        ctx["gU"] = k.mul(g, U)  # lane (g, t)'s row g in a staged unit
        if s.tiled:  # (the ldmatrix rows of its A words, see b32_rows)
            ctx["ldm_b32"] = b32_ldmatrix_lanes(k, wtype, lane, U)
        if s.tiled and wtype in SWIZZLE:  # (rows with permuted chunks: per residue j of a chunk, where the
            # lane's row keeps it, see b32_rows; row g's fifth bits, row r's (= lane) scales)
            kg, kr = ql.swizzle_key16(k, wtype, g), ql.swizzle_key16(k, wtype, lane)
            if BLOCK32[wtype]["qh"] is not None:
                moved = [kg] + [k.xor(kg, 16 * j) for j in range(1, SWIZZLE[wtype][1] + 1)]
                ctx["h_sw"] = [k.add(ctx["gU"], m) for m in moved]
            ctx["row_sw"] = [k.add(ctx["row_stage"], kr), k.add(ctx["row_stage"], k.xor(kr, 16))]
        if BLOCK32[wtype]["qh"] is not None and s.tiled:
            ctx["t"], ctx["t_up"] = t, k.sub(4, t)  # (the shifts of its fifth bits, see unit_b32)
        elif BLOCK32[wtype]["qh"] is not None:
            ctx["t4_16"] = k.add(ctx["t4"], 16)
    elif wtype == "Q6_K":
        ctx["minus32"] = [k.mov(0xE0E0E0E0, "u32")] * 4  # -32 in every byte of A
        ctx["b_q6"] = k.add(k.shl(g, 6), k.shl(t, 4))  # lane (g, t)'s B words: [m / 2][g][t][m % 2][2]
        ctx["t_gc"] = k.add(ctx["t_g"], k.shl(k.shr(t, 1), 5))  # its scales: class t / 2 of row g
        ctx["a_lane"] = k.add(k.mul(g, U), ctx["t4"])  # its A words: row g, bytes 4t + 16 m'
        # a stage's 16-row tiles are 16 U apart, or (tile-major) Q6K_HALF; there, lane r's row (its d: see
        # q6k_table_row)
        ctx["tile_step"] = Q6K_HALF if s.tiled else 16 * U
        if s.tiled:
            ctx["row_stage"] = k.mad(k.shr(lane, 4), Q6K_HALF, k.mul(k.and_(lane, 15), U))
    if wtype in PAIRED:
        ctx["t_gc"] = k.add(ctx["t_g"], k.shl(k.shr(t, 1), 4))  # lane (g, t)'s scales: class t / 2 of row g
        if wtype in ("Q4_K", "Q5_K"):
            ctx["t_gd"] = k.add(ctx["t_g"], k.add(k.shl(k.shr(t, 1), 2), 32))  # and its d / f
        ctx["b_q4"] = k.add(k.shl(g, 5), k.shl(t, 3))  # its B words: [j][g][t][h]
        lo_cols = k.setp("lt", g, 4)  # columns 0..3 (class 0: B's k < 16), else 4..7 (k >= 16)
        ctx["b_mask"] = (k.selp(0xFFFFFFFF, 0, lo_cols, "u32"), k.selp(0, 0xFFFFFFFF, lo_cols, "u32"))
    if wtype in ("Q4_K", "Q5_K"):
        ctx["ldm"] = k.add(k.mul(k.add(k.and_(lane, 7), k.shl(k.and_(k.shr(lane, 3), 1), 3)), U),
                           k.shl(k.shr(lane, 4), 4))
    return ctx


def _main_loop(s: Warp, ctx: dict, xs: _XState, issue, wait, acc: list, minacc: Reg | None) -> None:
    """Emits the loop over the warp's units, unrolled by two (the x registers alternate by the unit's
    parity), plus the odd last unit: each step waits for unit j's weights, runs the unit body into
    ``acc`` (and ``minacc``), refills the ring slot with unit j + stages, converts unit j + 1's x and
    starts loading unit j + 3's."""
    k, wtype, n_units = s.k, s.wtype, s.n_units

    def body(j: Reg, sbase: Reg, xslot: Reg) -> None:
        if wtype in ("Q4_K", "Q5_K"):
            unit_q4k(k, ctx, sbase, xslot, acc, minacc, q5=wtype == "Q5_K")
        elif wtype == "Q6_K":
            u = s.unit_of(j)
            unit_q6k(k, ctx, sbase, xslot, acc, None if s.tiled else k.shl(k.and_(u, 7), 1))
        elif wtype in BLOCK32:
            unit_b32(k, wtype, ctx, sbase, xslot, acc, minacc)
        else:
            unit_q8_0(k, ctx, sbase, xslot, acc)

    def step(j: Reg) -> None:
        """Unit j (:func:`unit_step`), then convert unit j + 1's x (in the registers of its parity) and
        start loading unit j + 3's into them."""
        unit_step(s, j, wait, issue, lambda j: xs.xbuf, body)
        # unit j + 1's x into the slot (every lane is done with unit j's: unit_step's bar.warp.sync
        # after the body). Q6_K without a branch (past the last unit the registers hold stale x,
        # converted into the slot no unit reads any more), which suits its longer unit body; the others
        # skip the conversion past the last unit
        j1 = k.add(j, 1)
        regs = xs.xregs[parity[0]]
        with k.if_(s.has(j1)) if wtype != "Q6_K" else contextlib.nullcontext():
            convert_x(k, wtype, list(regs), xs.xbuf, xs.xc)
        j3 = k.add(j, 3)
        load_x(k, xs.x, xs.lane16, s.unit_of(j3), s.has(j3), into=regs)
        parity[0] ^= 1

    parity = [1]  # unit j + 1 of the first step is odd
    if isinstance(s.n, int):
        if n_units >= 2:
            with k.loop(0, n_units - n_units % 2, 2) as j:
                step(j)
                step(k.add(j, 1))
        if n_units % 2:
            step(k.mov(n_units - 1, "u32"))
        return
    with k.loop(0, k.and_(s.n, 0xFFFFFFFE), 2) as j:  # (n_units >= 2: kparts <= units)
        step(j)
        step(k.add(j, 1))
    with k.if_(k.setp("ne", k.and_(s.n, 1), 0)):
        step(k.sub(s.n, 1))


def _row_sums(k: KernelBuilder, wtype: str, tiles: int, acc: list, minacc: Reg | None):
    """Emits each row's sum from the MMA accumulators: digit columns weighted 1, 256 (lane t = 0),
    65536 and 2**24 (t = 1), summed over the 4 lanes of the group; Q6_K's columns 4..7 (lanes t = 2, 3)
    are the same digits of its second sub-block of each MMA; the 32-value block types keep one
    accumulator a row in units of 1 (t % 2 = 0) or 65536 (t % 2 = 1); Q4_K subtracts the rows' min terms.
    Returns ``(sums, tid, lane, g, t)``, sums of rows g, g + 8 (, 16 + g, 24 + g)."""
    tid = k.tid()
    lane = k.and_(tid, 31)
    g, t = k.shr(lane, 2), k.and_(lane, 3)
    tt = k.and_(t, 1) if wtype not in Q8_DIGITS else t
    t_is0 = k.setp("eq", tt, 0)
    sums = []  # rows g, g + 8, 16 + g, 24 + g
    if wtype in BLOCK32:  # one accumulator a row, in units of digit 2 t' (see unit_b32)
        w = k.selp(1.0, 65536.0, t_is0, "f32")
        pairs = [((a, w), None) for r in range(tiles) for a in acc[r]]
    else:
        t_is1 = k.setp("eq", tt, 1)
        w0 = k.selp(1.0, k.selp(65536.0, 0.0, t_is1, "f32"), t_is0, "f32")
        w1 = k.selp(256.0, k.selp(16777216.0, 0.0, t_is1, "f32"), t_is0, "f32")
        pairs = [((a0, w0), (a1, w1)) for r in range(tiles) for a0, a1 in ((acc[r][0], acc[r][1]), (acc[r][2], acc[r][3]))]
    for (a0, w0_), second in pairs:
        sm = k.mul(a0, w0_) if second is None else k.fma(second[0], second[1], k.mul(a0, w0_))
        sm = k.add(sm, k.shfl("bfly", sm, 1))
        sums.append(k.add(sm, k.shfl("bfly", sm, 2)))
    if minacc is not None:  # lane r holds row r's min term
        sums = [k.sub(sm, k.shfl("idx", minacc, k.add(g, 8 * i) if i else g)) for i, sm in enumerate(sums)]
    return sums, tid, lane, g, t


def _epilogue(k, lay, mtiles, kparts, sums, smem, tid, lane, g, t, out_dim, bias, residual, glu) -> None:
    """Store (or, with K parts, combine in order and store: :func:`store_rows`) the warp's rows,
    + bias/residual. ``sums``: rows g, g + 8 (, g + 16, g + 24) of the warp, complete in lanes t == 0.
    With ``glu`` output o of the warp is silu(row o) * (row 16 + o)."""
    warp = k.shr(tid, 5)
    row_base = first_output(k, warp, mtiles, 16 if glu else lay["rows"])

    def store(val: Reg, r: Reg, col: int) -> None:
        off = k.mul_wide(r, 4)
        if bias:
            val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("bias"), off)))
        if residual:
            val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("residual"), off)))
        k.store("global", "f32", k.add(k.global_ptr("y"), off), val)
    store_rows(k, lay, mtiles, kparts, [sums], smem, warp, lane, g, t, row_base, out_dim, glu, store)


def _grid_shapes() -> list[dict]:
    shapes = []
    for wt in MMA_TYPES:
        shapes += [{"wtype": wt, "in_dim": 256, "mtiles": 1, "kparts": 1, "stages": 2},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 2, "kparts": 4, "stages": 4},
                   {"wtype": wt, "in_dim": 14336, "mtiles": 2, "kparts": 4, "stages": 4, "residual": True},
                   {"wtype": wt, "in_dim": 14336, "mtiles": 1, "kparts": 8, "stages": 2, "tiles": 2},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 4, "kparts": 2, "stages": 2, "tiles": 2, "bias": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 8, "kparts": 1, "stages": 2, "tiles": 2, "glu": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 2, "kparts": 4, "stages": 2, "tiles": 2, "glu": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 8, "kparts": 1, "stages": 4, "bias": True},
                   {"wtype": wt, "in_dim": 14336, "mtiles": 1, "kparts": 8, "stages": 2, "tiles": 2, "tiled": True,
                    "solo": True, "residual": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 2, "kparts": 4, "stages": 2, "tiled": True, "bias": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 4, "kparts": 2, "stages": 2, "tiles": 2, "glu": True,
                    "tiled": True}]
    for sh in shapes:
        if sh["wtype"] == "Q6_K" and sh["in_dim"] == 256:
            sh["in_dim"] = 2048
    # 16-warp CTAs (late trigger), K parts that do not divide the units, and the dispatcher's TILED_UNBALANCED
    # Q4_K pick for 14336 rows
    shapes += [{"wtype": "Q4_K", "in_dim": 4096, "mtiles": 4, "kparts": 4, "stages": 2, "tiles": 2, "tiled": True,
                "late": True},
               {"wtype": "Q4_K", "in_dim": 4096, "mtiles": 1, "kparts": 4, "stages": 2, "tiles": 2, "tiled": True},
               {"wtype": "Q4_0", "in_dim": 14336, "mtiles": 1, "kparts": 16, "stages": 2, "tiles": 2, "tiled": True},
               {"wtype": "Q5_0", "in_dim": 14336, "mtiles": 1, "kparts": 12, "stages": 2, "tiles": 2, "tiled": True,
                "residual": True}]
    # WIDE_BALANCED's Q4_K pick at 4096 x 14336 and B32_ONE_TILE's 16-row warps there
    shapes += [{"wtype": "Q4_K", "in_dim": 14336, "mtiles": 1, "kparts": 16, "stages": 2, "tiles": 2, "tiled": True,
                "solo": True, "late": True}]  # (bulk copies: sm_90 only, see the dispatcher test)
    shapes += [{"wtype": wt, "in_dim": 14336, "mtiles": 1, "kparts": 8, "stages": 2, "tiled": True} for wt in ("Q4_0", "Q5_0")]
    for wt in MMA_TYPES:  # the columns kernel (small batches: f16 x, residual; the gate/up GEMV with f16 out)
        shapes += [{"wtype": wt, "in_dim": 4096, "mtiles": 1, "kparts": 4, "stages": 2, "tiles": 1, "tiled": True,
                    "residual": True, "cols": 4, "xh": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 4, "kparts": 2, "stages": 2, "tiles": 2, "tiled": True,
                    "glu": True, "cols": 2, "xh": True, "out_f16": True}]
    # the dispatcher's picks where the DRAM is fast (FAST_DRAM_UNBALANCED, FAST_DRAM_WIDE; bulk copies and L2
    # prefetches are sm_90 only: see test_fast_dram_picks_assemble_without_spills)
    shapes += [{"wtype": "Q5_0", "in_dim": 4096, "mtiles": 2, "kparts": 2, "stages": 3, "tiles": 2, "tiled": True},
               {"wtype": "Q5_1", "in_dim": 4096, "mtiles": 1, "kparts": 3, "stages": 2, "tiles": 2, "tiled": True},
               {"wtype": "Q6_K", "in_dim": 4096, "mtiles": 1, "kparts": 3, "stages": 2, "tiles": 2, "tiled": True,
                "residual": True}]
    shapes += [{"wtype": wt, "in_dim": 14336, "mtiles": 1, "kparts": kp, "stages": 2, "tiles": 2, "tiled": True,
                "solo": True, "late": True} for wt, kp in (("Q5_K", 12), ("Q6_K", 12), ("Q4_0", 16), ("Q4_1", 16))]
    # one ring stage before the grid wait, the other after x's first loads (FAST_DRAM_AHEAD_*: bulk copies
    # there, sm_90 only, see test_fast_dram_picks_assemble_without_spills; cp.async rings here)
    shapes += [{"wtype": wt, "in_dim": 4096, "mtiles": 1, "kparts": kp, "stages": 2, "tiled": True, "ahead": 1}
               for wt, kp in (("Q8_0", 3), ("Q6_K", 4))]
    shapes += [{"wtype": "Q4_K", "in_dim": 14336, "mtiles": 1, "kparts": 16, "stages": 2, "tiles": 2, "tiled": True,
                "solo": True, "late": True, "ahead": 1, "residual": True}]
    for wt in BLOCK32:  # the dispatcher's smaller CTAs for 14336 rows (B32_UNBALANCED), tile-major
        shapes += [{"wtype": wt, "in_dim": 4096, "mtiles": 1, "kparts": 4, "stages": 2, "tiles": 2, "tiled": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 2, "kparts": 4, "stages": 2, "tiles": 2, "tiled": True},
                   {"wtype": wt, "in_dim": 4096, "mtiles": 1, "kparts": 4, "stages": 2, "tiled": True}]
    return shapes


@kernel("gemv_mma", grid=_grid_shapes())
def gemv_mma(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, mtiles: int = 2, kparts: int = 4, stages: int = 4,
             bias: bool = False, residual: bool = False, tiles: int = 1, bulk: bool = False,
             glu: bool = False, tiled: bool = False, solo: bool = False, late: bool = False, cols: int = 1,
             xh: bool = False, out_f16: bool = False, l2pre: int = 0, ahead: int = 0) -> KernelBuilder:
    """y[r] = sum_k W[r, k] x[k] (+ bias[r]) (+ residual[r]) for r < out_dim, W in Q4_K, Q8_0 or Q6_K (in_dim
    a multiple of 2048) blocks, on tensor cores (exact int8 MMAs of the codes with x as four base-256 digits).
    ``tiles``: 16-row MMA tiles per warp (2: each x digit fragment and weight-scale step serves 32 rows);
    ``bulk`` (sm_90; not Q6_K): the ring is filled by bulk copies (one per row and unit) instead of cp.async.
    ``glu`` (tiles=2): W is [gate; up] (2 out_dim rows) and y[o] = silu(gate_o . x) * (up_o . x); each
    warp's 32 rows are 16 gate rows and the 16 up rows of the same outputs.
    ``tiled``: W is stored tile-major (:func:`tile_major`; any in_dim multiple of 256, bulk copies for
    Q6_K too); ``solo``: shared memory raised to ``SOLO_SMEM`` so that one CTA holds an SM; ``ahead``
    (1..stages - 1, one column): only that many ring stages are requested before the grid wait, the
    others right after x's first loads.
    ``cols`` (1..8), ``xh``, ``out_f16``: the columns kernel (:mod:`~ptx_gen.kernels.gemv.gemv_mma_cols`):
    Y[c] = W X[c] (+ bias) (+ residual[c]) for c < cols, x's columns ``ldx`` values apart (f16 with ``xh``),
    y's and the residual's ``ldy`` apart (y f16 with ``out_f16``; the residual f32); any of the three
    selects it, and it adds the parameters ``ldx`` and ``ldy``.
    Launch: grid ceil(out_dim / (16 tiles mtiles)), block 32 mtiles kparts, meta["dyn_smem"] dynamic shared
    bytes."""
    return build(m, wtype, in_dim, mtiles, kparts, stages, bias, residual, tiles, bulk, glu, tiled, solo, late, cols,
                 xh, out_f16, l2pre, ahead)