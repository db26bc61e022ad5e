"""RoPE + append into the paged KV pool (layout: :mod:`ptx_gen.kernels.kv.paged_kv`).

Two kernels share one body (one warp per (token, head row) of the ``n_q + 2 n_kv`` rows of a token,
lane ``l`` holding pairs ``l + 32 j``, as :mod:`ptx_gen.kernels.kv.rope_append_rows`; optional qwen3 per-head
RMSNorm of Q and K first; the rotation of :func:`ptx_gen.kernels.kv.rope_append.rotate_pair`, so a
position rotates to the same bits as in the contiguous cache):

* ``paged_append_decode``: a decode step of ``B`` sequences, one token each. ``qkv [B, (n_q + 2 n_kv)
  * d]`` f32; row ``b`` sits at position ``positions[b]`` (device u32) and writes through block table
  row ``b`` (``tables + b * table_stride`` u32). Q is rotated in place; K (rotated) and V go to the pools.
* ``paged_append_rows``: a prefill chunk of ``count`` tokens of one sequence at positions ``pos0 + s``
  through one block table. ``qkv`` is only read; Q goes to ``q_out [n_q, count, d]`` f32 (the query
  layout of ``paged_prefill_attention``).

A position whose block index is at or past ``table_stride`` (or, for the prefill form, ``max_blocks``)
writes nothing to the pools. K/V are rounded to the pool's dtype (f16/bf16: nearest even; q8_0: each
group of 32 values of the head row quantised by the warp, max|x| by butterfly shuffles, see
:mod:`ptx_gen.kernels.kv.paged_kv`).
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.kv.paged_kv import QK, check_paged, kv_params, log2, pool_row, quantize_q8, scale_row, store_pair
from ptx_gen.kernels.kv.rope_append import rotate_pair
from ptx_gen.kernels.kv.rope_append_rows import head_rmsnorm, lane_pairs, load_f32_pair, load_inv_freq, store_f32_pair

WARPS = 4
BLOCK = 32 * WARPS


def _build(k: KernelBuilder, head_dim: int, block_size: int, kv_dtype: str, neox: bool, qk_norm: bool,
           decode: bool) -> None:
    half = head_dim // 2
    n_q, n_kv = k.param("n_q"), k.param("n_kv")
    tid = k.tid()
    lane = k.and_(tid, 31)
    s = k.ctaid("x")  # the token: batch row (decode) or index in the chunk (prefill)
    row = k.mad(k.ctaid("y"), WARPS, k.shr(tid, 5))  # warp-uniform: q heads, then k heads, then v heads
    n_rows = k.add(n_q, k.shl(n_kv, 1))
    end = k.new_label("end")
    k.bra(end, k.setp("ge", row, n_rows))
    stride = k.param("table_stride")
    if decode:
        pos = k.load("global", "u32", k.add(k.global_ptr("positions"), k.mul_wide(s, 4)))
        table = k.add(k.global_ptr("block_tables"), k.mul_wide(k.mul(s, stride), 4))
    else:
        k.bra(end, k.setp("ge", s, k.param("count")))
        pos = k.add(k.param("pos0"), s)
        table = k.global_ptr("block_table")
    blk = k.shr(pos, log2(block_size))
    in_pool = k.setp("lt", blk, stride)
    page = k.load("global", "u32", k.add(table, k.mul_wide(blk, 4)), pred=in_pool, other=0)
    prow = k.and_(pos, block_size - 1)
    src = k.add(k.global_ptr("qkv"), k.mul_wide(k.mad(s, n_rows, row), head_dim * 4))

    idx, oks, offs, eoffs = lane_pairs(k, lane, half, neox, elements=True)
    xs = [load_f32_pair(k, src, off, ok, neox) for off, ok in zip(offs, oks)]

    def row_addr(pool: str, kv_row):
        dst = pool_row(k, k.global_ptr(pool), page, kv_row, n_kv, prow, block_size, head_dim, kv_dtype)
        if kv_dtype != "q8_0":
            return dst, None
        return dst, scale_row(k, k.global_ptr(pool.replace("pool", "scales")), page, kv_row, n_kv, prow,
                              block_size, head_dim)

    def store_row(addr, pairs) -> None:
        dst, sdst = addr
        if kv_dtype == "q8_0":
            _store_q8(k, dst, sdst, pairs, eoffs, oks, in_pool, lane, head_dim, neox)
            return
        for (x0, x1), eo, ok in zip(pairs, eoffs, oks):
            store_pair(k, dst, eo, x0, x1, k.both(ok, in_pool), neox, kv_dtype)

    qk_rows = k.add(n_q, n_kv)
    with k.if_(k.setp("ge", row, qk_rows)):  # a V row: copied as is
        store_row(row_addr("v_pool", k.sub(row, qk_rows)), xs)
        k.bra(end)

    is_q = k.setp("lt", row, n_q)
    if qk_norm:
        xs = head_rmsnorm(k, xs, offs, oks, is_q, head_dim, neox)
    if decode:
        q_dst = src  # in place
    else:
        q_dst = k.add(k.global_ptr("q_out"), k.mul_wide(k.mad(row, k.param("count"), s), head_dim * 4))
    k_dst = row_addr("k_pool", k.sub(row, n_q))
    inv_freq = k.global_ptr("inv_freq")
    rotated = []
    for (x0, x1), i, ok in zip(xs, idx, oks):
        rotated.append(rotate_pair(k, x0, x1, pos, load_inv_freq(k, inv_freq, i, ok)))
    with k.if_(is_q):
        for (o0, o1), off, ok in zip(rotated, offs, oks):
            store_f32_pair(k, q_dst, off, o0, o1, ok, neox)
        k.bra(end)
    store_row(k_dst, rotated)
    k.label(end)


def _store_q8(k: KernelBuilder, dst, sdst, pairs: list, eoffs: list, oks: list, in_pool, lane, head_dim: int,
              neox: bool) -> None:
    """Quantise the warp's head row (pairs as :func:`_build` holds them) and store codes and scales."""
    groups, half = head_dim // QK, head_dim // 2

    def grp(lo: int, hi: int):  # (group of lanes 0-15, of lanes 16-31); out-of-range: idle lanes only
        return (lo, hi if hi < groups else lo)

    slots = []
    for jj, (x0, x1) in enumerate(pairs):
        if neox:  # x0 is value lane + 32 j, x1 value lane + 32 j + half
            g1 = jj + half // QK
            slots += [(x0, jj), (x1, grp(g1, g1 + 1) if half % QK else g1)]
        else:  # values 2 (lane + 32 j) and the next one
            g = grp(2 * jj, 2 * jj + 1)
            slots += [(x0, g), (x1, g)]
    codes, scales = quantize_q8(k, slots, lane, head_dim)
    for jj, (eo, ok) in enumerate(zip(eoffs, oks)):
        c0, c1 = codes[2 * jj], codes[2 * jj + 1]
        okp = k.both(ok, in_pool)
        if neox:
            for c, e in ((c0, eo[0]), (c1, eo[1])):
                k.store("global", "b8", k.add(dst, k.cvt(e, "u64")), k.cvt(c, "u16"), pred=okp)
        else:
            word = k.or_(k.and_(c0, 0xFF, "b32"), k.shl(k.and_(c1, 0xFF, "b32"), 8, "b32"), "b32")
            k.store("global", "b16", k.add(dst, k.cvt(eo[0], "u64")), k.cvt(k.bitcast(word, "u32"), "u16"),
                    pred=okp)
    for g, sc in enumerate(scales):
        k.store("global", "b16", sdst, sc, 2 * g, pred=k.both(k.setp("eq", lane, g), in_pool))


def _check(head_dim: int, block_size: int, kv_dtype: str) -> None:
    if head_dim % 2 or not 2 <= head_dim <= 512:
        raise ValueError(f"head_dim must be even and at most 512, got {head_dim}")
    check_paged(block_size, kv_dtype, head_dim)


def _kernel(m: Module, base: str, pointers: list, scalars: list, head_dim: int, block_size: int, kv_dtype: str,
            neox: bool, qk_norm: bool, decode: bool) -> KernelBuilder:
    """One of the two kernels: params ``pointers`` (the kernel's buffers up to its block table(s)), [q_norm,
    k_norm], ``scalars``, table_stride, n_q, n_kv, [eps]; the body of :func:`_build`."""
    _check(head_dim, block_size, kv_dtype)
    params = list(pointers)
    if qk_norm:
        params += [("q_norm", "u64"), ("k_norm", "u64")]
    params += [*scalars, ("table_stride", "u32"), ("n_q", "u32"), ("n_kv", "u32")]
    if qk_norm:
        params.append(("eps", "f32"))
    name = (f"{base}_d{head_dim}_b{block_size}_{kv_dtype}" + ("_neox" if neox else "_interleaved")
            + ("_qknorm" if qk_norm else ""))
    k = m.kernel(name, params, max_threads=BLOCK)
    k.meta.update(block=BLOCK, warps=WARPS)
    _build(k, head_dim, block_size, kv_dtype, neox, qk_norm, decode)
    k.ret()
    return k


_DECODE_GRID = [
    {"head_dim": 128, "block_size": 32, "kv_dtype": "f16", "neox": False, "qk_norm": False},
    {"head_dim": 128, "block_size": 16, "kv_dtype": "f32", "neox": True, "qk_norm": True},
    {"head_dim": 64, "block_size": 64, "kv_dtype": "bf16", "neox": True, "qk_norm": False},
    {"head_dim": 64, "block_size": 32, "kv_dtype": "f16", "neox": True, "qk_norm": True},
    {"head_dim": 256, "block_size": 32, "kv_dtype": "f16", "neox": True, "qk_norm": False},
    {"head_dim": 128, "block_size": 32, "kv_dtype": "q8_0", "neox": False, "qk_norm": False},
    {"head_dim": 128, "block_size": 32, "kv_dtype": "q8_0", "neox": True, "qk_norm": True},
]


@kernel("paged_append_decode", grid=_DECODE_GRID)
def paged_append_decode(m: Module, head_dim: int = 128, block_size: int = 32, kv_dtype: str = "f16",
                        neox: bool = False, qk_norm: bool = False) -> KernelBuilder:
    """Decode step of B sequences: rotate Q of ``qkv`` row b in place, K rotated and V into the paged pools
    at position ``positions[b]`` through block table row b. Params: qkv, k_pool, v_pool, inv_freq (d/2 f32),
    positions (u32[B]), block_tables (u32[B, table_stride]), [q_norm, k_norm], table_stride, n_q, n_kv,
    [eps]. Launch: grid (B, ceil((n_q + 2 n_kv) / 4)), block 128."""
    return _kernel(m, "paged_append_decode", [("qkv", "u64"), *kv_params(kv_dtype), ("inv_freq", "u64"),
                   ("positions", "u64"), ("block_tables", "u64")], [], head_dim, block_size, kv_dtype, neox,
                   qk_norm, decode=True)


_ROWS_GRID = [
    {"head_dim": 128, "block_size": 32, "kv_dtype": "f16", "neox": False, "qk_norm": False},
    {"head_dim": 128, "block_size": 64, "kv_dtype": "f32", "neox": True, "qk_norm": True},
    {"head_dim": 64, "block_size": 16, "kv_dtype": "bf16", "neox": False, "qk_norm": True},
    {"head_dim": 64, "block_size": 32, "kv_dtype": "f16", "neox": True, "qk_norm": False},
    {"head_dim": 128, "block_size": 32, "kv_dtype": "q8_0", "neox": False, "qk_norm": False},
]


@kernel("paged_append_rows", grid=_ROWS_GRID)
def paged_append_rows(m: Module, head_dim: int = 128, block_size: int = 32, kv_dtype: str = "f16",
                      neox: bool = False, qk_norm: bool = False) -> KernelBuilder:
    """Prefill chunk of one sequence: ``count`` tokens at positions ``pos0 + s``; Q rotated to ``q_out [n_q,
    count, d]``, K rotated and V into the paged pools through ``block_table`` (u32[table_stride]). Params:
    qkv, q_out, k_pool, v_pool, inv_freq, block_table, [q_norm, k_norm], pos0, count, table_stride, n_q,
    n_kv, [eps]. Launch: grid (count, ceil((n_q + 2 n_kv) / 4)), block 128."""
    return _kernel(m, "paged_append_rows", [("qkv", "u64"), ("q_out", "u64"), *kv_params(kv_dtype),
                   ("inv_freq", "u64"), ("block_table", "u64")], [("pos0", "u32"), ("count", "u32")], head_dim,
                   block_size, kv_dtype, neox, qk_norm, decode=False)
