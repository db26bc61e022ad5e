"""Prefill attention on tensor cores reading K/V through one sequence's block table: the paged form of
:mod:`ptx_gen.kernels.attention.flash_attention_mma` (same tiles, MMAs, online softmax and f16 token-major output;
only the staging of the K/V tiles differs).

``q [num_heads, seq_q, D]`` f32 (queries at positions ``q_offset + i``: ``q_offset`` positions are already
in the pool, e.g. a prefix-cache hit); pools ``[num_blocks, KVH, block_size, D]`` of ``kv_dtype``
(:mod:`ptx_gen.kernels.kv.paged_kv`); ``block_table`` u32 (at least ``ceil(seq_k / block_size)`` entries);
``out [seq_q, num_heads * D]`` f16. Key ``p`` of a 64-key tile is read from block ``block_table[p //
block_size]``, row ``p % block_size`` (an f16 pool is copied into shared memory as is, 16 bytes a
thread; f32 and bf16 are rounded to f16 on the way). Keys at or past ``seq_k`` are zeros (and masked).

Rounding, stated: Q, K, V and P enter the MMAs as f16; scores, softmax and O stay f32.
Launch: grid ``(ceil(seq_q / 64), num_heads)``, block 128, dynamic shared memory ``meta["dyn_smem"]``.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.flash_attention_mma import (BK, HEAD_DIMS, key_tile_loop, query_rows, setup_cta,
                                                            staged_row_bytes)
from ptx_gen.kernels.kv.paged_kv import (
    ELEM_BYTES, QK, check_paged, f16_bits_to_f32, kv_params, log2, narrow, q8_values, to_f32,
)


def _stage_paged(k: KernelBuilder, pools: tuple, table: Reg, kvh: Reg, n_kv: Reg, key0: Reg, rows_valid: Reg,
                 dsts: tuple, d: int, tid: Reg, block_size: int, kv_dtype: str, scales: tuple) -> None:
    """64 keys from ``key0`` of kv head ``kvh`` of the K and V ``pools`` through the block table into f16
    shared rows (``dsts``) of :func:`staged_row_bytes` (zeros for rows at or past ``rows_valid``; q8_0:
    ``code * scale`` rounded to f16). The tile's ``64 / block_size`` block ids are loaded once (the same
    addresses in every thread) and shared by K and V, so no pool load waits on a table load of its own."""
    per_item = {"f32": 4, "q8_0": 16}.get(kv_dtype, 8)  # values a thread moves per item (16 bytes read)
    items_per_row = d // per_item
    total = BK * items_per_row
    es = ELEM_BYTES[kv_dtype]
    # head_dim 32 (a two-iteration tile) keeps a table load per item and stages K, then V: ptxas spills the
    # hoisted, interleaved form there
    hoist = d > 32
    pages = []
    if hoist:
        first = k.shr(key0, log2(block_size))
        pages = [k.load("global", "u32", k.add(table, k.mul_wide(k.add(first, j) if j else first, 4)),
                        pred=k.setp("lt", j * block_size, rows_valid) if j else None, other=0)
                 for j in range(BK // block_size)]
    # an iteration's rows sit in one block when they are a whole, aligned slice of one: its block is known
    rows_per_iter = 128 // items_per_row if 128 % items_per_row == 0 else 0
    static = rows_per_iter and block_size % rows_per_iter == 0
    order = [(i, (0, 1)) for i in range(-(-total // 128))] if hoist else \
        [(i, (p,)) for p in (0, 1) for i in range(-(-total // 128))]
    for i, which_pools in order:
        idx = k.add(tid, i * 128) if i else tid
        ok_idx = k.setp("lt", idx, total) if (i + 1) * 128 > total else None
        row, c = k.div(idx, items_per_row), k.rem(idx, items_per_row)
        ok = k.both(k.setp("lt", row, rows_valid), ok_idx)
        if not hoist:
            page = k.load("global", "u32", k.add(table, k.mul_wide(k.shr(k.add(key0, row), log2(block_size)), 4)),
                          pred=ok, other=0)
        elif static:
            page = pages[i * rows_per_iter // block_size]
        else:
            which = k.shr(row, log2(block_size))
            page = pages[0]
            for j in range(1, len(pages)):
                page = k.selp(pages[j], page, k.setp("eq", which, j), "u32")
        r = k.mad(k.mad(page, n_kv, kvh), block_size, k.and_(row, block_size - 1))
        off = k.add(k.mul_wide(r, d * es), k.mul_wide(c, 16))
        s_off = k.mad(row, staged_row_bytes(d), k.mul(c, per_item * 2))
        for pool, dst, sc_pool in ((pools[p], dsts[p], scales[p]) for p in which_pools):
            src, s = k.add(pool, off), k.add(dst, s_off)
            if kv_dtype == "q8_0":
                words = k.load("global", "b32", src, vec=4, pred=ok, other=0)
                srow = k.add(sc_pool, k.mul_wide(r, d // QK * 2))
                sc = k.load("global", "b16", k.add(srow, k.mul_wide(k.shr(c, log2(QK // 16)), 2)), pred=ok, other=0)
                vals = q8_values(k, list(words), f16_bits_to_f32(k, sc))
                h = [narrow(k, x, "f16") for x in vals]
                packed = [k.pack_b32(h[2 * i], h[2 * i + 1]) for i in range(8)]
                k.store("shared", "b32", s, packed[:4], pred=ok_idx)
                k.store("shared", "b32", s, packed[4:], 16, pred=ok_idx)
            elif kv_dtype == "f32":
                v = k.load("global", "f32", src, vec=4, pred=ok, other=0.0)
                h = [narrow(k, x, "f16") for x in v]
                k.store("shared", "b32", s, [k.pack_b32(h[0], h[1]), k.pack_b32(h[2], h[3])], pred=ok_idx)
            elif kv_dtype == "f16":
                words = k.load("global", "b32", src, vec=4, pred=ok, other=0)
                k.store("shared", "b32", s, list(words), pred=ok_idx)
            else:
                words = k.load("global", "b32", src, vec=4, pred=ok, other=0)
                out = []
                for w in words:
                    lo, hi = to_f32(k, w, kv_dtype)
                    out.append(k.pack_b32(narrow(k, lo, "f16"), narrow(k, hi, "f16")))
                k.store("shared", "b32", s, out, pred=ok_idx)


_GRID = [
    {"head_dim": 128, "group": 4, "causal": True, "block_size": 32, "kv_dtype": "f16"},
    {"head_dim": 64, "group": 3, "causal": True, "block_size": 16, "kv_dtype": "f32"},
    {"head_dim": 128, "group": 1, "causal": False, "block_size": 64, "kv_dtype": "bf16"},
    {"head_dim": 96, "group": 8, "causal": True, "block_size": 32, "kv_dtype": "f16"},
    {"head_dim": 32, "group": 2, "causal": True, "block_size": 64, "kv_dtype": "f16"},
    {"head_dim": 128, "group": 4, "causal": True, "block_size": 32, "kv_dtype": "q8_0"},
    {"head_dim": 64, "group": 1, "causal": False, "block_size": 16, "kv_dtype": "q8_0"},
]


@kernel("paged_prefill_attention", grid=_GRID)
def paged_prefill_attention(m: Module, head_dim: int = 128, group: int = 1, causal: bool = True,
                            block_size: int = 32, kv_dtype: str = "f16") -> KernelBuilder:
    """Tensor-core prefill attention over a paged pool through one block table, output token-major f16.
    Params: q, k_pool, v_pool, block_table, out, seq_q, seq_k, q_offset, num_heads, n_kv. Launch: grid
    (ceil(seq_q / 64), num_heads), block 128."""
    d = head_dim
    if d not in HEAD_DIMS:
        raise ValueError(f"the tensor-core prefill attention takes head_dim in {HEAD_DIMS}, got {d}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be >= 1, got {group!r}")
    check_paged(block_size, kv_dtype, d)
    name = f"paged_prefill_attention_d{d}_g{group}_b{block_size}_{kv_dtype}" + ("_causal" if causal else "")
    k = m.kernel(name, [("q", "u64"), *kv_params(kv_dtype), ("block_table", "u64"), ("out", "u64"),
                        ("seq_q", "u32"), ("seq_k", "u32"), ("q_offset", "u32"), ("num_heads", "u32"),
                        ("n_kv", "u32")], max_threads=128)
    st = setup_cta(k, d, group, "n_kv", wait=False)
    table = k.global_ptr("block_table")
    query_rows(k, st, d, causal)
    k_pool, v_pool = k.global_ptr("k_pool"), k.global_ptr("v_pool")
    scales = (None, None)
    if kv_dtype == "q8_0":
        scales = (k.global_ptr("k_scales"), k.global_ptr("v_scales"))

    def stage(key0: Reg) -> None:  # K and V rows key0.. through the block table
        _stage_paged(k, (k_pool, v_pool), table, st.kvh, st.extra, key0, k.sub(st.seq_k, key0), (st.ks, st.vs), d,
                     st.tid, block_size, kv_dtype, scales)

    key_tile_loop(k, st, d, causal, stage)
    return k
