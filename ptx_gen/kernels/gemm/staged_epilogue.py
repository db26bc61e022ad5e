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
                    residual: bool, out_f16: bool, norm_out: int = 0, scales: Reg | None = None) -> None:
    """``acc[4 t ..]``: (Y[8 t + 2 q, a], Y[8 t + 2 q + 1, a], Y[8 t + 2 q, a + 8], Y[8 t + 2 q + 1, a + 8]) with
    ``a`` row ``r_strip`` of the thread's 16-row ``strip`` (within the CTA); with ``glu`` (gate, gate, up, up) of output
    ``8 strip + r_strip``. ``n_lim``: the outputs that exist (N, or N / 2 with glu); ``c_first``: the CTA's first.
    Every consumer thread calls it (named barrier 1 of ``group`` threads); shared memory from ``stage0`` on is free once
    every consumer's MMAs are done.

    ``scales`` (the next norm's input side, :func:`norm_scales`): shared f32 ``[mt]``, token ``t``'s RMSNorm factor,
    multiplied into its products before anything else (with ``glu``: into gate and up before the SwiGLU).
    ``norm_out`` (its output side, with ``residual``; the parts' stride a token): besides Y (the new residual stream),
    ``hout = f16(Y gnorm)``, each token's sum of squares over the tile and its factor ``rnorm`` (:class:`_NormRow`)."""
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
    fast = k.both(k.setp("eq", mis, 0), k.setp("le", k.add(col, 4), n_lim))
    nrm = _NormRow(k, col, norm_out) if norm_out else None

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
                    nrm.quad(v, idx, ok, src, p * per_pass * row_bytes)
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
                nrm.quad_done(rd)
    if nrm is not None:
        nrm.finish(stage0, tid, group, mt, cols, row_bytes, tok0, m_all, c_first)



class _NormRow:
    """The output side of a fused RMSNorm (``norm_out``): for each output ``v`` a thread writes, ``hout = f16(v
    gnorm)``; the squares of its quad of a token row summed into the quad's first word of the staged tile (the thread
    read it last); then (:meth:`finish`) each token's sum over the tile into ``ssq[t stride + c_first / cols]``, and
    the last of a token tile's ``ceil(n / cols)`` epilogues to count itself at ``ncount[tok0 / mt]`` (``atom.inc``,
    back at zero after the last) sums each token's parts in order and writes ``rnorm[t] = 1 / sqrt(sum / n + eps)``:
    the same bits whichever CTA comes last."""

    def __init__(self, k: KernelBuilder, col: Reg, stride: int):
        self.k, self.col, self.stride = k, col, stride
        self.gw = k.load("global", "f32", k.add(k.global_ptr("gnorm"), k.mul_wide(col, 4)), vec=4, nc=True,
                         pred=k.setp("le", k.add(col, 4), k.param("n")), other=0.0)
        self.ss = None

    def quad(self, v: list, idx: Reg, ok: Reg, at: Reg, off: int) -> None:
        """Four outputs at Y element ``idx`` (16-byte path); their squares' sum to shared ``at + off``."""
        k = self.k
        h = [k.mul(a, w) for a, w in zip(v, self.gw)]
        k.store("global", "b32", k.add(k.global_ptr("hout"), k.mul_wide(idx, 2)),
                [k.cvt_f16x2(h[0], h[1]), k.cvt_f16x2(h[2], h[3])], pred=ok)
        ss = k.mul(v[0], v[0])
        for a in v[1:]:
            ss = k.fma(a, a, ss)
        k.store("shared", "f32", at, ss, off)

    def one(self, v: Reg, idx: Reg, e: int, ok: Reg) -> None:
        """Output ``e`` of the quad at Y element ``idx`` (one at a time; ``ok``: it exists)."""
        k = self.k
        w = k.load("global", "f32", k.add(k.global_ptr("gnorm"), k.mul_wide(k.add(self.col, e), 4)), nc=True, pred=ok,
                   other=0.0)
        k.store("global", "b16", k.add(k.global_ptr("hout"), k.mul_wide(idx, 2)),
                k.bitcast(k.cvt(k.mul(v, w), "f16"), "b16"), pred=ok)
        sq = k.selp(k.mul(v, v), 0.0, ok, "f32")
        self.ss = sq if e == 0 else k.add(self.ss, sq)

    def quad_done(self, at: Reg) -> None:
        """The one-at-a-time quad's sum to shared ``at``."""
        self.k.store("shared", "f32", at, self.ss)
        self.ss = None

    def finish(self, stage0: Reg, tid: Reg, group: int, mt: int, cols: int, row_bytes: int, tok0: Reg, m_all: Reg,
               c_first: Reg) -> None:
        k = self.k
        quads, stride = cols // 4, self.stride
        k.bar_sync(1, group)  # (every quad's sum in the staged tile)
        n = k.param("n")
        nparts = k.shr(k.add(n, cols - 1), _log2(cols))
        part = k.shr(c_first, _log2(cols))
        ssq = k.global_ptr("ssq")
        for t0 in range(0, mt, group):  # (thread t sums token row t's quads, in order)
            tl = k.add(tid, t0) if t0 else tid
            tok = k.add(tok0, tl)
            ok = k.setp("lt", tok, m_all) if t0 + group <= mt else k.both(k.setp("lt", tok, m_all),
                                                                          k.setp("lt", tl, mt))
            row = k.add(stage0, k.mul(tl, row_bytes))
            sums = [k.load("shared", "f32", row, 16 * c, pred=ok, other=0.0) for c in range(quads)]
            tot = sums[0]
            for v in sums[1:]:
                tot = k.add(tot, v)
            k.store("global", "f32", k.add(ssq, k.mul_wide(k.mad(tok, stride, part), 4)), tot, pred=ok)
        k.fence("gl")  # (this thread's sums are visible GPU-wide before its CTA is counted)
        k.bar_sync(1, group)
        flag = stage0  # (the staged tile's first word: every read of it is done)
        counter = k.add(k.global_ptr("ncount"), k.mul_wide(k.div(tok0, mt), 4))
        with k.if_(k.setp("eq", tid, 0)):
            last = k.setp("eq", k.atom("global", "inc", "u32", counter, k.sub(nparts, 1)), k.sub(nparts, 1))
            with k.if_(last):
                k.fence("gl")  # (acquire: every other tile's sums are visible from here on)
            k.store("shared", "u32", flag, k.selp(1, 0, last, "u32"))
        k.bar_sync(1, group)
        with k.if_(k.setp("ne", k.load("shared", "u32", flag), 0)):
            inv_n, eps = k.rcp(k.cvt(n, "f32")), k.param("eps")
            for t0 in range(0, mt, group):  # (thread t: token row t's parts, 16 bytes at a time, added in order)
                tl = k.add(tid, t0) if t0 else tid
                tok = k.add(tok0, tl)
                ok = k.setp("lt", tok, m_all) if t0 + group <= mt else k.both(k.setp("lt", tok, m_all),
                                                                              k.setp("lt", tl, mt))
                at = k.add(ssq, k.mul_wide(k.mul(tok, stride), 4))
                vals = [k.load("global", "f32", at, 16 * j, vec=4, pred=ok, other=0.0, cache="cg")
                        for j in range(stride // 4)]
                tot = None
                for j, v4 in enumerate(vals):
                    for e, a in enumerate(v4):
                        a = k.selp(a, 0.0, k.setp("gt", nparts, 4 * j + e), "f32")  # (parts past the tiles: 0)
                        tot = a if tot is None else k.add(tot, a)
                r = k.rsqrt(k.add(k.mul(tot, inv_n), eps))
                k.store("global", "f32", k.add(k.global_ptr("rnorm"), k.mul_wide(tok, 4)), r, pred=ok)


def norm_scales(k: KernelBuilder, tid: Reg, threads: int, tok0: Reg, m_all: Reg, mt: int, scales: Reg) -> None:
    """The input side of a fused RMSNorm: the tile's ``mt`` tokens' factors ``rnorm[t]`` (:class:`_NormRow`'s) into
    shared ``scales``, by ``threads`` threads ``tid`` (tokens past ``m``: 1)."""
    got = []
    for t0 in range(0, mt, threads):
        tl = k.add(tid, t0) if t0 else tid
        tok = k.add(tok0, tl)
        ok = k.setp("lt", tok, m_all) if t0 + threads <= mt else k.both(k.setp("lt", tok, m_all),
                                                                          k.setp("lt", tl, mt))
        got.append((tl, ok, k.load("global", "f32", k.add(k.global_ptr("rnorm"), k.mul_wide(tok, 4)), pred=ok,
                                   other=1.0)))
    for t0, (tl, ok, r) in zip(range(0, mt, threads), got):
        k.store("shared", "f32", k.add(scales, k.shl(tl, 2)), r, pred=None if t0 + threads <= mt else
                k.setp("lt", tl, mt))
