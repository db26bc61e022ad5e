"""Flash attention for prefill on tensor cores: ``S = Q K^T`` and ``O += P V`` as f16 ``mma.sync``
(m16n8k16, f32 accumulation), the online softmax in f32 registers between them.

``q: [num_heads, seq_q, D]`` f32, ``k, v: [num_kv_heads, kv_stride, D]`` f32 (the KV cache, read in
place; query head h reads kv head ``h / group``), ``out: [seq_q, num_heads * D]`` f16, token-major (the
next GEMM's A operand). Causal attention is bottom-right aligned as in :mod:`flash_attention`: query i
sits at position ``q_offset + i`` and sees keys ``0 .. q_offset + i``.

A CTA takes 64 queries of one head, 4 warps of 16 query rows. Q is scaled by ``log2(e) / sqrt(D)``
while it is converted to f16 into shared memory, then each warp keeps its A fragments in registers.
Per tile of 64 keys, the CTA converts K and V to f16 into shared memory (rows padded by 16 bytes:
the 8 rows an ``ldmatrix`` reads hit 8 bank groups); each warp computes its 16 x 64 scores (K as the
B operand through ``ldmatrix``), masks keys past ``seq_k`` and, if causal, past the query's position,
updates the running row max and sum with ``ex2``, rescales O, and multiplies the probabilities —
re-packed as f16 A fragments straight from the score registers — by V (B fragments through
``ldmatrix.trans``). Key tiles past the CTA's last query position are skipped. O is divided by the
row sum at the end (a row with no visible key would give 0; causal rows always see key 0).

Rounding, stated: Q, K, V and P enter the MMAs as f16; scores, softmax and O stay f32.
Launch: grid ``(ceil(seq_q / 64), num_heads)``, block 128, dynamic shared memory ``meta["dyn_smem"]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.decode_core import LOG2E

BQ = 64  # queries per CTA (4 warps x 16)
BK = 64  # keys per tile
HEAD_DIMS = (32, 48, 64, 80, 96, 128)


def staged_row_bytes(d: int) -> int:
    return 2 * d + 16


def smem_bytes(d: int) -> int:
    return (BQ + 2 * BK) * staged_row_bytes(d)


def _stage_f16(k: KernelBuilder, src: Reg, rows_valid: Reg, dst: Reg, d: int, tid: Reg, scale: float | None,
               row_stride: int) -> None:
    """Copy 64 rows of ``d`` f32 (``row_stride`` bytes apart from ``src``) into f16 shared rows of
    :func:`staged_row_bytes`, zeros for rows at or past ``rows_valid``; ``scale`` multiplies on the way."""
    vecs = d // 4  # float4 per row
    total = 64 * vecs
    for i in range(-(-total // 128)):
        idx = k.add(tid, i * 128) if i else tid
        ok_idx = k.setp("lt", idx, total) if (i + 1) * 128 > total else None
        row, c4 = k.div(idx, vecs), k.rem(idx, vecs)
        ok = k.setp("lt", row, rows_valid)
        ok = ok if ok_idx is None else k.both(ok, ok_idx)
        g = k.add(src, k.cvt(k.mad(row, row_stride, k.shl(c4, 4)), "u64"))
        v = list(k.load("global", "f32", g, vec=4, pred=ok, other=0.0))
        if scale is not None:
            v = [k.mul(x, scale) for x in v]
        h = [k.cvt(x, "f16") for x in v]
        words = [k.pack_b32(h[0], h[1]), k.pack_b32(h[2], h[3])]
        s = k.add(dst, k.mad(row, staged_row_bytes(d), k.shl(c4, 3)))
        k.store("shared", "b32", s, words, pred=ok_idx)


def _scores(k: KernelBuilder, qa: list, kb: Reg, d: int) -> list:
    """The warp's 16 x 64 scores (``kb``: the lane's ldmatrix row in the K tile): 8 n8 tiles of 4 f32
    per thread."""
    acc = [[k.mov(0.0, "f32") for _ in range(4)] for _ in range(BK // 8)]
    for kk in range(d // 16):
        for nj in range(BK // 16):
            d0, d1, d2, d3 = k.ldmatrix_x4(kb, nj * 16 * staged_row_bytes(d) + kk * 32)
            acc[2 * nj] = list(k.mma_f16(qa[kk], (d0, d1), acc[2 * nj]))
            acc[2 * nj + 1] = list(k.mma_f16(qa[kk], (d2, d3), acc[2 * nj + 1]))
    return acc


@kernel("flash_attention_mma", grid=[{"head_dim": d, "group": g, "causal": c}
                                     for d, g, c in ((64, 3, True), (128, 4, True), (80, 1, False), (32, 2, True),
                                                     (96, 1, True), (48, 7, False))])
def flash_attention_mma(m: Module, head_dim: int = 128, group: int = 1, causal: bool = True) -> KernelBuilder:
    """Prefill attention on tensor cores, output token-major f16. Params: q, k, v, out, seq_q, seq_k,
    q_offset, kv_stride, num_heads. Launch: grid (ceil(seq_q / 64), num_heads), block 128."""
    d = head_dim
    if d not in HEAD_DIMS:
        raise ValueError(f"the tensor-core prefill attention takes head_dim in {HEAD_DIMS}, got {d}")
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    name = f"flash_attention_mma_d{d}_g{group}" + ("_causal" if causal else "")
    k = m.kernel(name, [("q", "u64"), ("k", "u64"), ("v", "u64"), ("out", "u64"), ("seq_q", "u32"),
                        ("seq_k", "u32"), ("q_offset", "u32"), ("kv_stride", "u32"), ("num_heads", "u32")],
                 max_threads=128)
    st = setup_cta(k, d, group, "kv_stride", wait=True)
    kv_off = k.mul_wide(k.mul(st.kvh, st.extra), d * 4)
    k_base, v_base = k.add(k.global_ptr("k"), kv_off), k.add(k.global_ptr("v"), kv_off)
    query_rows(k, st, d, causal)

    def stage(key0: Reg) -> None:  # K and V rows key0.. of the kv head, read in place
        off = k.mul_wide(key0, d * 4)
        left = k.sub(st.seq_k, key0)
        _stage_f16(k, k.add(k_base, off), left, st.ks, d, st.tid, None, d * 4)
        _stage_f16(k, k.add(v_base, off), left, st.vs, d, st.tid, None, d * 4)

    key_tile_loop(k, st, d, causal, stage)
    return k


@dataclass
class _State:
    """Registers of the CTA's work that the kernels built on :func:`setup_cta` share (shared-memory tiles,
    the lane's fragments and rows, the running softmax)."""

    tid: Reg
    warp: Reg
    t: Reg
    g: Reg
    head: Reg
    seq_q: Reg
    seq_k: Reg
    extra: Reg  # the kernel's own u32 parameter read right after q_offset (kv_stride, n_kv)
    ks: Reg
    vs: Reg
    qa: list
    kb: Reg
    vb: Reg
    kvh: Reg
    q0: Reg
    q_offset: Reg
    n_tiles: Reg | None = None
    row_a: Reg | None = None
    pos: list | None = None
    o: list | None = None
    mx: list | None = None
    ls: list | None = None


def setup_cta(k: KernelBuilder, d: int, group: int, extra_param: str, wait: bool) -> _State:
    """The part of a tensor-core prefill attention kernel before its K/V addressing: meta, lane roles,
    the Q tile staged (scaled for the base-2 softmax) into A fragments, the ldmatrix lane addresses of
    the K and V tiles, the kv head. ``wait``: a programmatic-dependent-launch wait before Q is read."""
    k.meta.update(block=128, dyn_smem=smem_bytes(d), block_q=BQ)
    rb = staged_row_bytes(d)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    g, t = k.shr(lane, 2), k.and_(lane, 3)
    head, q0 = k.ctaid("y"), k.mul(k.ctaid("x"), BQ)
    seq_q, seq_k, q_offset = k.param("seq_q"), k.param("seq_k"), k.param("q_offset")
    extra = k.param(extra_param)
    smem = k.dynamic_shared()
    qs, ks, vs = smem, k.add(smem, BQ * rb), k.add(smem, (BQ + BK) * rb)
    if wait:
        k.grid_dependency_wait()
    # Q tile -> f16 shared (pre-scaled for base-2 softmax), then into A fragments
    q_src = k.add(k.global_ptr("q"), k.mul_wide(k.mad(head, seq_q, q0), d * 4))
    _stage_f16(k, q_src, k.sub(seq_q, q0), qs, d, tid, LOG2E / math.sqrt(d), d * 4)
    k.bar_sync()
    r8, j = k.and_(lane, 7), k.shr(lane, 3)
    lane_a = k.mad(k.add(k.mad(warp, 16, r8), k.shl(k.and_(j, 1), 3)), rb, k.shl(k.shr(j, 1), 4))
    qa = [k.ldmatrix_x4(k.add(qs, lane_a), kk * 32) for kk in range(d // 16)]
    lane_b = k.mad(k.add(r8, k.shl(k.shr(j, 1), 3)), rb, k.shl(k.and_(j, 1), 4))  # K: (keys hi) x (d hi)
    lane_v = k.mad(k.add(r8, k.shl(k.and_(j, 1), 3)), rb, k.shl(k.shr(j, 1), 4))  # V^T: (keys hi) x (d hi)
    kb, vb = k.add(ks, lane_b), k.add(vs, lane_v)
    kvh = k.div(head, group)
    return _State(tid=tid, t=t, g=g, head=head, seq_q=seq_q, seq_k=seq_k, extra=extra, ks=ks, vs=vs, qa=qa,
                  kb=kb, vb=vb, kvh=kvh, q0=q0, q_offset=q_offset, warp=warp)


def query_rows(k: KernelBuilder, st: _State, d: int, causal: bool) -> None:
    """This CTA's key range and each thread's two query rows (positions); O, max and sum zeroed."""
    key_end = st.seq_k
    if causal:
        last = k.add(st.q_offset, k.min(k.add(st.q0, BQ), st.seq_q))
        key_end = k.min(st.seq_k, last)
    st.n_tiles = k.div(k.add(key_end, BK - 1), BK)
    st.row_a = k.add(st.q0, k.mad(st.warp, 16, st.g))
    st.pos = [k.add(st.q_offset, st.row_a), k.add(st.q_offset, k.add(st.row_a, 8))]
    st.o = [[k.var("f32", 0.0) for _ in range(4)] for _ in range(d // 8)]
    st.mx = [k.var("f32", float("-inf")) for _ in range(2)]
    st.ls = [k.var("f32", 0.0) for _ in range(2)]


def key_tile_loop(k: KernelBuilder, st: _State, d: int, causal: bool, stage) -> None:
    """The loop over 64-key tiles (``stage(key0)`` fills the K and V tiles between the barriers), then
    O / l stored and the kernel's return."""
    with k.loop(0, st.n_tiles) as jt:
        key0 = k.mul(jt, BK)
        k.bar_sync()  # every warp is done with the previous K/V tile
        stage(key0)
        k.bar_sync()
        s = _scores(k, st.qa, st.kb, d)
        _softmax_update(k, s, st.o, st.mx, st.ls, key0, st.t, st.pos, st.seq_k, causal)
        _accumulate_pv(k, s, st.o, st.vb, d)
    _store(k, st.o, st.ls, st.row_a, st.seq_q, st.head, st.g, st.t, d)
    k.ret()


def _softmax_update(k, s, o, mx, ls, key0, t, pos, seq_k, causal) -> None:
    """Mask, running max, rescale O and the row sums, turn the scores into probabilities in place."""
    for h in range(2):  # the thread's rows g and g + 8: accumulator elements 2h, 2h + 1
        vals = []
        for nt in range(BK // 8):
            for e in range(2):
                key = k.add(key0, k.add(k.shl(t, 1), nt * 8 + e))
                bad = k.setp("ge", key, seq_k)
                if causal:
                    bad = k.or_(bad, k.setp("gt", key, pos[h]))
                s[nt][2 * h + e] = k.selp(float("-inf"), s[nt][2 * h + e], bad, "f32")
                vals.append(s[nt][2 * h + e])
        tile_max = vals[0]
        for v in vals[1:]:
            tile_max = k.max(tile_max, v)
        for sh in (1, 2):
            tile_max = k.max(tile_max, k.bitcast(k.shfl("bfly", k.bitcast(tile_max, "b32"), sh), "f32"))
        new = k.max(mx[h], tile_max)
        base = k.selp(0.0, new, k.setp("eq", new, float("-inf")), "f32")  # no visible key yet: keep 0s
        corr = k.ex2(k.sub(mx[h], base))
        k.assign(mx[h], new)
        row_sum = None
        for nt in range(BK // 8):
            for e in range(2):
                p = k.ex2(k.sub(s[nt][2 * h + e], base))
                s[nt][2 * h + e] = p
                row_sum = p if row_sum is None else k.add(row_sum, p)
        k.assign(ls[h], k.fma(ls[h], corr, row_sum))
        for dn in range(len(o)):
            for e in range(2):
                k.assign(o[dn][2 * h + e], k.mul(o[dn][2 * h + e], corr))


def _accumulate_pv(k, p, o, vb, d) -> None:
    """O += P V: P's f16 A fragments from the probability registers, V's B fragments by ldmatrix.trans."""
    h16 = lambda a, b: k.pack_b32(k.cvt(a, "f16"), k.cvt(b, "f16"))  # noqa: E731
    for kk in range(BK // 16):
        a = (h16(p[2 * kk][0], p[2 * kk][1]), h16(p[2 * kk][2], p[2 * kk][3]),
             h16(p[2 * kk + 1][0], p[2 * kk + 1][1]), h16(p[2 * kk + 1][2], p[2 * kk + 1][3]))
        for dj in range(d // 16):
            b0, b1, b2, b3 = k.ldmatrix_x4(vb, kk * 16 * staged_row_bytes(d) + dj * 32, trans=True)
            k.mma_f16(a, (b0, b1), o[2 * dj], into=o[2 * dj])
            k.mma_f16(a, (b2, b3), o[2 * dj + 1], into=o[2 * dj + 1])


def _store(k, o, ls, row_a, seq_q, head, g, t, d) -> None:
    """O / l per row, as f16, to out[row, head * D + column] (the row sum is spread over the quad)."""
    out = k.global_ptr("out")
    width = k.mul(k.param("num_heads"), d)
    for h in range(2):
        total = ls[h]
        for sh in (1, 2):
            total = k.add(total, k.bitcast(k.shfl("bfly", k.bitcast(total, "b32"), sh), "f32"))
        inv = k.rcp(k.max(total, 1e-30))
        row = k.add(row_a, 8 * h)
        ok = k.setp("lt", row, seq_q)
        base = k.mad(row, width, k.mad(head, d, k.shl(t, 1)))
        for dn in range(len(o)):
            pair = k.pack_b32(k.cvt(k.mul(o[dn][2 * h], inv), "f16"), k.cvt(k.mul(o[dn][2 * h + 1], inv), "f16"))
            k.store("global", "b32", k.add(out, k.mul_wide(k.add(base, dn * 8), 2)), pair, pred=ok)
