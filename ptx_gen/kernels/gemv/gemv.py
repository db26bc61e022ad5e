"""GEMV ``y = W x (+ bias) (+ residual)`` with W in GGUF block form, for decode.

Weights are read exactly once, as 16-byte coalesced ``ld.global.nc.L1::no_allocate.v4`` loads of the
raw row bytes, staged per warp in shared memory (so blocks of 18, 34 or 210 bytes at any even
alignment decode the same way), then decoded there (see :mod:`ptx_gen.kernels.gemv.quant_layout`). x (f32)
is read through L1 as two float4 per lane per round; y is f32.

Work split: a CTA has ``warps`` warps; each warp owns ``rows`` consecutive output rows and walks the
whole row, a *tile* of ``RPT`` rounds (256 values each) at a time: all 32 lanes load the tile's
bytes of every one of its rows (several independent 16-byte loads per lane), store them to the warp's
staging buffers, synchronise (``bar.warp.sync``), then *start loading the next tile into the same
registers* and decode the staged one meanwhile (a two-stage software pipeline: each warp keeps its
loads in flight through its own compute). Each lane decodes its 8 values per round per row and FMAs
them with x (loaded once per round, used for all rows). At the end a butterfly reduction gives each
row's sum; lane 0 adds bias/residual and stores. Grid: ``ceil(out_dim / (rows * warps))`` CTAs of
``32 * warps``. Variants: ``glu`` (rows of [gate; up], silu(g) * u epilogue) and the prefill GEMM
(``tokens`` x vectors per CTA on grid.y, each weight round decoded once for all of them).

Split-K (``ksplit`` > 1, GEMV only): the CTA's warps form ``warps / ksplit`` groups; the warps of a
group own the same ``rows`` rows and each walks one K *slice* of them (:func:`split`), so a
4096 x 14336 GEMV has 4-8x the warps, each walking a few tiles instead of 56 rounds. A slice of at
most ``SPLIT_TILE_BYTES`` per row is one tile, copied with ``cp.async`` straight into shared memory
(every load in flight at once, no registers held, no stores); a longer one is walked with the
register pipeline above. Each warp reduces its rows' partial sums, lane 0 writes them to shared
memory, one ``bar.sync``, and lane ``o`` of the group's first warp adds the ``ksplit`` partials of
output ``o`` in slice order (deterministic) and applies the epilogue. There is no early exit (every
warp reaches the barrier): rows past ``out_dim`` are clamped for loads and not stored.

Rows: ``row r`` starts at byte ``r * row_bytes`` of ``w`` (``w`` 16-byte aligned, and the allocation
rounded up to a multiple of 16 bytes: loads are whole 16-byte vectors). ``in_dim`` is a generation
parameter; ``out_dim`` is a runtime argument. ``residual`` may alias ``y`` (in-place ``h += W x``).

The walk over K (staging, decoding, the pipeline) is :mod:`ptx_gen.kernels.gemv.gemv_tiles`; this module
emits the rest of the kernel around it (the warp's coordinates, the split into K slices, the epilogues).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.gemv import quant_layout as ql
from ptx_gen.kernels.gemv.gemv_plan import (
    KSPLITS,
    L1_MARGIN,
    MAX_STATIC_SMEM,
    TILE_ROUNDS,
    plan,
    shared_bytes,
    slice_plans,
    split,
    tiles_per_slice,
)
from ptx_gen.kernels.gemv.gemv_tiles import k_table_constants, row_contexts, walk_tiles
from ptx_gen.kernels.gemv.quant_layout import K_TABLE, type_info

# The planning lives in gemv_plan; the GEMV launch policy and tools take it from here.
__all__ = ["gemv", "gemm", "gemv_expert_rows", "build", "gemv_params", "plan", "split", "shared_bytes", "tiles_per_slice",
           "KSPLITS", "MAX_STATIC_SMEM", "TILE_ROUNDS"]


def _grid_shapes() -> list[dict]:
    shapes = []
    for wt in ql.WEIGHT_TYPES:
        dims = [256, 4096] if wt in ql.K_QUANTS else [64, 576, 4096]
        for d in dims:
            shapes.append({"wtype": wt, "in_dim": d})
    shapes += [{"wtype": "Q8_0", "in_dim": 1536, "rows": 1, "bias": True},
               {"wtype": "Q4_1", "in_dim": 576, "rows": 2, "glu": True},
               {"wtype": "Q4_K", "in_dim": 4096, "rows": 4, "glu": True},
               {"wtype": "Q4_K", "in_dim": 14336, "rows": 2, "residual": True},
               {"wtype": "Q6_K", "in_dim": 1536, "rows": 4, "bias": True, "residual": True},
               {"wtype": "Q4_K", "in_dim": 14336, "rows": 2, "warps": 4, "ksplit": 4, "residual": True},
               {"wtype": "Q6_K", "in_dim": 14336, "rows": 2, "warps": 8, "ksplit": 8},
               {"wtype": "Q8_0", "in_dim": 4096, "rows": 2, "warps": 4, "ksplit": 2, "glu": True},
               {"wtype": "Q8_0", "in_dim": 576, "rows": 3, "warps": 4, "ksplit": 4, "bias": True}]
    return shapes


def _store_out(k: KernelBuilder, val: Reg, r: Reg, idx: Reg, bias: bool, residual: bool) -> None:
    """y[idx] = val (+ bias[r]) (+ residual[idx]); residual may be y itself (read before written by the
    same thread)."""
    off = k.mul_wide(idx, 4)
    if bias:
        val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(r, 4))))
    if residual:
        val = k.add(val, k.load("global", "f32", k.add(k.global_ptr("residual"), off)))
    k.store("global", "f32", k.add(k.global_ptr("y"), off), val)


def silu_mul(k: KernelBuilder, g: Reg, u: Reg) -> Reg:
    """silu(g) * u = g / (1 + 2**(-g log2 e)) * u (the GLU epilogue)."""
    e = k.ex2(k.mul(g, -1.4426950408889634))
    return k.mul(k.div(g, k.add(e, 1.0)), u)  # silu(g) * u


def gemv_params(bias: bool, residual: bool) -> list[tuple[str, str]]:
    """The GEMV kernels' parameters: w, x, y (, bias) (, residual), out_dim."""
    return ([("w", "u64"), ("x", "u64"), ("y", "u64")] + ([("bias", "u64")] if bias else [])
            + ([("residual", "u64")] if residual else []) + [("out_dim", "u32")])


def _check_shape(rows: int, warps: int, glu: bool, bias: bool, residual: bool, tokens: int, ksplit: int) -> None:
    """Rejects the shapes :func:`build` cannot emit (emits nothing)."""
    if rows not in (1, 2, 3, 4) or warps not in (1, 2, 4, 8):
        raise ValueError(f"rows must be 1..4 and warps 1, 2, 4 or 8; got rows={rows}, warps={warps}")
    if glu and (rows % 2 or bias or residual):
        raise ValueError("glu needs an even number of rows per warp and no bias/residual")
    if tokens < 0 or tokens > 8 or rows * tokens > 8:
        raise ValueError(f"tokens (per CTA) must be 0 (GEMV) or 1..8 with rows * tokens <= 8 (registers); "
                         f"got tokens={tokens}, rows={rows}")
    if ksplit > warps or (tokens and ksplit > 1):
        raise ValueError(f"ksplit must divide warps (and be 1 for the GEMM); got ksplit={ksplit}, warps={warps}, "
                         f"tokens={tokens}")


@dataclass
class _Setup:
    """The registers :func:`_prologue` emits for the rest of :func:`build`."""
    out_dim: Reg
    row0: Reg  # the warp's first output
    s: Reg | None  # the warp's K slice (ksplit > 1)
    done_label: object  # the early exit of warps past out_dim (ksplit == 1)
    w: Reg
    x: Reg
    wbase: Reg  # the warp's staging area in shared memory
    last: Reg  # out_dim - 1
    xs: list  # the x rows (one per token)
    lc: dict  # the lane's decode constants


def _prologue(k: KernelBuilder, name: str, wtype: str, in_dim: int, warps: int, rows: int, tokens: int, ksplit: int,
              outs_per_warp: int, per_row: int, nt: int, expert: bool = False) -> _Setup:
    """Emits the warp's coordinates and first output (with ksplit == 1 the warp-uniform early exit of
    warps past out_dim), its staging area in shared memory, the global pointers, the token tile's x
    rows (GEMM) and the lane's decode constants."""
    groups = warps // ksplit
    s = done_label = None
    out_dim = k.param("out_dim")
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    if ksplit == 1:
        row0 = k.mul(k.mad(k.ctaid(), warps, warp), outs_per_warp)
        done_label = k.new_label("done")
        k.bra(done_label, k.setp("ge", row0, out_dim), uniform=True)
    else:  # no early exit: every warp must reach the bar.sync (rows past the end are clamped, not stored)
        s = k.and_(warp, ksplit - 1)
        row0 = k.mul(k.mad(k.ctaid(), groups, k.shr(warp, ksplit.bit_length() - 1)), outs_per_warp)
    smem = k.shared_array(f"{name}_stage", "u8", per_row * rows * warps)
    wbase = k.add(smem, k.mul(warp, per_row * rows))
    w, x = k.global_ptr("w"), k.global_ptr("x")
    if expert:  # grid.y over rows: row r multiplies the expert experts[r] names (written by the kernel before:
        # wait first), reads x row r / x_group and writes y row r
        r = k.ctaid("y")
        k.grid_dependency_wait()
        eid = k.load("global", "u32", k.add(k.global_ptr("experts"), k.mul_wide(r, 4)))
        w = k.add(w, k.mul_wide(eid, k.param("expert_bytes")))
        x = k.add(x, k.mul_wide(k.mul(k.div(r, k.param("x_group")), k.param("x_stride")), 4))
        k.rebase_ptr("y", k.mul_wide(k.mul(r, k.param("y_stride")), 4))
    k.global_ptr("y")  # converted once, up front: every store of the epilogue reuses it
    last = k.sub(out_dim, 1)
    # token tile: x rows m0 .. m0 + nt - 1 (clamped for loads; stores are guarded)
    if tokens:
        n_tok = k.param("n_tokens")
        m0 = k.mul(k.ctaid("y"), nt)
        last_tok = k.sub(n_tok, 1)
        tok = [k.min(k.add(m0, j), last_tok) if j else k.min(m0, last_tok) for j in range(nt)]
        xs = [k.add(x, k.mul_wide(tk, in_dim * 4)) for tk in tok]
    else:
        xs = [x]
    lc = ql.lane_constants(k, wtype, lane)
    if wtype in K_TABLE:
        lc.update(k_table_constants(k, lane))
    return _Setup(out_dim, row0, s, done_label, w, x, wbase, last, xs, lc)


def build(m: Module, wtype: str, in_dim: int, rows: int, warps: int, bias: bool, residual: bool,
          tokens: int = 0, glu: bool = False, ksplit: int = 1, expert: bool = False) -> KernelBuilder:
    """The GEMV (``tokens == 0``: one x vector) or the token-tiled GEMM (``tokens`` x vectors per CTA,
    grid.y over token tiles). With ``glu`` the weight holds ``2 * out_dim`` rows (gate rows, then up
    rows) and ``y[o] = silu(gate_o . x) * (up_o . x)``. With ``ksplit > 1`` (GEMV only) the CTA's warps
    form ``warps / ksplit`` groups; the ``ksplit`` warps of a group own the same rows and each walks one
    K slice of them; the slices' row sums meet in shared memory (one ``bar.sync``) and the group's
    first warp applies the epilogue, one output per lane."""
    sp = split(wtype, in_dim, ksplit)
    _check_shape(rows, warps, glu, bias, residual, tokens, ksplit)
    info = type_info(wtype)
    row_bytes = info.row_bytes(in_dim)
    p_full, p_last = slice_plans(wtype, sp)
    plans = [p for p in (p_full, p_last) if p is not None]
    params = gemv_params(bias, residual)
    if tokens:
        params.append(("n_tokens", "u32"))
    if expert:
        params += [("experts", "u64"), ("expert_bytes", "u32"), ("x_group", "u32"), ("x_stride", "u32"),
                   ("y_stride", "u32")]
    kind = "gemm" if tokens else "gemv"
    name = (f"{kind}_{wtype.lower()}_k{in_dim}_r{rows}_w{warps}" + (f"_s{ksplit}" if ksplit > 1 else "")
            + (f"_t{tokens}" if tokens else "") + ("_glu" if glu else "") + ("_bias" if bias else "")
            + ("_res" if residual else "") + ("_exprows" if expert else ""))
    # no .maxntid: with it ptxas aims at an occupancy of its own and spills a few bytes in some variants
    # (e.g. 64 registers for Q4_0 at 4352); without it the same kernels take <= ~100 registers, no spills
    k = m.kernel(name, params)
    stage = max(p["stage"] for p in plans)
    per_row = stage + max(p["table"] for p in plans)
    smem_bytes = shared_bytes(wtype, in_dim, rows, warps, ksplit)
    if smem_bytes > MAX_STATIC_SMEM:
        raise ValueError(f"{wtype} rows of {in_dim} with rows={rows}, warps={warps}, ksplit={ksplit} need "
                         f"{smem_bytes} bytes of shared memory, more than {MAX_STATIC_SMEM}: use fewer rows or warps "
                         f"(or a larger ksplit)")
    outs_per_warp = rows // 2 if glu else rows
    groups = warps // ksplit
    k.meta.update(block=32 * warps, rows_per_cta=outs_per_warp * groups, tokens_per_cta=max(tokens, 1),
                  smem=smem_bytes, row_bytes=row_bytes, ksplit=ksplit)
    if ksplit > 1:
        # every warp re-reads its slice of x through L1 (x_bytes per weight byte: 4 / (rows * bytes per
        # value), several times the weights): the launcher keeps L1 at least this large (a shared-memory
        # carveout preference) so x stays cached however many of these CTAs share an SM
        k.meta["l1_bytes"] = 4 * in_dim + L1_MARGIN
    nt = max(tokens, 1)

    g = _prologue(k, name, wtype, in_dim, warps, rows, tokens, ksplit, outs_per_warp, per_row, nt, expert)
    out_dim, x, s, lc = g.out_dim, g.x, g.s, g.lc
    ctx_args = (wtype, rows, glu, g.row0, g.last, out_dim, g.w, g.wbase, per_row, stage, lc, nt, row_bytes)

    accs = _accumulate(k, p_full, p_last, sp, wtype, rows, ksplit, ctx_args, lc, g.xs, x, s)

    totals = [[k.warp_reduce(a) for a in acc] for acc in accs]
    # recompute the indices rather than keep them live across the loop (ptxas otherwise may spill them)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    if ksplit > 1:
        _combine_slices(k, name, totals, lane, warp, rows, warps, ksplit, outs_per_warp, glu, bias, residual)
        k.ret()
        return k
    _store_rows(k, totals, lane, warp, warps, outs_per_warp, nt, tokens, glu, out_dim, bias, residual)
    k.label(g.done_label)
    k.ret()
    return k


def _accumulate(k: KernelBuilder, p_full: dict, p_last: dict | None, sp: dict, wtype: str, rows: int, ksplit: int,
                ctx_args: tuple, lc: dict, xs: list, x: Reg, s: Reg | None) -> list:
    """Emits the walk over K: the warp's rows over all of K (ksplit == 1), or over its K slice, with
    warp-uniform branches for the full slices, the short last slice and idle warps. Returns the rows'
    accumulators ([row][token])."""
    if ksplit == 1:
        row_ctx, sels = row_contexts(k, p_full, *ctx_args)
        walk_tiles(k, p_full, wtype, row_ctx, lc, sels, xs)
        return [row.acc for row in row_ctx]
    else:
        accs = [[k.var("f32", 0.0)] for _ in range(rows)]

        def walk_slice(p: dict) -> None:
            off = k.mul_wide(s, sp["slice_bytes"])
            xsl = [k.add(x, k.mul_wide(s, sp["slice_vals"] * 4))]
            row_ctx, sels = row_contexts(k, p, *ctx_args, offset=off, accs=accs)
            walk_tiles(k, p, wtype, row_ctx, lc, sels, xsl, copy_async=True)

        if sp["n_full"] == ksplit:
            walk_slice(p_full)
        else:  # warp-uniform branches (bra.uni: ptxas then needs no reconvergence code for the warp
            # collectives inside): full slices, the short last slice; idle warps skip both
            after_full = k.new_label("after_full")
            k.bra(after_full, k.setp("ge", s, sp["n_full"]), uniform=True)
            walk_slice(p_full)
            k.label(after_full)
            if p_last is not None:
                after_last = k.new_label("after_last")
                k.bra(after_last, k.setp("ne", s, sp["n_full"]), uniform=True)
                walk_slice(p_last)
                k.label(after_last)
            k.grid_dependency_wait()  # (the idle warps', before the epilogue; a second wait is a no-op)

    return accs


def _store_rows(k: KernelBuilder, totals: list, lane: Reg, warp: Reg, warps: int, outs_per_warp: int, nt: int,
                tokens: int, glu: bool, out_dim: Reg, bias: bool, residual: bool) -> None:
    """Emits the one-slice epilogue: lane 0 stores each of the warp's outputs (per token; silu(g) * u
    with glu) for rows < out_dim (and tokens < n_tokens), + bias/residual."""
    row0 = k.mul(k.mad(k.ctaid(), warps, warp), outs_per_warp)
    if tokens:
        m0 = k.mul(k.ctaid("y"), nt)
    is_lane0 = k.setp("eq", lane, 0)
    for o in range(outs_per_warp):
        r = k.add(row0, o) if o else row0
        ok_row = k.and_(is_lane0, k.setp("lt", r, out_dim))
        for j in range(nt):
            if glu:
                val = silu_mul(k, totals[o][j], totals[o + outs_per_warp][j])
            else:
                val = totals[o][j]
            ok = ok_row
            if tokens:
                mj = k.add(m0, j) if j else m0
                ok = k.and_(ok_row, k.setp("lt", mj, k.param("n_tokens")))
                idx = k.mad(mj, out_dim, r)
            else:
                idx = r
            with k.if_(ok):
                _store_out(k, val, r, idx, bias, residual)


def _combine_slices(k: KernelBuilder, name: str, totals: list, lane: Reg, warp: Reg, rows: int, warps: int,
                    ksplit: int, outs_per_warp: int, glu: bool, bias: bool, residual: bool) -> None:
    """Split-K epilogue: lane 0 of every warp writes its slice's row sums to ``red[warp][row]``; after
    one ``bar.sync`` lane ``o`` of each group's first warp adds the group's ``ksplit`` partial sums of
    its output ``o`` (in slice order: deterministic) and applies bias/residual (or silu(g) * u)."""
    red = k.shared_array(f"{name}_red", "f32", rows * warps, align=16)
    mine = k.add(red, k.mul(warp, 4 * rows))
    vals = [t[0] for t in totals]
    with k.if_(k.setp("eq", lane, 0)):
        if rows in (2, 4):
            k.store("shared", "f32", mine, vals)
        else:
            for rr, v in enumerate(vals):
                k.store("shared", "f32", mine, v, 4 * rr)
    k.bar_sync()
    out_dim = k.param("out_dim")
    groups = warps // ksplit
    group = k.shr(warp, ksplit.bit_length() - 1)
    r = k.add(k.mul(k.mad(k.ctaid(), groups, group), outs_per_warp), lane)
    first = k.setp("eq", k.and_(warp, ksplit - 1), 0)
    ok = k.and_(k.and_(first, k.setp("lt", lane, outs_per_warp)), k.setp("lt", r, out_dim))
    with k.if_(ok):
        src = k.add(mine, k.shl(lane, 2))  # red[warp + s][lane] for s < ksplit

        def partial_sum(extra: int) -> Reg:
            acc = k.load("shared", "f32", src, extra)
            for sl in range(1, ksplit):
                acc = k.add(acc, k.load("shared", "f32", src, sl * 4 * rows + extra))
            return acc

        if glu:
            val = silu_mul(k, partial_sum(0), partial_sum(4 * outs_per_warp))
        else:
            val = partial_sum(0)
        _store_out(k, val, r, r, bias, residual)


@kernel("gemv", grid=_grid_shapes())
def gemv(m: Module, wtype: str = "Q8_0", in_dim: int = 4096, rows: int = 2, warps: int = 4,
         bias: bool = False, residual: bool = False, glu: bool = False, ksplit: int = 1) -> KernelBuilder:
    """y[r] = sum_k W[r, k] x[k] (+ bias[r]) (+ residual[r]) for r < out_dim; W in GGUF block form
    (``wtype``: F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K), x/y/bias/residual f32.
    With ``glu``: W is [gate; up] (2 out_dim rows) and y[r] = silu(gate_r . x) * (up_r . x).
    ``ksplit`` (1, 2, 4, 8; divides ``warps``): warps per row group, each summing one K slice.
    Launch: grid ceil(out_dim / meta["rows_per_cta"]), block meta["block"], no dynamic shared memory."""
    return build(m, wtype, in_dim, rows, warps, bias, residual, tokens=0, glu=glu, ksplit=ksplit)


@kernel("gemv_expert_rows", grid=[{"wtype": "Q4_K", "in_dim": 2048, "rows": 2, "glu": True},
                                  {"wtype": "Q8_0", "in_dim": 768, "rows": 2, "warps": 4, "ksplit": 2},
                                  {"wtype": "F32", "in_dim": 64, "rows": 2, "warps": 2, "glu": True},
                                  {"wtype": "Q4_0", "in_dim": 576, "rows": 1, "warps": 8}])
def gemv_expert_rows(m: Module, wtype: str = "Q8_0", in_dim: int = 4096, rows: int = 2, warps: int = 4,
                     glu: bool = False, ksplit: int = 1) -> KernelBuilder:
    """The GEMV of ``gemv`` through a stack of experts' matrices (``expert_bytes`` apart), many rows in one launch:
    grid.y over rows; row i multiplies the expert ``experts[i]`` names (u32 device memory: a graph stays the same
    whatever the router chose), reads x at ``x + (i / x_group) * x_stride`` and writes y at ``y + i * y_stride``
    (floats). Params w, x, y, out_dim, experts, expert_bytes, x_group, x_stride, y_stride. A mixture-of-experts
    layer's ``rows`` tokens x ``used`` chosen experts: the [gate; up] GEMV with ``x_group = used`` (a token's
    experts share its x), the down GEMV with ``x_group = 1``.
    Launch: grid (ceil(out_dim / meta["rows_per_cta"]), rows), block meta["block"]."""
    return build(m, wtype, in_dim, rows, warps, False, False, tokens=0, glu=glu, ksplit=ksplit, expert=True)


@kernel("gemm", grid=[{"wtype": wt, "in_dim": 256 if wt in ql.K_QUANTS else 576, "tokens": 4}
                      for wt in ql.WEIGHT_TYPES] + [{"wtype": "Q4_K", "in_dim": 4096, "tokens": 8, "rows": 1},
                                                    {"wtype": "Q8_0", "in_dim": 4096, "tokens": 2, "glu": True}])
def gemm(m: Module, wtype: str = "Q8_0", in_dim: int = 4096, rows: int = 2, warps: int = 4, tokens: int = 4,
         bias: bool = False, residual: bool = False, glu: bool = False) -> KernelBuilder:
    """Batched (prefill) Y[t, r] = sum_k W[r, k] X[t, k] (+ bias[r]) (+ residual[t, r]) for t < n_tokens,
    X [n_tokens, in_dim] and Y [n_tokens, out_dim] row-major f32: the GEMV with ``tokens`` x rows per
    CTA (each weight round is decoded once and used for all of them). ``glu`` as for gemv.
    Launch: grid (ceil(out_dim / meta["rows_per_cta"]), ceil(n_tokens / tokens)), block meta["block"]."""
    return build(m, wtype, in_dim, rows, warps, bias, residual, tokens=tokens, glu=glu)
