"""Tensor-core GEMM for prefill: ``Y[M, N] = X[M, K] W[N, K]^T`` with f16 operands and f32 accumulation
(``mma.sync.m16n8k16.row.col.f32.f16.f16.f32``), plus fused epilogues.

``X`` holds M tokens' activations (row stride ``lda``), ``W`` the weight's rows as f16 (row stride K:
the prefill expands a quantized weight into f16 with ``dequant_f16`` first). Both operands are K-major,
so both reach the MMA through plain ``ldmatrix.x4`` (X as A, W as B in its "col" form).

Tiling: a CTA computes a ``bm x bn`` tile of Y with ``warps_m x warps_n`` warps, each a
``bm/warps_m x bn/warps_n`` warp tile held in f32 registers. K is walked in tiles of 64: the X and W
tiles (rows of 128 bytes) are copied with ``cp.async`` into a ring of ``stages`` shared-memory slots,
``stages - 1`` tiles ahead of the MMAs. A row's eight 16-byte chunks are stored XOR-swizzled (chunk
``c`` of row ``r`` at position ``c ^ (r % 8)``), so the 8 rows one ``ldmatrix`` reads hit 8 distinct bank
groups. Rows past M or N and chunks past K are zero-filled by the copy itself (a source size of 0), so
ragged shapes cost no branch in the main loop. The grid's x dimension walks M: the CTAs sharing a
weight tile run side by side and the weight streams from DRAM about once.

Epilogue, per accumulator pair ``(Y[r, c], Y[r, c + 1])`` (c even): ``+ bias[c]``, ``+ residual[r, c]``
(f32, row stride ``ldy``; may be Y itself: each element is read and written by one thread), stored as
f32 or f16 (round to nearest). ``glu``: W's rows interleave gate and up (row 2j = gate j, row 2j + 1 =
up j), so a thread's pair is (gate, up) of output ``c / 2``: ``Y[r, c / 2] = silu(gate) * up``.

Requirements: K and ``lda`` multiples of 8 (16-byte chunks), X, W 16-byte aligned; N even with
``glu``. Launch: grid ``(ceil(M / bm), ceil(N / bn))``, block ``32 warps_m warps_n``, dynamic shared
memory ``meta["dyn_smem"]`` bytes (above 48 KiB the launcher raises the limit).
"""

from __future__ import annotations

from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.elementwise.elementwise import silu
from ptx_gen.kernels.gemm.signature import epilogue_signature

BK = 64  # K per tile: one 128-byte row of f16 per operand row
ROW = 2 * BK  # bytes of a staged row
CHUNKS = ROW // 16


def smem_bytes(bm: int, bn: int, stages: int) -> int:
    return stages * (bm + bn) * ROW


def check_tiling(bm: int, bn: int, warps_m: int, warps_n: int, stages: int) -> None:
    if bm not in (32, 64, 128, 256) or bn not in (32, 64, 128, 256):
        raise ValueError(f"bm and bn must be 32, 64, 128 or 256, got {bm} x {bn}")
    if warps_m not in (1, 2, 4) or warps_n not in (1, 2, 4) or warps_m * warps_n > 8:
        raise ValueError(f"warps_m x warps_n must be 1, 2 or 4 each and at most 8 warps, got {warps_m} x {warps_n}")
    wm, wn = bm // warps_m, bn // warps_n
    if wm % 16 or wn % 16 or wm < 16 or wn < 16:
        raise ValueError(f"the warp tile {wm} x {wn} must be a multiple of 16 x 16")
    if wm * wn > 64 * 64:
        raise ValueError(f"the warp tile {wm} x {wn} holds more than 128 accumulators a thread")
    if warps_m * warps_n < 2:
        raise ValueError("the copy plan needs at least 2 warps (64 threads: 8 rows a pass)")
    if not 2 <= stages <= 6:
        raise ValueError(f"stages must be 2..6, got {stages}")
    threads = 32 * warps_m * warps_n
    if (bm * CHUNKS) % threads or (bn * CHUNKS) % threads:
        raise ValueError(f"{threads} threads do not split a {bm} x {bn} tile's 16-byte chunks evenly")


_GRID = ([{"bm": 128, "bn": 128, "warps_m": 2, "warps_n": 2, "stages": s} for s in (3, 4)]
         + [{"bm": 64, "bn": 128, "warps_m": 1, "warps_n": 4, "stages": 4, "residual": True},
            {"bm": 128, "bn": 64, "warps_m": 2, "warps_n": 2, "stages": 4, "bias": True, "out_f16": True},
            {"bm": 128, "bn": 128, "warps_m": 2, "warps_n": 2, "stages": 3, "glu": True, "out_f16": True},
            {"bm": 64, "bn": 64, "warps_m": 2, "warps_n": 2, "stages": 3, "glu": True},
            {"bm": 32, "bn": 64, "warps_m": 1, "warps_n": 2, "stages": 2, "bias": True, "residual": True},
            # the batched decode step's tiles (realizar.gpu.gemm._SMALL_M_TILES)
            {"bm": 32, "bn": 64, "warps_m": 1, "warps_n": 2, "stages": 6, "residual": True},
            {"bm": 64, "bn": 64, "warps_m": 2, "warps_n": 2, "stages": 6, "bias": True},
            {"bm": 64, "bn": 64, "warps_m": 2, "warps_n": 2, "stages": 6, "glu": True, "out_f16": True}])


@dataclass
class _Gemm:
    """What the phases of :func:`gemm_f16` share."""
    k: KernelBuilder
    bm: int
    bn: int
    wm: int  # warp tile
    wn: int
    stages: int
    threads: int
    m: Reg
    n: Reg
    kdim: Reg
    m0: Reg  # the CTA's first row of Y / X
    n0: Reg  # the CTA's first column of Y / row of W
    smem: Reg

    @property
    def stage_bytes(self) -> int:
        return (self.bm + self.bn) * ROW


def _copy_plan(g: _Gemm, base: Reg, ld: Reg, first: Reg, limit: Reg, rows: int, tid: Reg, chunk: Reg):
    """Per-thread constants for copying ``rows`` rows of one operand tile: the source of the thread's
    first chunk (row ``first + tid / 8``, chunk ``tid % 8``), the step to its next row, its first
    destination offset inside a slot, and the rows it covers."""
    k = g.k
    r0 = k.shr(tid, 3)
    row = k.add(first, r0)
    src = k.add(base, k.mul_wide(k.mad(row, ld, k.shl(chunk, 3)), 2))
    step = k.mul_wide(ld, 2 * (g.threads // CHUNKS))
    dst = k.add(k.mul(r0, ROW), k.shl(k.xor(chunk, k.and_(r0, 7)), 4))
    return dict(src=src, step=step, dst=dst, row=row, limit=limit, rows=rows)


def _load_tile(g: _Gemm, plan: dict, slot: Reg, slot_offset: int, kt: Reg, chunk: Reg, fallback: Reg) -> None:
    """cp.async the thread's chunks of K tile ``kt`` of one operand into ``slot`` (zero-filled past the
    operand's rows or K)."""
    k = g.k
    kcol = k.add(k.shl(kt, 6), k.shl(chunk, 3))
    k_ok = k.setp("lt", kcol, g.kdim)
    koff = k.mul_wide(kt, ROW)
    per = plan["rows"] * CHUNKS // g.threads
    rstep = g.threads // CHUNKS
    src = k.add(plan["src"], koff)
    for i in range(per):
        row = k.add(plan["row"], i * rstep) if i else plan["row"]
        ok = k.both(k_ok, k.setp("lt", row, plan["limit"]))
        size = k.selp(16, 0, ok, "u32")
        addr = k.selp(src, fallback, ok, "u64")
        # (rows i and i + 8 / rstep share the swizzle: rstep is a multiple of 8)
        k.cp_async(k.add(slot, plan["dst"]), addr, dst_offset=slot_offset + i * rstep * ROW, src_size=size)
        if i + 1 < per:
            src = k.add(src, plan["step"])


def _fragments(g: _Gemm, lane: Reg, warp_m: Reg, warp_n: Reg) -> dict:
    """Per-lane ldmatrix offsets: lane ``8 j + r`` addresses row ``r`` of matrix j. For X (A): matrices
    (rows 0-7 | 8-15) x (k 0-7 | 8-15), j = 2 kh + mh; for W (B): (n 0-7 | 8-15) x (k lo | hi),
    j = 2 nh + kh. ``swz_a[kk]``/``swz_b[kk]`` are the swizzled chunk offsets of k step ``kk``."""
    k = g.k
    r = k.and_(lane, 7)
    j = k.shr(lane, 3)
    jlo, jhi = k.and_(j, 1), k.shr(j, 1)
    a_row = k.add(k.mul(warp_m, g.wm), k.add(r, k.shl(jlo, 3)))
    b_row = k.add(k.mul(warp_n, g.wn), k.add(r, k.shl(jhi, 3)))
    swz_a = [k.shl(k.xor(k.add(jhi, 2 * kk), r), 4) for kk in range(BK // 16)]
    swz_b = [k.shl(k.xor(k.add(jlo, 2 * kk), r), 4) for kk in range(BK // 16)]
    return dict(a=k.mul(a_row, ROW), b=k.add(k.mul(b_row, ROW), g.bm * ROW), swz_a=swz_a, swz_b=swz_b)


def _mma_tile(g: _Gemm, fr: dict, slot: Reg, acc: list) -> None:
    """All MMAs of one staged K tile: per k step, the warp's A fragments (one ldmatrix.x4 per 16 rows)
    and B fragments (one per 16 columns), then every (16 rows, 8 columns) accumulator."""
    k = g.k
    abase, bbase = k.add(slot, fr["a"]), k.add(slot, fr["b"])
    for kk in range(BK // 16):
        pa, pb = k.add(abase, fr["swz_a"][kk]), k.add(bbase, fr["swz_b"][kk])
        a = [k.ldmatrix_x4(pa, mi * 16 * ROW) for mi in range(g.wm // 16)]
        b = []
        for nj in range(g.wn // 16):
            d0, d1, d2, d3 = k.ldmatrix_x4(pb, nj * 16 * ROW)
            b += [(d0, d1), (d2, d3)]
        for mi, af in enumerate(a):
            for ni, bf in enumerate(b):
                k.mma_f16(af, bf, acc[mi][ni], into=acc[mi][ni])


def _epilogue(g: _Gemm, acc: list, lane: Reg, warp_m: Reg, warp_n: Reg, bias: bool, residual: bool,
              out_f16: bool, glu: bool) -> None:
    """Each thread's accumulator pairs (Y[r, c], Y[r, c + 1]) through bias / residual / SwiGLU to Y."""
    k = g.k
    ldy = k.param("ldy")
    y = k.global_ptr("y")
    bias_p = k.global_ptr("bias") if bias else None
    res_p = k.global_ptr("residual") if residual else None
    row0 = k.add(g.m0, k.add(k.mul(warp_m, g.wm), k.shr(lane, 2)))
    col0 = k.add(g.n0, k.add(k.mul(warp_n, g.wn), k.shl(k.and_(lane, 3), 1)))
    osize = 2 if out_f16 else 4
    otype = "b16" if out_f16 else "f32"

    def put(addr: Reg, v: Reg, ok: Reg) -> None:
        k.store("global", otype, addr, k.bitcast(k.cvt(v, "f16"), "b16") if out_f16 else v, pred=ok)

    for mi in range(g.wm // 16):
        for half in range(2):
            row = k.add(row0, mi * 16 + 8 * half)
            r_ok = k.setp("lt", row, g.m)
            for ni in range(g.wn // 8):
                col = k.add(col0, ni * 8)
                v0, v1 = acc[mi][ni][2 * half], acc[mi][ni][2 * half + 1]
                if glu:
                    ok = k.both(r_ok, k.setp("lt", col, g.n))
                    out = k.mul(silu(k, v0), v1)
                    put(k.add(y, k.mul_wide(k.mad(row, ldy, k.shr(col, 1)), osize)), out, ok)
                    continue
                for e, v in enumerate((v0, v1)):
                    c = k.add(col, e) if e else col
                    ok = k.both(r_ok, k.setp("lt", c, g.n))
                    if bias:
                        v = k.add(v, k.load("global", "f32", k.add(bias_p, k.mul_wide(c, 4)), pred=ok, other=0.0))
                    idx = k.mad(row, ldy, c)
                    if residual:
                        v = k.add(v, k.load("global", "f32", k.add(res_p, k.mul_wide(idx, 4)), pred=ok, other=0.0))
                    put(k.add(y, k.mul_wide(idx, osize)), v, ok)


@kernel("gemm_f16", grid=_GRID)
def gemm_f16(m: Module, bm: int = 128, bn: int = 128, warps_m: int = 2, warps_n: int = 2, stages: int = 4,
             bias: bool = False, residual: bool = False, out_f16: bool = False, glu: bool = False) -> KernelBuilder:
    """Y = X W^T (+ bias) (+ residual), or with ``glu`` Y = silu(X G^T) * (X U^T) from interleaved rows;
    f16 operands, f32 accumulation. Params: x, w, y, [bias], [residual], m, n, k, lda, ldy.
    Launch: grid (ceil(m / bm), ceil(n / bn)), block 32 warps_m warps_n, dyn_smem meta["dyn_smem"]."""
    check_tiling(bm, bn, warps_m, warps_n, stages)
    flags, params = epilogue_signature(["x", "w", "y"], ["m", "n", "k", "lda", "ldy"], bias=bias, residual=residual,
                                       out_f16=out_f16, glu=glu)
    threads = 32 * warps_m * warps_n
    k = m.kernel(f"gemm_f16_{bm}x{bn}_w{warps_m}x{warps_n}_s{stages}{flags}", params, max_threads=threads)
    dyn = smem_bytes(bm, bn, stages)
    k.meta.update(block=threads, dyn_smem=dyn, bm=bm, bn=bn)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    warp_m, warp_n = k.rem(warp, warps_m), k.div(warp, warps_m)
    g = _Gemm(k, bm, bn, bm // warps_m, bn // warps_n, stages, threads, k.param("m"), k.param("n"),
              k.param("k"), k.mul(k.ctaid("x"), bm), k.mul(k.ctaid("y"), bn), k.dynamic_shared())
    k.grid_dependency_wait()  # X (and the residual) come from the kernels before
    x, w = k.global_ptr("x"), k.global_ptr("w")
    chunk = k.and_(tid, CHUNKS - 1)
    pa = _copy_plan(g, x, k.param("lda"), g.m0, g.m, bm, tid, chunk)
    pb = _copy_plan(g, w, g.kdim, g.n0, g.n, bn, tid, chunk)
    ktiles = k.shr(k.add(g.kdim, BK - 1), 6)

    def load(slot: Reg, kt: Reg) -> None:
        _load_tile(g, pa, slot, 0, kt, chunk, x)
        _load_tile(g, pb, slot, bm * ROW, kt, chunk, w)
        k.cp_async_commit()

    for s in range(stages - 1):  # the ring's first tiles (zero-filled past K)
        load(k.add(g.smem, s * g.stage_bytes) if s else g.smem, k.mov(s, "u32"))
    fr = _fragments(g, lane, warp_m, warp_n)
    acc = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(g.wn // 8)] for _ in range(g.wm // 16)]
    ring = stages * g.stage_bytes
    rd = k.var("u32", 0)  # slot offsets: the tile computed now, the tile loaded now
    wr = k.var("u32", (stages - 1) * g.stage_bytes)
    with k.loop(0, ktiles) as kt:
        k.cp_async_wait_group(stages - 2)
        k.bar_sync()  # tile kt landed for every thread; every warp is done with the slot loaded next
        load(k.add(g.smem, wr), k.add(kt, stages - 1))
        _mma_tile(g, fr, k.add(g.smem, rd), acc)
        for v in (rd, wr):
            nxt = k.add(v, g.stage_bytes)
            k.assign(v, k.selp(0, nxt, k.setp("eq", nxt, ring), "u32"))
    k.cp_async_wait_all()  # (the zero-filled tiles past K land before the CTA's shared memory goes)
    _epilogue(g, acc, lane, warp_m, warp_n, bias, residual, out_f16, glu)
    k.ret()
    return k
