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
                    residual: bool, out_f16: bool) -> None:
    """``acc[4 t ..]``: (Y[8 t + 2 q, a], Y[8 t + 2 q + 1, a], Y[8 t + 2 q, a + 8], Y[8 t + 2 q + 1, a + 8]) with
    ``a`` row ``r_strip`` of the thread's 16-row ``strip`` (within the CTA); with ``glu`` (gate, gate, up, up) of output
    ``8 strip + r_strip``. ``n_lim``: the outputs that exist (N, or N / 2 with glu); ``c_first``: the CTA's first.
    Every consumer thread calls it (named barrier 1 of ``group`` threads); shared memory from ``stage0`` on is free once
    every consumer's MMAs are done."""
    cols = tile_cols(rgroups, glu)
    row_bytes = 4 * (cols + 4)
    k.bar_sync(1, group)  # (every consumer warpgroup's MMAs are done with the tiles the stage overwrites)
    ch = k.add(k.shl(strip, 3 if glu else 4), r_strip)
    at = k.add(stage0, k.add(k.mul(q, 2 * row_bytes), k.shl(ch, 2)))  # (token 2 q, output ch)
    for t in range(mt // 8):
        g0, g1, c0, c1 = acc[4 * t:4 * t + 4]
        if glu:
            for e, (g, u) in enumerate(((g0, c0), (g1, c1))):
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
    mis = k.and_(ldy, 3)
    for p, align in ptrs:
        mis = k.or_(mis, k.cvt(k.and_(p, align - 1, "u64"), "u32"))
    fast = k.both(k.setp("eq", mis, 0), k.setp("le", k.add(col, 4), n_lim))

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
                if bias:
                    v = [k.add(a, b) for a, b in zip(v, bq)]
                if residual:
                    v = [k.add(a, b) for a, b in zip(v, res)]
                dst = k.add(y, k.mul_wide(idx, osize))
                if out_f16:
                    k.store("global", "b32", dst, [k.cvt_f16x2(v[0], v[1]), k.cvt_f16x2(v[2], v[3])], pred=ok)
                else:
                    k.store("global", "f32", dst, v, pred=ok)
    with k.if_(fast, negate=True):
        with k.loop(row, mt, per_pass) as tl:
            rd = k.add(stage0, k.add(k.mul(tl, row_bytes), k.shl(cq, 4)))
            tok_ok = k.setp("lt", k.add(tok0, tl), m_all)
            for e in range(4):
                ok = k.both(tok_ok, k.setp("lt", k.add(col, e), n_lim))
                _, idx = out_at(tl, e)
                v = k.load("shared", "f32", rd, 4 * e)
                if bias:
                    v = k.add(v, k.load("global", "f32", k.add(k.global_ptr("bias"), k.mul_wide(k.add(col, e), 4)),
                                        pred=ok, other=0.0))
                store_y(k, y, idx, v, ok, residual, out_f16)
