"""KV-cache append: write ``count`` new positions of K and V into a layer's cache.

Sources ``k_new``/``v_new`` are ``[num_kv_heads, count, head_dim]`` (``count = 1`` is one decode
token, ``[num_kv_heads, head_dim]``); caches are ``[num_kv_heads, max_len, head_dim]``. Position
``pos`` is a value or, with ``indirect``, a device u32 read at ``pos_ptr`` (the graph stays fixed while
the position changes every step). Rows at or past ``max_len`` are never written.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.decode_core import check_head_dim

BLOCK = 128


@kernel("kv_append", grid=[{"head_dim": 64}, {"head_dim": 80, "indirect": True}, {"head_dim": 256}])
def kv_append(m: Module, head_dim: int = 128, indirect: bool = False) -> KernelBuilder:
    """cache[kvh, pos + r, :] = new[kvh, r, :] for K and V, r < count, 16-byte loads and stores.

    Launch: grid (ceil(count * head_dim / 4 / meta['block']), num_kv_heads), block meta['block']."""
    check_head_dim(head_dim)
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
