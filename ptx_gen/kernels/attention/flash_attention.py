"""Flash attention for prefill: many queries per head, K/V tiles through shared memory, f32 FMAs.

``q, out: [num_heads, seq_q, head_dim]``; ``k, v: [num_kv_heads, kv_stride, head_dim]`` of which the
first ``seq_k`` rows are used (``kv_stride = seq_k`` for packed inputs, ``= max_len`` to read a KV
cache in place). Causal attention is bottom-right aligned: query ``i`` sits at position
``q_offset + i`` and sees keys ``0 .. q_offset + i`` (``q_offset = seq_k - seq_q`` when the queries are
the last positions of the sequence). Any ``seq_q, seq_k >= 1``; partial tiles are masked, and the
causal key range of a query tile is ``[0, min(seq_k, q_offset + last_row + 1))`` for any tile sizes.

Block layout: ``8 * row_groups`` threads; thread ``(ty, tx)`` owns query rows ``ty * R + a``
(``a < R``), keys ``tx + 8 b`` of each key tile (``b < KC``) and float4 output columns ``tx + 8 j``.
Per key tile: load K and V tiles to shared memory, scores from shared Q and K, online softmax per
row (row max over the 8 lanes of a row by butterfly, the row sum kept per thread and reduced once at
the end), P to shared memory, then O += P V.

With ``block_size`` K and V are paged f32 pools ``[num_blocks, n_kv, block_size, head_dim]`` read through
one sequence's block table (key ``p`` in block ``block_table[p // block_size]``, row ``p % block_size``;
params ``n_kv, block_table`` in place of ``kv_stride``; :mod:`ptx_gen.kernels.kv.paged_kv`).

``flash_attention_tokens_f16`` is the same kernel writing its output token-major in f16,
``out[i, h * head_dim + j]`` (rows ``num_heads * head_dim`` apart, ``num_heads`` = grid.y; rounded to
nearest even): the A operand of the output projection's f16 tensor-core GEMM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.decode_core import LOG2E, NEG_INF, check_head_dim, online_softmax, safe_reciprocal
from ptx_gen.kernels.kv.paged_kv import check_paged, log2

_GRID = [
    {"head_dim": 64, "group": 1, "causal": True},
    {"head_dim": 64, "group": 7, "causal": False},
    {"head_dim": 128, "group": 4, "causal": True},
    {"head_dim": 80, "group": 2, "causal": True},
    {"head_dim": 256, "group": 1, "causal": False},
    {"head_dim": 48, "group": 3, "causal": True},
    {"head_dim": 96, "group": 1, "causal": True},
    {"head_dim": 32, "group": 2, "causal": False},
    {"head_dim": 64, "group": 3, "causal": True, "block_size": 32},
    {"head_dim": 128, "group": 4, "causal": True, "block_size": 16},
    {"head_dim": 80, "group": 1, "causal": False, "block_size": 64},
    {"head_dim": 256, "group": 2, "causal": True, "block_size": 32},
]
_GRID_TOKENS_F16 = [
    {"head_dim": 64, "group": 3, "causal": True},
    {"head_dim": 64, "group": 4, "causal": True},
    {"head_dim": 128, "group": 4, "causal": True},
    {"head_dim": 80, "group": 1, "causal": False},
    {"head_dim": 256, "group": 2, "causal": True},
    {"head_dim": 96, "group": 7, "causal": True},
]


_SCORE_BLOCK = 8  # float4 steps per partial dot product (32 elements)


def prefill_tiles(head_dim: int, rows_per_thread: int | None, keys_per_thread: int, row_groups: int):
    """(R, KC, TY, BQ, BK, DP, BKP, smem bytes) for the prefill kernel."""
    check_head_dim(head_dim)
    if head_dim % 8:
        raise ValueError(f"flash attention needs head_dim % 8 == 0 (bank-conflict-free tiles), got {head_dim}")
    r = rows_per_thread if rows_per_thread is not None else (4 if head_dim <= 128 else 2)
    if r not in (1, 2, 4, 8) or keys_per_thread not in (1, 2, 4, 8) or row_groups not in (4, 8, 16, 32):
        raise ValueError(f"bad prefill tiling: rows_per_thread={r}, keys_per_thread={keys_per_thread}, "
                         f"row_groups={row_groups}")
    bq, bk = row_groups * r, 8 * keys_per_thread
    dp = head_dim + 4  # padded row: (dp / 4) odd, so 8 lanes reading 8 rows hit 8 distinct bank groups
    pad = next((p for p in range(0, 32) if (r * (bk + p)) % 32 in (8, 24)), 1)
    bkp = bk + pad
    smem = (bq * dp + 2 * bk * dp + bq * bkp) * 4
    return r, keys_per_thread, row_groups, bq, bk, dp, bkp, smem


@dataclass
class _Prefill:
    """What the phases of :func:`flash_attention` share: the builder, the tiling, and the block's
    registers (thread coordinates, sequence lengths, shared-memory tiles)."""
    k: KernelBuilder
    D: int  # head_dim
    R: int  # query rows per thread
    KC: int  # keys per thread of a key tile
    BQ: int  # query rows per block
    BK: int  # keys per key tile
    DP: int  # padded row of a shared Q/K/V tile, floats
    BKP: int  # padded row of the shared P tile, floats
    NT: int  # threads per block
    causal: bool
    seq_q: Reg
    seq_k: Reg
    q_offset: Reg
    tid: Reg
    ty: Reg
    tx: Reg
    q0: Reg  # the block's first query row
    q_s: Reg
    k_s: Reg
    v_s: Reg
    p_s: Reg
    out_tokens_f16: bool = False  # out is [seq_q, num_heads * D] f16 instead of [num_heads, seq_q, D] f32
    block_size: int | None = None  # K/V: paged pools read through a block table
    table: Reg | None = None
    kv_row: Reg | None = None  # paged: the kv head's row offset (kvh * block_size) inside a block

    @property
    def NC(self) -> int:  # float4 columns of a row
        return self.D // 4

    @property
    def NJ(self) -> int:  # float4 output columns per thread (the last may not exist for every tx)
        return -(-self.NC // 8)


@kernel("flash_attention", grid=_GRID)
def flash_attention(
    m: Module, head_dim: int = 128, group: int = 1, causal: bool = True,
    rows_per_thread: int | None = None, keys_per_thread: int = 4, row_groups: int = 16,
    block_size: int | None = None,
) -> KernelBuilder:
    """Multi-head (GQA) attention of seq_q queries over seq_k keys, causal or not, tiled through
    shared memory (``block_size``: K/V from paged pools through a block table). Launch: grid
    (ceil(seq_q / meta['block_q']), num_heads), block meta['block'], dynamic shared memory meta['dyn_smem']."""
    return build_flash_attention(m, head_dim, group, causal, rows_per_thread, keys_per_thread, row_groups,
                                 block_size=block_size)


@kernel("flash_attention_tokens_f16", grid=_GRID_TOKENS_F16)
def flash_attention_tokens_f16(
    m: Module, head_dim: int = 128, group: int = 1, causal: bool = True,
    rows_per_thread: int | None = None, keys_per_thread: int = 4, row_groups: int = 16,
) -> KernelBuilder:
    """:func:`flash_attention` writing the output token-major in f16: ``out [seq_q, num_heads *
    head_dim]`` (num_heads = grid.y). Launch: as flash_attention."""
    return build_flash_attention(m, head_dim, group, causal, rows_per_thread, keys_per_thread, row_groups,
                                 out_tokens_f16=True)


def build_flash_attention(m: Module, head_dim: int, group: int, causal: bool, rows_per_thread: int | None,
                          keys_per_thread: int, row_groups: int, out_tokens_f16: bool = False,
                          block_size: int | None = None) -> KernelBuilder:
    """The kernel of :func:`flash_attention` (``out_tokens_f16``: of :func:`flash_attention_tokens_f16`)."""
    R, KC, TY, BQ, BK, DP, BKP, smem = prefill_tiles(head_dim, rows_per_thread, keys_per_thread, row_groups)
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive integer, got {group!r}")
    D, NC = head_dim, head_dim // 4
    NJ = -(-NC // 8)  # float4 output columns per thread (the last may not exist for every tx)
    NT = 8 * TY
    name = f"flash_attention_d{D}_g{group}_{'causal' if causal else 'full'}_r{R}k{KC}t{TY}"
    name += "_tok16" if out_tokens_f16 else ""
    params = [("q", "u64"), ("k", "u64"), ("v", "u64"), ("out", "u64"), ("seq_q", "u32"), ("seq_k", "u32"),
              ("q_offset", "u32"), ("kv_stride", "u32")]
    if block_size is not None:
        check_paged(block_size, "f32", head_dim)
        name += f"_b{block_size}"
        params = params[:-1] + [("n_kv", "u32"), ("block_table", "u64")]
    # no .maxntid: with it ptxas caps registers near 128 and spills the D = 48/80/96 variants
    k = m.kernel(name, params)
    k.meta.update(block=NT, block_q=BQ, block_k=BK, dyn_smem=smem)
    seq_q, seq_k, q_offset = (k.param(p) for p in ("seq_q", "seq_k", "q_offset"))
    kv_stride = k.param("kv_stride") if block_size is None else None
    tid = k.tid()
    ty, tx = k.shr(tid, 3), k.and_(tid, 7)
    qtile = k.sub(k.sub(k.sreg("nctaid.x"), 1, "u32"), k.ctaid("x"))  # long causal tiles first
    head = k.ctaid("y")
    kvh = k.div(head, group) if group > 1 else head
    q0 = k.mul(qtile, BQ)

    smem_base = k.dynamic_shared()
    t = _Prefill(k, D, R, KC, BQ, BK, DP, BKP, NT, causal, seq_q, seq_k, q_offset, tid, ty, tx, q0,
                 q_s=smem_base, k_s=k.add(smem_base, BQ * DP * 4), v_s=k.add(smem_base, (BQ + BK) * DP * 4),
                 p_s=k.add(smem_base, (BQ + 2 * BK) * DP * 4), out_tokens_f16=out_tokens_f16)
    _load_q_tile(t, head)

    if block_size is None:
        kv_off = k.mul(k.mul_wide(kvh, kv_stride), D * 4, "u64")
        k_head = k.add(k.global_ptr("k"), kv_off)
        v_head = k.add(k.global_ptr("v"), kv_off)
    else:
        t.block_size, t.table = block_size, k.global_ptr("block_table")
        t.kv_row = k.mul(kvh, block_size)
        k_head, v_head = k.global_ptr("k"), k.global_ptr("v")

    if causal:
        last_q = k.min(k.add(q0, BQ), seq_q, "u32")
        kend = k.min(k.add(q_offset, last_q), seq_k, "u32")
    else:
        kend = seq_k

    rows = [k.mad(ty, R, a) if a else k.mul(ty, R) for a in range(R)]  # tile-local rows of this thread
    qpos = [k.add(k.add(q_offset, q0), r) for r in rows]
    m_run = [k.var("f32", NEG_INF) for _ in range(R)]
    l_run = [k.var("f32", 0.0) for _ in range(R)]
    acc = [[[k.var("f32", 0.0) for _ in range(4)] for _ in range(NJ)] for _ in range(R)]
    col_ok = [k.setp("lt", k.add(tx, 8 * j), NC) if 8 * (j + 1) > NC else None for j in range(NJ)]

    with k.loop(0, kend, BK) as k0:
        _load_kv_tile(t, k0, k_head, v_head)
        k.bar_sync()
        s, keys = _scores(t, k0, rows)
        _online_softmax(t, s, keys, qpos, rows, m_run, l_run, acc)
        k.bar_sync()
        _accumulate_pv(t, rows, col_ok, acc)
        k.bar_sync()

    _store_out(t, head, rows, l_run, acc, col_ok)
    k.ret()
    return k


def _load_q_tile(t: _Prefill, head: Reg) -> None:
    """Emits the block's Q tile -> shared memory, scaled by log2(e) / sqrt(D) into the log2 domain
    (the softmax then uses ex2); rows past seq_q are zeros."""
    k, D, NC, NT, BQ, DP = t.k, t.D, t.NC, t.NT, t.BQ, t.DP
    qscale = LOG2E / math.sqrt(D)
    q_head = k.add(k.global_ptr("q"), k.mul(k.mul_wide(head, t.seq_q), D * 4, "u64"))
    for it in range(-(-BQ * NC // NT)):
        i = k.add(t.tid, it * NT) if it else t.tid
        row, c4 = k.div(i, NC), k.rem(i, NC)
        ok = k.setp("lt", k.add(t.q0, row), t.seq_q)
        if (it + 1) * NT > BQ * NC:
            ok = k.and_(ok, k.setp("lt", i, BQ * NC))
        src = k.add(q_head, k.mul_wide(k.mad(k.add(t.q0, row), NC, c4), 16))
        vals = k.load("global", "f32", src, vec=4, pred=ok, other=0.0)
        dst = k.add(t.q_s, k.shl(k.mad(row, DP // 4, c4), 4))
        st_ok = k.setp("lt", i, BQ * NC) if (it + 1) * NT > BQ * NC else None
        k.store("shared", "f32", dst, [k.mul(x, qscale) for x in vals], pred=st_ok)


def _load_kv_tile(t: _Prefill, k0: Reg, k_head: Reg, v_head: Reg) -> None:
    """Emits the copy of the K and V tiles of keys k0.. to shared memory (float4 a thread a step);
    rows past seq_k are zeros (their scores are masked anyway)."""
    k, NC, NT, BK, DP = t.k, t.NC, t.NT, t.BK, t.DP
    for it in range(-(-BK * NC // NT)):
        i = k.add(t.tid, it * NT) if it else t.tid
        row, c4 = k.div(i, NC), k.rem(i, NC)
        in_tile = k.setp("lt", i, BK * NC) if (it + 1) * NT > BK * NC else None
        ok = k.setp("lt", k.add(k0, row), t.seq_k)
        if in_tile is not None:
            ok = k.and_(ok, in_tile)
        key = k.add(k0, row)
        if t.block_size is None:
            goff = k.mul_wide(k.mad(key, NC, c4), 16)
        else:  # block table[key / bs] of n_kv heads x bs rows; this head's row key % bs
            bs = t.block_size
            page = k.load("global", "u32", k.add(t.table, k.mul_wide(k.shr(key, log2(bs)), 4)), pred=ok, other=0)
            prow = k.add(k.mad(page, k.mul(k.param("n_kv"), bs), t.kv_row), k.and_(key, bs - 1))
            goff = k.mul_wide(k.mad(prow, NC, c4), 16)
        kvals = k.load("global", "f32", k.add(k_head, goff), vec=4, pred=ok, other=0.0)
        vvals = k.load("global", "f32", k.add(v_head, goff), vec=4, pred=ok, other=0.0)
        soff = k.shl(k.mad(row, DP // 4, c4), 4)
        k.store("shared", "f32", k.add(t.k_s, soff), list(kvals), pred=in_tile)
        k.store("shared", "f32", k.add(t.v_s, soff), list(vvals), pred=in_tile)


def _scores(t: _Prefill, k0: Reg, rows: list) -> tuple[list, list]:
    """Emits the scores s[a][b] of the thread's rows ty*R + a against keys k0 + tx + 8b from the shared
    Q and K tiles, in blocked accumulation: fma chains of 32 elements, then one add per block (a
    256-long chain loses ~2.5x more precision; at head_dim 256 that alone approaches the 1e-5
    tolerance). Returns ``(s, keys)``, keys the absolute key positions."""
    k, R, KC, NC, DP, tx = t.k, t.R, t.KC, t.NC, t.DP, t.tx
    q_row_addr = [k.add(t.q_s, k.mul(r, DP * 4)) for r in rows]
    k_row_addr = [k.add(t.k_s, k.mul(k.add(tx, 8 * b), DP * 4)) for b in range(KC)]
    s = [[None] * KC for _ in range(R)]
    part = [[None] * KC for _ in range(R)]
    for d4 in range(NC):
        qv = [k.load("shared", "f32", q_row_addr[a], d4 * 16, vec=4) for a in range(R)]
        kv = [k.load("shared", "f32", k_row_addr[b], d4 * 16, vec=4) for b in range(KC)]
        for a in range(R):
            for b in range(KC):
                x = None if d4 % _SCORE_BLOCK == 0 else part[a][b]
                for e in range(4):
                    x = k.mul(qv[a][e], kv[b][e]) if x is None else k.fma(qv[a][e], kv[b][e], x)
                part[a][b] = x
                if d4 % _SCORE_BLOCK == _SCORE_BLOCK - 1 or d4 == NC - 1:
                    s[a][b] = x if s[a][b] is None else k.add(s[a][b], x)
    keys = [k.add(k0, k.add(tx, 8 * b)) for b in range(KC)]
    return s, keys


def _online_softmax(t: _Prefill, s: list, keys: list, qpos: list, rows: list, m_run: list, l_run: list,
                    acc: list) -> None:
    """Emits the online softmax step of each of the thread's rows: mask keys past seq_k (and, causal,
    past the row's position), the tile's row max over the 8 lanes of a row by butterfly, rescale the
    running sum and the output accumulators by ex2(m_old - m_new), and write the probabilities P to
    shared memory for the P V step."""
    k, KC, NJ = t.k, t.KC, t.NJ
    key_ok = [k.setp("lt", kp, t.seq_k) for kp in keys]
    for a in range(t.R):
        masked = []
        for b in range(KC):
            ok = key_ok[b]
            if t.causal:
                ok = k.and_(ok, k.setp("le", keys[b], qpos[a]))
            masked.append(k.selp(s[a][b], NEG_INF, ok))
        tmax = masked[0]
        for x in masked[1:]:
            tmax = k.max(tmax, x)
        for off in (1, 2, 4):
            tmax = k.max(tmax, k.shfl("bfly", tmax, off))
        mx = k.max(m_run[a], tmax)
        alpha, probs = online_softmax(k, m_run[a], l_run[a], mx, masked)
        for j in range(NJ):
            for e in range(4):
                k.assign(acc[a][j][e], k.mul(acc[a][j][e], alpha))
        k.assign(m_run[a], mx)
        prow = k.add(t.p_s, k.shl(k.mad(rows[a], t.BKP, t.tx), 2))
        for b in range(KC):
            k.store("shared", "f32", prow, probs[b], offset=8 * b * 4)


def _accumulate_pv(t: _Prefill, rows: list, col_ok: list, acc: list) -> None:
    """Emits O += P V for the thread's rows and float4 output columns tx + 8j, from the shared P and V
    tiles (columns past head_dim read as zeros)."""
    k, R, NJ, DP = t.k, t.R, t.NJ, t.DP
    p_row_addr = [k.add(t.p_s, k.mul(r, t.BKP * 4)) for r in rows]
    v_col_addr = [k.add(t.v_s, k.shl(k.add(t.tx, 8 * j), 4)) for j in range(NJ)]
    for c in range(t.BK):
        pv = [k.load("shared", "f32", p_row_addr[a], c * 4) for a in range(R)]
        for j in range(NJ):
            if col_ok[j] is not None:
                vv = k.load("shared", "f32", v_col_addr[j], c * DP * 4, vec=4, pred=col_ok[j], other=0.0)
            else:
                vv = k.load("shared", "f32", v_col_addr[j], c * DP * 4, vec=4)
            for a in range(R):
                for e in range(4):
                    k.assign(acc[a][j][e], k.fma(pv[a], vv[e], acc[a][j][e]))


def _row_scale(k: KernelBuilder, l_part: Reg) -> Reg:
    """Emits 1 / (the row's softmax sum: the thread's part summed over the 8 lanes of the row), 0 for
    an empty sum."""
    total = l_part
    for off in (1, 2, 4):
        total = k.add(total, k.shfl("bfly", total, off))
    return safe_reciprocal(k, total)


def _store_out(t: _Prefill, head: Reg, rows: list, l_run: list, acc: list, col_ok: list) -> None:
    """Emits the end: each row's softmax sum reduced over its 8 lanes, the accumulators normalised by
    it, and rows < seq_q stored to ``out`` (f32 head-major, or f16 token-major)."""
    k, D = t.k, t.D
    if t.out_tokens_f16:
        _store_out_tokens_f16(t, head, rows, l_run, acc, col_ok)
        return
    out_head = k.add(k.global_ptr("out"), k.mul(k.mul_wide(head, t.seq_q), D * 4, "u64"))
    for a in range(t.R):
        inv = _row_scale(k, l_run[a])
        grow = k.add(t.q0, rows[a])
        with k.if_(k.setp("lt", grow, t.seq_q)):
            row_addr = k.add(out_head, k.mul_wide(grow, D * 4))
            for j in range(t.NJ):
                addr = k.add(row_addr, k.shl(k.cvt(k.add(t.tx, 8 * j), "u64"), 4))
                k.store("global", "f32", addr, [k.mul(acc[a][j][e], inv) for e in range(4)], pred=col_ok[j])


def _store_out_tokens_f16(t: _Prefill, head: Reg, rows: list, l_run: list, acc: list, col_ok: list) -> None:
    """:func:`_store_out` for the token-major f16 output: row ``q0 + r`` of head ``head`` goes to
    ``out[q0 + r, head * D ...]`` (rows ``num_heads * D`` f16 apart, num_heads = grid.y), each float4 of
    a thread as four f16 in one 8-byte store."""
    k, D = t.k, t.D
    out = k.global_ptr("out")
    num_heads = k.sreg("nctaid.y")
    for a in range(t.R):
        inv = _row_scale(k, l_run[a])
        grow = k.add(t.q0, rows[a])
        with k.if_(k.setp("lt", grow, t.seq_q)):
            row_addr = k.add(out, k.mul_wide(k.mad(grow, num_heads, head), D * 2))
            for j in range(t.NJ):
                addr = k.add(row_addr, k.shl(k.cvt(k.add(t.tx, 8 * j), "u64"), 3))
                half = [k.cvt(k.mul(acc[a][j][e], inv), "f16") for e in range(4)]
                words = [k.pack_b32(half[0], half[1]), k.pack_b32(half[2], half[3])]
                k.store("global", "b32", addr, words, pred=col_ok[j])
