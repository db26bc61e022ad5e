"""The warp-specialized GEMM's epilogue through shared memory: the consumers' accumulators of a CTA's output tile are
written to shared memory token-major, then read back a row of the tile at a time so that each thread finishes four
adjacent outputs of one token with 16-byte loads and stores (the residual's, the bias's, Y's): a warp's accesses are
whole rows of Y, not a column pair of 4 tokens x 8 outputs per instruction as the accumulators lie.

The tile: ``mt`` tokens x ``tile_cols`` outputs (the CTA's ``64 rgroups`` weight rows, or with ``glu`` their
``32 rgroups`` gate/up pairs, silu(gate) * up already formed), f32, row ``t`` at ``4 t (cols + 4)`` bytes: the four
words of padding put the 4 tokens x 8 outputs of a warp's store in 32 distinct banks, and keep each row's 16-byte
pieces aligned. The values, their additions (bias, then residual) and their rounding are those of
:func:`ptx_gen.kernels.gemm.gemm_q.epilogue`, so the outputs are the same bits.

Threads ``i`` of the consumers' ``group`` take output quad ``i % (cols / 4)`` of tokens ``i / (cols / 4)`` and every
``group / (cols / 4)``-th after it. Where Y's row stride and the pointers allow 16-byte accesses (``ldy`` a multiple of
4, Y / residual / bias aligned) and the thread's quad lies below N, the quads go by vectors, the residual's loads of
:data:`BATCH` rows issued before their stores (Y may be the residual itself: each output is read and written by the
same thread only); otherwise one output at a time.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.kernels.elementwise.elementwise import silu
from ptx_gen.kernels.gemm.gemm_q import store_y

__all__ = ["stage_bytes", "staged_epilogue", "tile_cols"]

BATCH = 8  # token rows whose residual loads are in flight together on the vector path


def tile_cols(rgroups: int, glu: bool) -> int:
    """Outputs of a CTA's tile: its weight rows, or their gate/up pairs."""
    return (32 if glu else 64) * rgroups


def stage_bytes(mt: int, rgroups: int, glu: bool = False) -> int:
    """Shared bytes of the staged tile (rows of ``tile_cols + 4`` f32)."""
    return 4 * mt * (tile_cols(rgroups, glu) + 4)


def _log2(v: int) -> int:
    return v.bit_length() - 1


def staged_epilogue(k: KernelBuilder, acc: list, stage0: Reg, group: int, tid: Reg, strip: Reg, r_strip: Reg, q: Reg,
                    m_all: Reg, n_lim: Reg, c_first: Reg, tok0: Reg, mt: int, rgroups: int, glu: bool, bias: bool,
                    residual: bool, out_f16: bool, norm_out: bool = False, scales: Reg | None = None) -> None:
    """``acc[4 t ..]``: (Y[8 t + 2 q, a], Y[8 t + 2 q + 1, a], Y[8 t + 2 q, a + 8], Y[8 t + 2 q + 1, a + 8]) with
    ``a`` row ``r_strip`` of the thread's 16-row ``strip`` (within the CTA); with ``glu`` (gate, gate, up, up) of output
    ``8 strip + r_strip``. ``n_lim``: the outputs that exist (N, or N / 2 with glu); ``c_first``: the CTA's first.
    Every consumer thread calls it (named barrier 1 of ``group`` threads); shared memory from ``stage0`` on is free once
    every consumer's MMAs are done.

    ``scales`` (the next norm's input side, :func:`norm_scales`): shared f32 ``[mt]``, token ``t``'s RMSNorm factor,
    multiplied into its products before anything else (with ``glu``: into gate and up before the SwiGLU).
    ``norm_out`` (its output side, with ``residual``): besides Y (the new residual stream), ``hout = f16(Y gnorm)`` and
    each token's sum of squares over the tile's outputs at ``ssq[t ssld + c_first / cols]`` (:func:`_norm_row`)."""
    cols = tile_cols(rgroups, glu)
    row_bytes = 4 * (cols + 4)
    k.bar_sync(1, group)  # (every consumer warpgroup's MMAs are done with the tiles the stage overwrites)
    ch = k.add(k.shl(strip, 3 if glu else 4), r_strip)
    at = k.add(stage0, k.add(k.mul(q, 2 * row_bytes), k.shl(ch, 2)))  # (token 2 q, output ch)
    for t in range(mt // 8):
        g0, g1, c0, c1 = acc[4 * t:4 * t + 4]
        if glu:
            for e, (g, u) in enumerate(((g0, c0), (g1, c1))):
                if scales is not None:  # (token 8 t + 2 q + e's norm factor)
                    sc = k.load("shared", "f32", k.add(scales, k.shl(q, 3)), 4 * (8 * t + e))
                    g, u = k.mul(g, sc), k.mul(u, sc)
                k.store("shared", "f32", at, k.mul(silu(k, g), u), (8 * t + e) * row_bytes)
            continue
        for e, v in enumerate((g0, g1, c0, c1)):
            k.store("shared", "f32", at, v, (8 * t + (e & 1)) * row_bytes + 32 * (e >> 1))
    k.bar_sync(1, group)

    quads = cols // 4
    per_pass = group // quads  # token rows a pass
    cq, row = k.and_(tid, quads - 1), k.shr(tid, _log2(quads))
    col = k.add(c_first, k.shl(cq, 2))
    src = k.add(stage0, k.add(k.mul(row, row_bytes), k.shl(cq, 4)))
    ldy = k.param("ldy")
    y = k.global_ptr("y")
    osize = 2 if out_f16 else 4
    ptrs = [(y, 4 * osize)] + [(k.global_ptr(p), 16) for p, on in (("residual", residual), ("bias", bias)) if on]
    if norm_out:
        ptrs += [(k.global_ptr("gnorm"), 16), (k.global_ptr("hout"), 8)]
    mis = k.and_(ldy, 3)
    for p, align in ptrs:
        mis = k.or_(mis, k.cvt(k.and_(p, align - 1, "u64"), "u32"))
    # (norm_out: the whole CTA on one path, so that a row's lanes meet at the same shuffles)
    fast = k.both(k.setp("eq", mis, 0), k.setp("le", k.add(c_first if norm_out else col, cols if norm_out else 4), n_lim))
    nrm = _NormRow(k, c_first, col, cq, quads, cols) if norm_out else None

    def scaled(v, tl):
        """``v`` (values of local token row ``tl``) times the row's norm factor, with ``scales`` (glu: applied before the
        SwiGLU already)."""
        if scales is None or glu:
            return v
        sc = k.load("shared", "f32", k.add(scales, k.shl(tl, 2)))
        return [k.mul(a, sc) for a in v] if isinstance(v, list) else k.mul(v, sc)

    def out_at(tl, sub: int = 0):
        """(token, Y element index) of local token row ``tl`` (+ ``sub`` outputs)."""
        tok = k.add(tok0, tl)
        return tok, k.mad(tok, ldy, k.add(col, sub) if sub else col)

    with k.if_(fast):
        bq = k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(col, 4)), vec=4) if bias else None
        for b0 in range(0, mt // per_pass, BATCH):
            passes = range(b0, min(b0 + BATCH, mt // per_pass))
            rows = []
            for p in passes:
                tok, idx = out_at(k.add(row, p * per_pass) if p else row)
                ok = k.setp("lt", tok, m_all)
                res = (k.load("global", "f32", k.add(k.global_ptr("residual"), k.mul_wide(idx, 4)), vec=4, pred=ok,
                              other=0.0) if residual else None)
                rows.append((p, idx, ok, res))
            for p, idx, ok, res in rows:
                v = list(k.load("shared", "f32", src, p * per_pass * row_bytes, vec=4))
                if scales is not None and not glu:
                    v = scaled(v, k.add(row, p * per_pass) if p else row)
                if bias:
                    v = [k.add(a, b) for a, b in zip(v, bq)]
                if residual:
                    v = [k.add(a, b) for a, b in zip(v, res)]
                dst = k.add(y, k.mul_wide(idx, osize))
                if out_f16:
                    k.store("global", "b32", dst, [k.cvt_f16x2(v[0], v[1]), k.cvt_f16x2(v[2], v[3])], pred=ok)
                else:
                    k.store("global", "f32", dst, v, pred=ok)
                if nrm is not None:
                    nrm.quad(v, idx, ok)
                    nrm.finish(k.add(tok0, k.add(row, p * per_pass) if p else row), ok)
    with k.if_(fast, negate=True):
        with k.loop(row, mt, per_pass) as tl:
            rd = k.add(stage0, k.add(k.mul(tl, row_bytes), k.shl(cq, 4)))
            tok_ok = k.setp("lt", k.add(tok0, tl), m_all)
            for e in range(4):
                ok = k.both(tok_ok, k.setp("lt", k.add(col, e), n_lim))
                _, idx = out_at(tl, e)
                v = scaled(k.load("shared", "f32", rd, 4 * e), tl)
                if bias:
                    v = k.add(v, k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(k.add(col, e), 4)),
                                        pred=ok, other=0.0))
                if nrm is None:
                    store_y(k, y, idx, v, ok, residual, out_f16)
                    continue
                v = k.add(v, k.load("global", "f32", k.add(k.global_ptr("residual"), k.mul_wide(idx, 4)), pred=ok,
                                    other=0.0))
                k.store("global", "f32", k.add(y, k.mul_wide(idx, 4)), v, pred=ok)
                nrm.one(v, idx, e, ok)
            if nrm is not None:
                nrm.finish(k.add(tok0, tl), tok_ok)


class _NormRow:
    """The output side of a fused RMSNorm (``norm_out``) for one thread's quad of outputs ``col ..`` of a token row:
    ``hout = f16(v gnorm)`` for each output ``v`` it writes, and the squares of those outputs summed over the row's
    ``quads`` lanes (a butterfly within the warp), stored by the row's first lane into ``ssq[tok ssld + c_first / cols]``:
    the tile's part of the token's sum of squares, which the next GEMM's :func:`norm_scales` adds up."""

    def __init__(self, k: KernelBuilder, c_first: Reg, col: Reg, cq: Reg, quads: int, cols: int):
        if quads > 32:
            raise ValueError(f"a fused norm's row of {quads} output quads spans more than a warp")
        self.k, self.col, self.quads = k, col, quads
        self.gw = k.load("global", "f32", k.add(k.global_ptr("gnorm"), k.mul_wide(col, 4)), vec=4, nc=True,
                         pred=k.setp("le", k.add(col, 4), k.param("n")), other=0.0)
        self.part = k.shr(c_first, _log2(cols))
        self.lead = k.setp("eq", cq, 0)
        self.ss = None

    def quad(self, v: list, idx: Reg, ok: Reg) -> None:
        """Four outputs at Y element ``idx`` (16-byte path)."""
        k = self.k
        h = [k.mul(a, w) for a, w in zip(v, self.gw)]
        k.store("global", "b32", k.add(k.global_ptr("hout"), k.mul_wide(idx, 2)),
                [k.cvt_f16x2(h[0], h[1]), k.cvt_f16x2(h[2], h[3])], pred=ok)
        ss = k.mul(v[0], v[0])
        for a in v[1:]:
            ss = k.fma(a, a, ss)
        self.ss = ss

    def one(self, v: Reg, idx: Reg, e: int, ok: Reg) -> None:
        """Output ``e`` of the quad at Y element ``idx`` (one at a time; ``ok``: it exists)."""
        k = self.k
        w = k.load("global", "f32", k.add(k.global_ptr("gnorm"), k.mul_wide(k.add(self.col, e), 4)), nc=True, pred=ok,
                   other=0.0)
        k.store("global", "b16", k.add(k.global_ptr("hout"), k.mul_wide(idx, 2)),
                k.bitcast(k.cvt(k.mul(v, w), "f16"), "b16"), pred=ok)
        sq = k.selp(k.mul(v, v), 0.0, ok, "f32")
        self.ss = sq if e == 0 else k.add(self.ss, sq)

    def finish(self, tok: Reg, ok: Reg) -> None:
        """The row's squares summed over its lanes; its first lane stores them (token ``tok``, where ``ok``)."""
        k = self.k
        ss = self.ss
        off = self.quads // 2
        while off:
            ss = k.add(ss, k.shfl("bfly", ss, off))
            off //= 2
        at = k.add(k.global_ptr("ssq"), k.mul_wide(k.mad(tok, k.param("ssld"), self.part), 4))
        k.store("global", "f32", at, ss, pred=k.both(ok, self.lead))
        self.ss = None


def norm_scales(k: KernelBuilder, tid: Reg, threads: int, tok0: Reg, m_all: Reg, mt: int, npad: int, in_dim: int,
                scales: Reg) -> None:
    """The input side of a fused RMSNorm: each of the tile's ``mt`` tokens' factor ``1 / sqrt(sum_p ssq[t npad + p] /
    in_dim + eps)`` (the parts ``p < nparts`` the last GEMM's :class:`_NormRow` wrote) into shared ``scales``, by
    ``threads`` threads ``tid``: ``npad / 4`` lanes a token, a 16-byte load each, summed by a butterfly. Tokens past
    ``m`` get the factor of an empty row (never written out)."""
    lanes = npad // 4
    per = threads // lanes  # tokens a pass
    f, t_in = k.and_(tid, lanes - 1), k.shr(tid, _log2(lanes))
    nparts, eps = k.param("nparts"), k.param("eps")
    base = k.global_ptr("ssq")
    passes = -(-mt // per)
    batch = 8
    for b0 in range(0, passes, batch):
        got = []
        for p in range(b0, min(b0 + batch, passes)):
            tl = k.add(t_in, p * per) if p else t_in
            tok = k.add(tok0, tl)
            in_tile = k.setp("lt", tl, mt) if (p + 1) * per > mt else None  # (a pass past the tile's last token)
            ok = k.both(k.setp("lt", tok, m_all), in_tile)
            v = k.load("global", "f32", k.add(base, k.mul_wide(k.mad(tok, npad, k.shl(f, 2)), 4)), vec=4, pred=ok,
                       other=0.0)
            got.append((tl, in_tile, v))
        for tl, in_tile, v in got:
            first = k.shl(f, 2)
            s = None
            for e, a in enumerate(v):
                a = k.selp(a, 0.0, k.setp("lt", k.add(first, e) if e else first, nparts), "f32")
                s = a if s is None else k.add(s, a)
            off = lanes // 2
            while off:
                s = k.add(s, k.shfl("bfly", s, off))
                off //= 2
            inv = k.rsqrt(k.add(k.mul(s, 1.0 / in_dim), eps))
            k.store("shared", "f32", k.add(scales, k.shl(tl, 2)), inv, pred=k.both(k.setp("eq", f, 0), in_tile))
