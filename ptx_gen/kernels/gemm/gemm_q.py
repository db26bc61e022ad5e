"""Small-M GEMM straight from the quantized weights: ``Y[M, N] = X[M, K] W[N, K]^T`` for the batched decode
step (M = 1..128 tokens), W the GGUF weight exactly as the decode GEMV reads it (GGUF rows, tile-major
"tiles" or "glu-tiles", see :func:`ptx_gen.kernels.gemv.gemv_mma_layout.tile_major`), X f16 row-major (row
stride ``lda``), f32 accumulation on tensor cores (``mma.sync.m16n8k16`` f16).

**Work split.** A warp owns 16 weight rows (the MMA's A operand: 16 rows) and all ``mt`` tokens of the
launch's token tile (``mt / 8`` MMA column tiles), so each weight byte is read from DRAM once per launch
whatever M. A CTA holds ``warps`` such row strips and ``kparts`` warps per strip, each walking one part of
K; the parts are summed through shared memory at the end. K is walked in *chunks* of 256 values (a
round of the GEMV: one K-quant block, eight 32-value blocks, 256 dense values).

**Weights.** Per chunk a warp copies the bytes of its 16 rows' chunk (one *segment* per row) into a ring
of ``stages`` shared-memory slots with ``cp.async`` (two lanes per segment, 16-byte pieces at 32-byte
steps; a segment not 16-byte aligned, Q6_K's 210-byte rounds or rows of 32-value blocks whose length is
no multiple of 256, is copied from its aligned start and read at its phase; a tile-major Q6_K segment is
its row's 208 aligned bytes and the 16 bytes of its half-tile that hold the row's d). The ring runs
``stages - 1`` chunks ahead of the decoding, so a warp keeps that many chunks of bytes in flight.

**Decoding into the A fragments.** The MMA sums over k in any order, as long as A and B agree. Lane
``l`` (``r = l / 4``, ``q = l % 4``) takes, for each 32-value k block ``b`` of a chunk, values
``32 b + 8 q .. + 7`` of rows ``r`` and ``r + 8`` (decoded by the per-type block decoders of
:mod:`ptx_gen.kernels.gemv.quant_layout`, the same lane split the dequantization uses within a block) and
the same 8 k of tokens ``r`` of each column tile, one 16-byte load of X. Its first two k pairs are
the k pairs ``2q``, ``2q + 8`` of one m16n8k16 step and the last two those of a second step: no shuffle,
no shared-memory round trip of the decoded weights. Values are formed in f32 as ``A f + C`` from the
decoded codes (scale terms of GGUF's dequantization) and rounded to f16 (nearest even): the MMA
multiplies exactly these f16 weights and f16 X, accumulating in f32.

**Edges.** Tokens past M read the last token's row (their columns are never written); rows past N are
not copied (their garbage stays in their own output rows, never written); K past the weight's length
(32-value block types or dense rows of a length that is no multiple of 256) reads zeros of X, and the
weight values there are zeroed (copies zero-filled, blocks past the row's end masked).

Epilogue per output ``Y[t, c]`` (f32 or f16 with ``out_f16``, row stride ``ldy``): ``+ bias[c]``,
``+ residual[t, c]`` (may be Y itself: one thread reads and writes each element). ``glu``: W is [gate;
up] (``2 ffn`` rows; GGUF rows or "glu-tiles") and a warp's MMA rows 0-7 are gate rows ``j0 .. j0 + 7``,
rows 8-15 the up rows of the same outputs, so one lane holds both: ``Y[t, j] = silu(gate) * up``.

Params: w, x, y, [bias], [residual], m (tokens, 1..mt), n (weight rows), lda, ldy. Requirements: X
16-byte aligned with ``lda`` a multiple of 8; the weight's bytes below 2**32. Launch: grid
``ceil(rows_out / meta["rows_per_cta"])`` (rows_out = n, or n / 2 with glu), block ``meta["block"]``,
dynamic shared memory ``meta["dyn_smem"]``.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.dequant.dequant import check_weight_layout
from ptx_gen.kernels.elementwise.elementwise import silu
from ptx_gen.kernels.gemm.signature import epilogue_signature
from ptx_gen.kernels.gemm.qstream import CHUNK, TABLE, WeightStream, aligned, chunk_bytes, pieces, seg_bytes
from ptx_gen.kernels.gemv.gemv_mma_layout import MMA_TYPES
from ptx_gen.kernels.gemv.quant_layout import K_TABLE

__all__ = ["CHUNK", "MTS", "aligned", "check_shape", "chunk_bytes", "gemm_q", "pieces", "seg_bytes", "smem_bytes"]

MTS = (8, 16, 32, 64, 128)
MAX_DYN_SMEM = 227 * 1024
X_GROUP = 4  # column tiles whose X a lane loads at once


def smem_bytes(wtype: str, in_dim: int, layout: str, mt: int, warps: int, kparts: int, stages: int) -> int:
    per_warp = stages * 16 * seg_bytes(wtype, in_dim, layout) + (TABLE if wtype in K_TABLE else 0)
    red = (kparts - 1) * warps * mt * 64
    return max(per_warp * warps * kparts, red)


def check_shape(wtype: str, in_dim: int, layout: str, mt: int, warps: int, kparts: int, stages: int) -> None:
    check_weight_layout(wtype, in_dim, layout)
    if mt not in MTS:
        raise ValueError(f"mt (tokens per launch tile) must be one of {MTS}, got {mt}")
    if warps not in (1, 2, 4, 8) or kparts not in (1, 2, 4, 8) or warps * kparts > 16:
        raise ValueError(f"warps and kparts must be 1, 2, 4 or 8 with at most 16 warps, got {warps} x {kparts}")
    if not 2 <= stages <= 8:
        raise ValueError(f"stages must be 2..8, got {stages}")
    nc = -(-in_dim // CHUNK)
    if kparts > nc:
        raise ValueError(f"{kparts} K parts for {nc} chunks of {CHUNK}: use fewer parts")
    smem = smem_bytes(wtype, in_dim, layout, mt, warps, kparts, stages)
    if smem > MAX_DYN_SMEM:
        raise ValueError(f"{wtype} mt={mt} warps={warps} kparts={kparts} stages={stages} needs {smem} bytes of "
                         f"shared memory, more than {MAX_DYN_SMEM}")


def _grid() -> list[dict]:
    g = []
    for wt in ("Q4_K", "Q6_K", "Q8_0", "Q4_1", "Q4_0", "Q5_K"):
        lay = "tiles" if wt in MMA_TYPES else "rows"
        g.append({"wtype": wt, "in_dim": 4096, "layout": "rows", "mt": 8})
        g.append({"wtype": wt, "in_dim": 4096, "layout": lay, "mt": 64, "warps": 4, "kparts": 2, "residual": True})
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "mt": 32, "glu": True, "out_f16": True})
        g.append({"wtype": wt, "in_dim": 14336, "layout": lay, "mt": 128, "warps": 2, "kparts": 1, "stages": 3})
    for wt in ("F32", "F16", "BF16", "Q5_0", "Q5_1"):  # (F32's 4-stage ring of 4 warps needs 260 KB)
        g.append({"wtype": wt, "in_dim": 576, "mt": 16, "bias": True, **({"stages": 2} if wt == "F32" else {})})
    return g


@kernel("gemm_q", grid=_grid())
def gemm_q(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, layout: str = "rows", mt: int = 8, warps: int = 4,
           kparts: int = 1, stages: int = 4, bias: bool = False, residual: bool = False, out_f16: bool = False,
           glu: bool = False) -> KernelBuilder:
    """Y[:m] = X[:m] W^T (+ bias) (+ residual), or with ``glu`` silu(X G^T) * (X U^T) for W = [gate; up];
    W of ``wtype`` in ``layout``, X f16, f32 accumulation. Params: w, x, y, [bias], [residual], m, n, lda,
    ldy. Launch: grid ceil(rows_out / meta["rows_per_cta"]), block meta["block"], dyn_smem meta["dyn_smem"]."""
    return build(m, wtype, in_dim, layout, mt, warps, kparts, stages, bias, residual, out_f16, glu, experts=False)


def _expert_grid() -> list[dict]:
    return [{"wtype": "Q4_K", "in_dim": 2048, "mt": 16, "glu": True, "out_f16": True},
            {"wtype": "Q4_K", "in_dim": 768, "mt": 32, "warps": 4, "kparts": 1, "stages": 2},
            {"wtype": "Q8_0", "in_dim": 4096, "mt": 8, "glu": True, "out_f16": True},
            {"wtype": "Q6_K", "in_dim": 768, "mt": 64, "warps": 2, "kparts": 2, "stages": 2},
            {"wtype": "F16", "in_dim": 576, "mt": 8}]


@kernel("gemm_q_experts", grid=_expert_grid())
def gemm_q_experts(m: Module, wtype: str = "Q4_K", in_dim: int = 2048, mt: int = 16, warps: int = 4, kparts: int = 1,
                   stages: int = 4, out_f16: bool = False, glu: bool = False) -> KernelBuilder:
    """``gemm_q`` over a stack of experts' matrices (GGUF rows, ``expert_bytes`` apart) for a mixture-of-experts
    layer's (token, chosen expert) pairs grouped by expert (:func:`ptx_gen.kernels.moe.group.moe_group`): CTA row
    ``ctaid.y`` takes the tile record ``tiles[ctaid.y]`` (u32 ``start``, u32 ``expert << 8 | count``; count 0:
    nothing to do), multiplies the expert's W by X rows ``order[start + j] / x_group`` (j < count) and writes
    Y rows ``order[start + j]``. Params: w, x, y, tiles, order, n (one expert's rows), lda, ldy, expert_bytes
    (a multiple of 16: the copies are 16-byte pieces from the expert's start), x_group. Launch: grid
    (ceil(rows_out / meta["rows_per_cta"]), tile records), block meta["block"], dyn_smem meta["dyn_smem"]."""
    return build(m, wtype, in_dim, "rows", mt, warps, kparts, stages, False, False, out_f16, glu, experts=True)


def build(m: Module, wtype: str, in_dim: int, layout: str, mt: int, warps: int, kparts: int, stages: int,
          bias: bool, residual: bool, out_f16: bool, glu: bool, experts: bool) -> KernelBuilder:
    """The kernel of :func:`gemm_q` (``experts``: of :func:`gemm_q_experts`)."""
    check_shape(wtype, in_dim, layout, mt, warps, kparts, stages)
    flags, params = epilogue_signature(["w", "x", "y"], [] if experts else ["m", "n", "lda", "ldy"], bias=bias,
                                       residual=residual, out_f16=out_f16, glu=glu, layout=layout)
    name = (f"gemm_q{'_exp' if experts else ''}_{wtype.lower()}_k{in_dim}_{layout.replace('-', '_')}_m{mt}_w{warps}x"
            f"{kparts}_s{stages}{flags}")
    if experts:
        params += [("tiles", "u64"), ("order", "u64"), ("n", "u32"), ("lda", "u32"), ("ldy", "u32"),
                   ("expert_bytes", "u32"), ("x_group", "u32")]
    threads = 32 * warps * kparts
    k = m.kernel(name, params, max_threads=threads)
    seg = seg_bytes(wtype, in_dim, layout)
    slot_bytes = 16 * seg
    warp_bytes = stages * slot_bytes + (TABLE if wtype in K_TABLE else 0)
    smem = smem_bytes(wtype, in_dim, layout, mt, warps, kparts, stages)
    per_warp_rows = 8 if glu else 16
    k.meta.update(block=threads, dyn_smem=smem, rows_per_cta=per_warp_rows * warps, mt=mt)

    nc = -(-in_dim // CHUNK)
    tail = in_dim - (nc - 1) * CHUNK  # values of the last chunk

    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    mw, kp = (k.and_(warp, warps - 1), k.shr(warp, warps.bit_length() - 1)) if kparts > 1 else (warp, None)
    r, q = k.shr(lane, 2), k.and_(lane, 3)
    n_rows = k.param("n")
    order = exit_ = None
    if experts:  # the tile record (written by the kernel before: wait first) names the expert and its tokens
        k.grid_dependency_wait()
        rec = k.add(k.global_ptr("tiles"), k.mul_wide(k.ctaid("y"), 8))
        t_start, t_word = k.load("global", "u32", rec), k.load("global", "u32", rec, 4)
        m_tok = k.and_(t_word, 0xFF)
        exit_ = k.new_label("idle")
        k.bra(exit_, k.setp("eq", m_tok, 0), uniform=True)
        k.rebase_ptr("w", k.mul_wide(k.shr(t_word, 8), k.param("expert_bytes")))
        order = k.add(k.global_ptr("order"), k.mul_wide(t_start, 4))
    else:
        m_tok = k.param("m")
    strip = k.mad(k.ctaid(), warps, mw)
    smem0 = k.dynamic_shared()
    wbase = k.add(smem0, k.mul(warp, warp_bytes))
    ws = WeightStream(k, wtype, in_dim, layout, glu, lane, r, strip, n_rows)

    # the warp's chunk range
    if kparts > 1 and nc % kparts == 0:
        c_first = k.mul(kp, nc // kparts)
        n_my = k.mov(nc // kparts, "u32")
    elif kparts > 1:
        c_first = k.div(k.mul(kp, nc), kparts)
        c_end = k.div(k.mul(k.add(kp, 1), nc), kparts)
        n_my = k.sub(c_end, c_first)
    else:
        c_first = k.mov(0, "u32")
        n_my = k.mov(nc, "u32")
    ws.decode_setup(lane, q)
    q8 = ws.q8

    # ---- X: lane's 8 k of token 8 t + r (clamped to m - 1) ----
    x_ptr = k.add(k.global_ptr("x"), k.cvt(k.shl(q, 4), "u64"))
    lda2 = k.shl(k.param("lda"), 1)
    m1 = k.sub(m_tok, 1)
    if experts:  # token j of the tile is the pair order[start + j], its X row pair / x_group
        x_group = k.param("x_group")
        toks = [k.min(k.add(r, 8 * t), m1) for t in range(mt // 8)]
        toks = [k.div(k.load("global", "u32", k.add(order, k.mul_wide(j, 4))), x_group) for j in toks]
        x_rows = [k.mul(j, lda2) for j in toks]
    else:
        x_rows = [k.mul(k.min(k.add(r, 8 * t), m1), lda2) for t in range(mt // 8)]  # (byte offsets below 2**32)

    acc = [[k.var("f32", 0.0) for _ in range(4)] for _ in range(mt // 8)]
    ring = stages * slot_bytes
    for s in range(stages - 1):
        ws.issue(c_first, n_my, k.mov(s, "u32"), k.add(wbase, s * slot_bytes) if s else wbase)
        k.cp_async_commit()
    if not experts:
        k.grid_dependency_wait()  # X (and the residual) come from the kernels before
    rd = k.var("u32", 0)
    wr = k.var("u32", (stages - 1) * slot_bytes)
    with k.loop(0, n_my) as i:
        k.cp_async_wait_group(stages - 2)
        k.bar_warp_sync()
        ws.issue(c_first, n_my, k.add(i, stages - 1), k.add(wbase, wr))
        k.cp_async_commit()
        slot = k.add(wbase, rd)
        c = k.add(c_first, i)
        ch = ws.prep(slot, c, (wbase, stages * slot_bytes))
        xc = k.add(x_ptr, k.mul_wide(c, 2 * CHUNK))
        for b in range(CHUNK // 32):
            _block(k, ws, ch, b, c, q8, xc, x_rows, acc, in_dim, tail)
        for v in (rd, wr):
            nxt = k.add(v, slot_bytes)
            k.assign(v, k.selp(0, nxt, k.setp("eq", nxt, ring), "u32"))
    k.cp_async_wait_all()

    if kparts > 1:  # sum the K parts through shared memory (over the ring, now unused)
        k.bar_sync()
        red = k.add(smem0, k.shl(lane, 2))
        part_bytes = mt * 64
        part = k.mad(k.sub(kp, 1), warps, mw)  # (kp = 0: wraps, unused)
        with k.if_(k.setp("ne", kp, 0)):
            base = k.add(red, k.mul(part, part_bytes))
            for t, a4 in enumerate(acc):
                for e, v in enumerate(a4):
                    k.store("shared", "f32", base, v, (4 * t + e) * 128)
        k.bar_sync()
        done = k.new_label("done")
        k.bra(done, k.setp("ne", kp, 0))  # (a fresh predicate: none stays live across the barrier)
        for p in range(1, kparts):
            base = k.add(red, k.mul(k.add(mw, (p - 1) * warps), part_bytes))
            for t, a4 in enumerate(acc):
                for e, v in enumerate(a4):
                    k.assign(v, k.add(v, k.load("shared", "f32", base, (4 * t + e) * 128)))
    epilogue(k, acc, r, q, m_tok, n_rows, ws.first, ws.ffn, bias, residual, out_f16, glu, order=order)
    if kparts > 1:
        k.label(done)
    if experts:
        k.label(exit_)
    k.ret()
    return k


def _block(k: KernelBuilder, ws: WeightStream, ch: dict, b: int, c: Reg, q8: Reg, xc: Reg, x_rows: list,
           acc: list, in_dim: int, tail: int) -> None:
    """Block ``b`` of the prepared chunk ``c``: decode the lane's A words, load X and run its two MMA k steps
    for every column tile."""
    # X: 8 k of every column tile (zeros past in_dim)
    x_ok = None
    if tail < CHUNK and 32 * b + 32 > tail:
        x_ok = k.setp("lt", k.add(k.mad(c, CHUNK, q8), 32 * b), in_dim)

    def x_load(t: int) -> tuple:
        addr = k.add(xc, k.cvt(x_rows[t], "u64"))
        if x_ok is None:
            return k.load("global", "u32", addr, 64 * b, vec=4)
        return k.load("global", "u32", addr, 64 * b, vec=4, pred=x_ok, other=0)

    (a0, a1, a2, a3), (b0, b1, b2, b3) = ws.words(ch, b)
    for g in range(0, len(x_rows), X_GROUP):  # (X of a few column tiles at a time: fewer live registers)
        xs = [x_load(t) for t in range(g, min(g + X_GROUP, len(x_rows)))]
        for half in range(2):
            afr = [a0, b0, a1, b1] if half == 0 else [a2, b2, a3, b3]
            for t, x4 in enumerate(xs, g):
                bfr = (x4[0], x4[1]) if half == 0 else (x4[2], x4[3])
                k.mma_f16(afr, bfr, acc[t], into=acc[t])


def store_y(k: KernelBuilder, y: Reg, idx: Reg, v: Reg, ok: Reg, residual: bool, out_f16: bool) -> None:
    """One output: ``v`` (+ ``residual[idx]``) to ``y[idx]``, f32 or rounded to f16 with ``out_f16``, where ``ok``."""
    if residual:
        v = k.add(v, k.load("global", "f32", k.add(k.global_ptr("residual"), k.mul_wide(idx, 4)), pred=ok,
                            other=0.0))
    addr = k.add(y, k.mul_wide(idx, 2 if out_f16 else 4))
    if out_f16:
        k.store("global", "b16", addr, k.bitcast(k.cvt(v, "f16"), "b16"), pred=ok)
    else:
        k.store("global", "f32", addr, v, pred=ok)


def epilogue(k: KernelBuilder, acc: list, r: Reg, q: Reg, m_tok: Reg, n_rows: Reg, first: Reg, ffn: Reg | None,
              bias: bool, residual: bool, out_f16: bool, glu: bool, tok_base: Reg | None = None,
              order: Reg | None = None) -> None:
    """acc[t] = (Y[8t + 2q, c_a], Y[8t + 2q + 1, c_a], Y[8t + 2q, c_b], Y[8t + 2q + 1, c_b]) with c_a, c_b the
    MMA rows r, r + 8 (with glu: the gate and up of output first + r). ``order``: token j's Y row is the u32
    there at j (a tile of grouped experts' pairs), else row j."""
    ldy = k.param("ldy")
    y = k.global_ptr("y")
    tok0 = k.shl(q, 1)
    if tok_base is not None:  # (a token tile's first token: tokens are absolute, m_tok their count)
        tok0 = k.add(tok_base, tok0)

    rows: dict = {}

    def y_row(tok: Reg, key: tuple) -> Reg:
        if order is None:
            return tok
        if key not in rows:  # (loaded once per token: the token's outputs at both columns share it)
            rows[key] = k.load("global", "u32", k.add(order, k.mul_wide(tok, 4)), pred=k.setp("lt", tok, m_tok),
                               other=0)
        return rows[key]

    def put(tok: Reg, col: Reg, v: Reg, ok: Reg, key: tuple) -> None:
        store_y(k, y, k.mad(y_row(tok, key), ldy, col), v, ok, residual, out_f16)

    if glu:
        col = k.add(first, r)
        c_ok = k.setp("lt", col, ffn)
        for t, (g0, g1, u0, u1) in enumerate(acc):
            for e, (g, u) in enumerate(((g0, u0), (g1, u1))):
                tok = k.add(tok0, 8 * t + e)
                put(tok, col, k.mul(silu(k, g), u), k.both(c_ok, k.setp("lt", tok, m_tok)), (t, e))
        return
    cols = [k.add(first, r), k.add(first, k.add(r, 8))]
    oks = [k.setp("lt", c, n_rows) for c in cols]
    bs = []
    if bias:
        bp = k.global_ptr("bias")
        bs = [k.load("global", "f32", k.add(bp, k.mul_wide(c, 4)), pred=ok, other=0.0) for c, ok in zip(cols, oks)]
    for t, a4 in enumerate(acc):
        for e, v in enumerate(a4):
            ci, dt = e >> 1, e & 1
            tok = k.add(tok0, 8 * t + dt)
            if bias:
                v = k.add(v, bs[ci])
            put(tok, cols[ci], v, k.both(oks[ci], k.setp("lt", tok, m_tok)), (t, dt))
