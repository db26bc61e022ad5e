"""KV-cache append: write ``count`` new positions of K and V into a layer's cache.

Sources ``k_new``/``v_new`` are ``[num_kv_heads, count, head_dim]`` (``count = 1`` is one decode
token, ``[num_kv_heads, head_dim]``); caches are ``[num_kv_heads, max_len, head_dim]``. Position
``pos`` is a value or, with ``indirect``, a device u32 read at ``pos_ptr`` (the graph stays fixed while
the position changes every step). Rows at or past ``max_len`` are never written.

With ``block_size`` the caches are paged f32 pools (:mod:`ptx_gen.kernels.kv.paged_kv`): row ``p`` goes
to block ``block_table[p // block_size]``, row ``p % block_size``, and rows whose block index is at or
past ``table_stride`` are never written (params ``k_pool, v_pool, k_new, v_new, pos | pos_ptr, count,
block_table, table_stride, n_kv``).
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.decode_core import check_head_dim
from ptx_gen.kernels.kv.paged_kv import check_paged, log2, pool_row

BLOCK = 128


@kernel("kv_append", grid=[{"head_dim": 64}, {"head_dim": 80, "indirect": True}, {"head_dim": 256},
                         {"head_dim": 64, "indirect": True, "block_size": 16},
                         {"head_dim": 128, "block_size": 32}, {"head_dim": 80, "indirect": True, "block_size": 64}])
def kv_append(m: Module, head_dim: int = 128, indirect: bool = False, block_size: int | None = None) -> KernelBuilder:
    """cache[kvh, pos + r, :] = new[kvh, r, :] for K and V, r < count, 16-byte loads and stores
    (``block_size``: into paged f32 pools through a block table).

    Launch: grid (ceil(count * head_dim / 4 / meta['block']), num_kv_heads), block meta['block']."""
    check_head_dim(head_dim)
    if block_size is not None:
        check_paged(block_size, "f32", head_dim)
        return _paged(m, head_dim, indirect, block_size)
    nc = head_dim // 4
    pos_param = ("pos_ptr", "u64") if indirect else ("pos", "u32")
    name = f"kv_append_d{head_dim}{'_ind' if indirect else ''}"
    params = [("k_cache", "u64"), ("v_cache", "u64"), ("k_new", "u64"), ("v_new", "u64"), pos_param,
              ("count", "u32"), ("max_len", "u32")]
    k = m.kernel(name, params, max_threads=BLOCK)
    k.meta.update(block=BLOCK)
    kvh = k.ctaid("y")
    t = k.global_index_x()
    count, max_len = k.param("count"), k.param("max_len")
    pos = k.load("global", "u32", k.global_ptr("pos_ptr")) if indirect else k.param("pos")
    with k.if_(k.setp("lt", t, k.mul(count, nc))):
        r = k.div(t, nc)
        c = k.rem(t, nc)
        row = k.add(pos, r)
        # pos < max_len guards the u32 wrap of pos + r; row < max_len keeps the write in the cache
        ok = k.and_(k.setp("lt", pos, max_len), k.setp("lt", row, max_len))
        with k.if_(ok):
            src = k.mul_wide(k.mad(k.mad(kvh, count, r), nc, c), 16)
            dst_row = k.add(k.mul_wide(kvh, max_len), k.cvt(row, "u64"))
            dst = k.add(k.mul(dst_row, head_dim * 4, "u64"), k.mul_wide(c, 16))
            kv = k.load("global", "f32", k.add(k.global_ptr("k_new"), src), vec=4)
            vv = k.load("global", "f32", k.add(k.global_ptr("v_new"), src), vec=4)
            k.store("global", "f32", k.add(k.global_ptr("k_cache"), dst), list(kv))
            k.store("global", "f32", k.add(k.global_ptr("v_cache"), dst), list(vv))
    k.ret()
    return k


def _paged(m: Module, head_dim: int, indirect: bool, block_size: int) -> KernelBuilder:
    nc = head_dim // 4
    pos_param = ("pos_ptr", "u64") if indirect else ("pos", "u32")
    name = f"kv_append_d{head_dim}_b{block_size}{'_ind' if indirect else ''}"
    params = [("k_pool", "u64"), ("v_pool", "u64"), ("k_new", "u64"), ("v_new", "u64"), pos_param,
              ("count", "u32"), ("block_table", "u64"), ("table_stride", "u32"), ("n_kv", "u32")]
    k = m.kernel(name, params, max_threads=BLOCK)
    k.meta.update(block=BLOCK)
    kvh = k.ctaid("y")
    t = k.global_index_x()
    count, n_kv = k.param("count"), k.param("n_kv")
    pos = k.load("global", "u32", k.global_ptr("pos_ptr")) if indirect else k.param("pos")
    with k.if_(k.setp("lt", t, k.mul(count, nc))):
        r = k.div(t, nc)
        c = k.rem(t, nc)
        row = k.add(pos, r)
        blk = k.shr(row, log2(block_size))
        # row >= pos guards the u32 wrap of pos + r; a block index past the table writes nothing
        ok = k.and_(k.setp("ge", row, pos), k.setp("lt", blk, k.param("table_stride")))
        with k.if_(ok):
            page = k.load("global", "u32", k.add(k.global_ptr("block_table"), k.mul_wide(blk, 4)))
            src = k.mul_wide(k.mad(k.mad(kvh, count, r), nc, c), 16)
            in_block = k.and_(row, block_size - 1)
            col = k.mul_wide(c, 16)
            kv = k.load("global", "f32", k.add(k.global_ptr("k_new"), src), vec=4)
            vv = k.load("global", "f32", k.add(k.global_ptr("v_new"), src), vec=4)
            for pool, vals in (("k_pool", kv), ("v_pool", vv)):
                dst = pool_row(k, k.global_ptr(pool), page, kvh, n_kv, in_block, block_size, head_dim, "f32")
                k.store("global", "f32", k.add(dst, col), list(vals))
    k.ret()
    return k
