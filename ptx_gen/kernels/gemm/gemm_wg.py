"""Batch GEMM straight from the quantized weights on Hopper's warpgroup MMA: ``Y[M, N] = X[M, K] W[N, K]^T``
for the batched decode step and prefill chunks (M up to a whole chunk, ``mt`` tokens per CTA), W the GGUF
weight exactly as the decode GEMV reads it (GGUF rows, "tiles" or "glu-tiles"), X f16 row-major (row stride
``lda``), f32 accumulation on ``wgmma.mma_async`` m64nNk16 f16 (sm_90a). No f16 copy of W exists anywhere: a
weight byte is read from DRAM once per token tile and decoded into registers.

**Work split.** A warpgroup (4 warps) owns 64 weight rows, the MMA's A operand: warp ``w`` decodes rows
``16 w ..`` into its A fragments in registers with :class:`~ptx_gen.kernels.gemm.qstream.WeightStream` (the
copy ring and block decoders ``gemm_q`` uses), so the weights never pass through shared memory as f16. A CTA
holds ``rgroups`` such row groups side by side and ``kparts`` groups of them splitting K (summed through
shared memory at the end); ``ctaid.y`` picks the token tile. N of the MMA is the ``mt`` tokens: one
``wgmma`` per 16 k covers all of them.

**X.** The tokens' X is the B operand, read by the MMA from shared memory in the 128-byte swizzled K-major
layout (per 64 k: token ``n`` at ``128 n``, its 16-byte piece ``p`` at ``(p ^ n % 8) * 16``; descriptor
stride 1024 bytes per 8 tokens). A lane's A words hold k ``8 q .. 8 q + 7`` of a 32-value block where the MMA
expects k pairs ``2 q`` and ``2 q + 8`` (see qstream), so X enters in the same order: a block's four 16-byte
pieces (piece ``q`` = k ``8 q ..``) are stored word-transposed (stored piece ``i`` = word ``i`` of each),
which lines the MMA's logical k up with the A words. 4-byte ``cp.async`` do the gather straight from global
memory (16 lanes a token, one word each: coalesced reads, no registers held). Each K part double-buffers X
stages of 128 k: once its MMAs that read a buffer are done (``wgmma.wait_group`` after the stage's first
block; with two row groups, a barrier of the part's threads too), every thread issues its copies of the stage
after next into it and arrives on the buffer's mbarrier when they land (``cp.async.mbarrier.arrive.noinc``);
the stage starts after that mbarrier's phase and ``fence.proxy.async`` (the copies are generic-proxy writes,
the MMA reads through the async proxy).

**Pipeline per 32-value block.** Decode the block's A words (f32 ``A f + C``, rounded to f16: the MMA
multiplies exactly the weights ``dequant_f16`` would write), ``wgmma.fence``, two ``wgmma`` (k 16 each),
commit, wait until only this block's group is in flight: the tensor cores run block ``b`` while the warps
decode block ``b + 1``.

**Edges.** Tokens past M read the last token's row (never written); rows past N are not copied (their
outputs are never written). K must be a multiple of 256 (whole chunks). Epilogue per output ``Y[t, c]``
(f32 or f16 with ``out_f16``, row stride ``ldy``): ``+ bias[c]``, ``+ residual[t, c]`` (may be Y itself);
``glu``: W is [gate; up] and ``Y[t, j] = silu(gate) * up`` (a warp's MMA rows 0-7 gate, 8-15 up).

Params: w, x, y, [bias], [residual], m (tokens), n (weight rows), lda, ldy. Requirements: X 16-byte aligned,
``lda`` a multiple of 8, the weight's bytes below 2**32. Launch: grid (ceil(rows_out / meta["rows_per_cta"]),
ceil(m / mt)), block meta["block"], dynamic shared memory meta["dyn_smem"]. Tested on the GPU and in the emulator
(``tests/test_gemm_ws_ptx.py``).
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.dequant.dequant import check_weight_layout
from ptx_gen.kernels.gemm.gemm_q import epilogue
from ptx_gen.kernels.gemm.signature import epilogue_signature
from ptx_gen.kernels.gemm.qstream import CHUNK, WeightStream, seg_bytes, warp_bytes

__all__ = ["WG_MTS", "check_shape", "gemm_wg", "smem_bytes"]

WG_MTS = (32, 64, 128, 256)
MAX_DYN_SMEM = 227 * 1024
XK = 128  # k values of an X stage (two 64-k swizzle slabs)
ALIGN = 1024  # the swizzle pattern repeats every 8 rows of 128 bytes: X buffers start 1024-aligned
SBO = 1024  # descriptor: bytes between 8-token groups
DESC_FIXED = (1 << 16) | ((SBO >> 4) << 32) | (1 << 62)  # leading offset 1 (unused when swizzled), 128B swizzle


def x_stage_bytes(mt: int) -> int:
    return XK * 2 * mt


def smem_bytes(wtype: str, in_dim: int, layout: str, mt: int, rgroups: int, kparts: int, stages: int) -> int:
    """Alignment slack, each K part's two X buffers, every warp's weight stream, two mbarriers a K part."""
    return (ALIGN + 2 * kparts * x_stage_bytes(mt) + 4 * rgroups * kparts * warp_bytes(wtype, in_dim, layout, stages)
            + 16 * kparts)


def check_shape(wtype: str, in_dim: int, layout: str, mt: int, rgroups: int, kparts: int, stages: int) -> None:
    check_weight_layout(wtype, in_dim, layout)
    if mt not in WG_MTS:
        raise ValueError(f"mt (tokens per CTA) must be one of {WG_MTS}, got {mt}")
    if rgroups not in (1, 2) or kparts not in (1, 2, 4) or rgroups * kparts > 4:
        raise ValueError(f"rgroups must be 1 or 2 and kparts 1, 2 or 4, at most 4 warpgroups, got {rgroups} x {kparts}")
    if not 2 <= stages <= 6:
        raise ValueError(f"stages must be 2..6, got {stages}")
    if in_dim % CHUNK or in_dim // CHUNK < kparts:
        raise ValueError(f"gemm_wg needs K a multiple of {CHUNK} with a chunk per K part, got {in_dim} for {kparts} parts")
    if mt == 256 and rgroups * kparts > 2:
        raise ValueError(f"mt=256 holds 128 accumulators a thread: at most 2 warpgroups, got {rgroups * kparts}")
    smem = smem_bytes(wtype, in_dim, layout, mt, rgroups, kparts, stages)
    if smem > MAX_DYN_SMEM:
        raise ValueError(f"{wtype} mt={mt} rgroups={rgroups} kparts={kparts} stages={stages} needs {smem} bytes of "
                         f"shared memory, more than {MAX_DYN_SMEM}")


def _grid() -> list[dict]:
    g = []
    for wt in ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q4_1", "Q5_0", "Q5_1"):
        g.append({"wtype": wt, "in_dim": 4096, "layout": "tiles", "mt": 128, "kparts": 2, "stages": 2,
                  "residual": True})
        g.append({"wtype": wt, "in_dim": 4096, "layout": "glu-tiles", "mt": 128, "rgroups": 2, "stages": 2,
                  "glu": True, "out_f16": True})
        g.append({"wtype": wt, "in_dim": 14336, "layout": "tiles", "mt": 64, "stages": 4, "bias": True})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "tiles", "mt": 256, "stages": 2})
    g.append({"wtype": "Q4_K", "in_dim": 4096, "layout": "rows", "mt": 32, "kparts": 4, "stages": 2})
    g.append({"wtype": "F16", "in_dim": 2048, "layout": "rows", "mt": 32, "stages": 2})
    return g


@kernel("gemm_wg", grid=_grid(), arch="sm_90a")
def gemm_wg(m: Module, wtype: str = "Q4_K", in_dim: int = 4096, layout: str = "tiles", mt: int = 128,
            rgroups: int = 1, kparts: int = 1, stages: int = 3, unroll: int = 1, bias: bool = False,
            residual: bool = False, out_f16: bool = False, glu: bool = False) -> KernelBuilder:
    """Y[:m] = X[:m] W^T (+ bias) (+ residual), or with ``glu`` silu(X G^T) * (X U^T) for W = [gate; up];
    W of ``wtype`` in ``layout``, X f16, f32 accumulation on wgmma. Params: w, x, y, [bias], [residual], m,
    n, lda, ldy. Launch: grid (ceil(rows_out / meta["rows_per_cta"]), ceil(m / mt)), block meta["block"],
    dyn_smem meta["dyn_smem"]."""
    check_shape(wtype, in_dim, layout, mt, rgroups, kparts, stages)
    if unroll not in (1, 2, 4):
        raise ValueError(f"unroll (32-value blocks decoded per MMA group) must be 1, 2 or 4, got {unroll}")
    flags, params = epilogue_signature(["w", "x", "y"], ["m", "n", "lda", "ldy"], bias=bias, residual=residual,
                                       out_f16=out_f16, glu=glu, layout=layout)
    name = f"gemm_wg_{wtype.lower()}_k{in_dim}_{layout.replace('-', '_')}_m{mt}_r{rgroups}x{kparts}_s{stages}_u{unroll}{flags}"
    group = 128 * rgroups  # threads of a K part (they share its X buffers)
    threads = group * kparts
    k = m.kernel(name, params, max_threads=threads)
    slot_bytes = 16 * seg_bytes(wtype, in_dim, layout)
    wbytes = warp_bytes(wtype, in_dim, layout, stages)
    xs_bytes = x_stage_bytes(mt)
    k.meta.update(block=threads, dyn_smem=smem_bytes(wtype, in_dim, layout, mt, rgroups, kparts, stages),
                  rows_per_cta=(8 if glu else 16) * 4 * rgroups, mt=mt)
    nc = in_dim // CHUNK

    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    wg = k.shr(warp, 2)
    rg, kp = (k.and_(wg, rgroups - 1), k.shr(wg, rgroups - 1)) if rgroups > 1 else (k.mov(0, "u32"), wg)
    r, q = k.shr(lane, 2), k.and_(lane, 3)
    n_rows = k.param("n")
    m_all = k.param("m")
    strip = k.add(k.mul(k.ctaid(), 4 * rgroups), k.add(k.shl(rg, 2), k.and_(warp, 3)))
    tok0 = k.mul(k.ctaid("y"), mt)
    smem0 = k.and_(k.add(k.dynamic_shared(), ALIGN - 1), -ALIGN & 0xFFFFFFFF)
    xbase = k.add(smem0, k.mul(kp, 2 * xs_bytes))  # this K part's two X buffers
    wbase = k.add(k.add(smem0, 2 * kparts * xs_bytes), k.mul(warp, wbytes))
    ws = WeightStream(k, wtype, in_dim, layout, glu, lane, r, strip, n_rows)

    # the K part's chunk range
    if nc % kparts == 0:
        c_first = k.mul(kp, nc // kparts)
        n_my = k.mov(nc // kparts, "u32")
    else:
        c_first = k.div(k.mul(kp, nc), kparts)
        n_my = k.sub(k.div(k.mul(k.add(kp, 1), nc), kparts), c_first)
    ws.decode_setup(lane, q)

    mbar = k.add(k.add(smem0, 2 * kparts * xs_bytes + 4 * rgroups * kparts * wbytes), k.shl(kp, 4))  # X buffers' fills
    with k.if_(k.setp("eq", k.sub(tid, k.mul(kp, group)), 0)):
        for hb in range(2):
            k.mbarrier_init(k.add(mbar, 8 * hb) if hb else mbar, group)
    k.fence_mbarrier_init()
    k.bar_sync()
    xs = _XStager(k, mt, group, k.sub(tid, k.mul(kp, group)), xbase, xs_bytes, tok0, m_all)
    desc0 = [k.or_(k.cvt(k.shr(k.add(xbase, hb * xs_bytes), 4), "u64"), DESC_FIXED, "b64") for hb in range(2)]
    scale_d = k.setp("ne", k.mov(1, "u32"), 0)
    acc = [k.var("f32", 0.0) for _ in range(mt // 2)]

    for s in range(stages - 1):
        ws.issue(c_first, n_my, k.mov(s, "u32"), k.add(wbase, s * slot_bytes) if s else wbase)
        k.cp_async_commit()
    k.grid_dependency_wait()  # X (and the residual) come from the kernels before
    xs.issue(c_first, 0, 0, None)  # X stage 0 (chunk c_first, first half) into buffer 0
    k.cp_async_mbarrier_arrive(mbar)
    k.mbarrier_wait(mbar, 0)
    k.fence_proxy_async()

    ring = stages * slot_bytes
    rd = k.var("u32", 0)
    wr = k.var("u32", (stages - 1) * slot_bytes)
    with k.loop(0, n_my) as i:
        k.cp_async_wait_group(stages - 2)
        k.bar_warp_sync()
        c = k.add(c_first, i)
        ch = ws.prep(k.add(wbase, rd), c, (wbase, stages * slot_bytes))
        parity = k.and_(i, 1)
        for h in range(2):  # X stage = this half of the chunk, in buffer h; the next stage goes to 1 - h
            for g in range(0, 4, unroll):  # blocks g.. decoded together (independent chains), then their MMAs
                words = [ws.words(ch, 4 * h + b) for b in range(g, g + unroll)]
                k.wgmma_fence()
                for b, (a_r, a_r8) in enumerate(words, g):
                    for s in range(2):
                        off = ((b >> 1) * mt * 128 + 32 * (2 * (b & 1) + s)) >> 4
                        k.wgmma_f16(acc, [a_r[2 * s], a_r8[2 * s], a_r[2 * s + 1], a_r8[2 * s + 1]],
                                    k.add(desc0[h], off, "u64"), scale_d)
                k.wgmma_commit()
                k.wgmma_wait(1)
                if g == 0:  # this warpgroup's MMAs that read buffer 1 - h are done: fill it with the next stage
                    if rgroups > 1:  # (once the other row group's are done too)
                        k.bar_sync(1 if kparts == 1 else k.add(kp, 1), group)
                    if h == 0:
                        xs.issue(c, 1, 1, None)
                    else:
                        xs.issue(k.add(c, 1), 0, 0, k.setp("lt", k.add(i, 1), n_my))
                    k.cp_async_mbarrier_arrive(k.add(mbar, 8) if h == 0 else mbar)
                    if h == 0:  # (after the X copies: the fill's arrival waits for nothing issued later)
                        ws.issue(c_first, n_my, k.add(i, stages - 1), k.add(wbase, wr))
                        k.cp_async_commit()
            k.mbarrier_wait(k.add(mbar, 8) if h == 0 else mbar, parity if h == 0 else k.xor(parity, 1))
            k.fence_proxy_async()  # (the copies' generic-proxy writes before the MMAs' async-proxy reads)
        for v in (rd, wr):
            nxt = k.add(v, slot_bytes)
            k.assign(v, k.selp(0, nxt, k.setp("eq", nxt, ring), "u32"))
    k.wgmma_wait(0)
    k.cp_async_wait_all()

    tiles = [acc[4 * t:4 * t + 4] for t in range(mt // 8)]
    if kparts > 1:  # sum the K parts through shared memory (over the X buffers, now unused)
        k.bar_sync()
        warp_in_part = k.add(k.shl(rg, 2), k.and_(warp, 3))
        red = k.add(smem0, k.shl(lane, 2))
        part_bytes = mt * 64  # one warp's accumulators
        with k.if_(k.setp("ne", kp, 0)):
            base = k.add(red, k.mul(k.mad(k.sub(kp, 1), 4 * rgroups, warp_in_part), part_bytes))
            for e, v in enumerate(acc):
                k.store("shared", "f32", base, v, e * 128)
        k.bar_sync()
        done = k.new_label("done")
        k.bra(done, k.setp("ne", kp, 0))
        for p in range(1, kparts):
            base = k.add(red, k.mul(k.add(warp_in_part, (p - 1) * 4 * rgroups), part_bytes))
            for e, v in enumerate(acc):
                k.assign(v, k.add(v, k.load("shared", "f32", base, e * 128)))
    epilogue(k, tiles, r, q, m_all, n_rows, ws.first, ws.ffn, bias, residual, out_f16, glu, tok_base=tok0)
    if kparts > 1:
        k.label(done)
    k.ret()
    return k


class _XStager:
    """One K part's X stages, copied by its ``group`` threads with 4-byte ``cp.async`` straight into the swizzled,
    word-transposed layout: 16 lanes a token (lane ``j``: word ``j`` of each of the token's 32-value blocks, i.e.
    word ``j % 4`` of piece ``j / 4``, which lands in stored piece ``j % 4`` at word ``j / 4``), ``group / 16``
    tokens a pass."""

    def __init__(self, k: KernelBuilder, mt: int, group: int, gt: Reg, xbase: Reg, xs_bytes: int, tok0: Reg,
                 m_all: Reg):
        self.k, self.mt, self.xs_bytes = k, mt, xs_bytes
        self.tpp = group // 16  # tokens a pass
        j, n0 = k.and_(gt, 15), k.shr(gt, 4)
        lda2 = k.shl(k.param("lda"), 1)
        tok = k.add(tok0, n0)
        self.left = k.sub(m_all, tok, "s32")  # tokens from this thread's first one to m
        self.src0 = k.add(k.add(k.global_ptr("x"), k.mul_wide(tok, lda2)), k.cvt(k.shl(j, 2), "u64"))
        self.pass_bytes = k.mul_wide(lda2, self.tpp)
        row = k.add(k.add(xbase, k.shl(n0, 7)), k.shl(k.shr(j, 2), 2))
        sw = k.and_(n0, 7)  # (every token of the thread's passes: n0 + a multiple of 8)
        self.dst = [k.add(row, k.shl(k.xor(k.add(k.and_(j, 3), 4 * par), sw), 4)) for par in range(2)]

    def issue(self, c: Reg, half: int, buf: int, ok: Reg | None) -> None:
        """The copies of the stage (chunk ``c``, ``half``) into buffer ``buf`` (none where ``ok`` is false)."""
        k, mt = self.k, self.mt
        src = k.add(self.src0, k.mul_wide(c, 2 * CHUNK))
        for v in range(mt // self.tpp):
            live = k.both(ok, k.setp("gt", self.left, v * self.tpp, "s32"))
            for blk in range(4):
                k.cp_async4(self.dst[blk & 1], src, pred=live,
                            dst_offset=buf * self.xs_bytes + (blk >> 1) * mt * 128 + v * self.tpp * 128,
                            src_offset=2 * XK * half + 64 * blk)
            if v + 1 < mt // self.tpp:
                src = k.add(src, self.pass_bytes)
