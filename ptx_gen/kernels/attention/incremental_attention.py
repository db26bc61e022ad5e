"""Incremental (decode) attention in one pass: a query per head against the first ``seq_len`` cache rows.

One block per (KV head, subgroup of its query heads); the block walks the whole sequence. It is the
simple reference path (an independent check of flash decoding on the device): with only
``num_kv_heads`` blocks it is slower than flash decoding (``flash_decoding.py``, rows split over the
whole GPU) at every length.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.attention.decode_core import (
    DEFAULT_L2_PREFETCH, block_heads, build_decode_pass, decode_layout, emit_combine, lane_setup, layout_name, load_q,
    load_seq_len, safe_reciprocal, seq_len_param,
)

_GRID = [
    {"head_dim": 64, "group": 1},
    {"head_dim": 64, "group": 7},
    {"head_dim": 80, "group": 2, "indirect": True},
    {"head_dim": 128, "group": 4, "scores": "butterfly"},
    {"head_dim": 256, "group": 8, "indirect": True},
    {"head_dim": 48, "group": 3},
    {"head_dim": 96, "group": 5},
    {"head_dim": 32, "group": 16},
]


@kernel("incremental_attention", grid=_GRID)
def incremental_attention(
    m: Module, head_dim: int = 128, group: int = 1, indirect: bool = False,
    heads_per_block: int | None = None, warps: int = 8, unroll: int | None = None, prefetch: bool = False,
    scores: str | None = None, l2_prefetch: int = DEFAULT_L2_PREFETCH,
) -> KernelBuilder:
    """out[h] = softmax(q[h] . K[h // group, :L] / sqrt(D)) @ V[h // group, :L] for one query per head.

    q, out: [num_heads, head_dim]; k_cache, v_cache: [num_kv_heads, max_len, head_dim]; L = seq_len
    (a value, or a device u32 at seq_len_ptr when ``indirect``), clamped to max_len; L = 0 gives
    zeros. Launch: grid (num_kv_heads * meta['subgroups']), block meta['block']."""
    lay = decode_layout(head_dim, group, heads_per_block, warps, unroll, prefetch, scores, l2_prefetch)
    name = f"incremental_attention_{layout_name(lay)}{'_ind' if indirect else ''}"
    params = [("q", "u64"), ("k_cache", "u64"), ("v_cache", "u64"), ("out", "u64"), seq_len_param(indirect),
              ("max_len", "u32")]
    k = m.kernel(name, params)  # no .maxntid: with it ptxas picked 56 registers and spilled for D=80
    k.meta.update(block=lay.threads, subgroups=lay.subgroups, heads_per_block=lay.heads_per_block,
                  layout=lay)
    kvh, head0 = block_heads(k, lay)
    lanes = lane_setup(k, lay, "ia")
    qv = load_q(k, lay, lanes, head0)
    seq_len = load_seq_len(k, indirect)
    st = build_decode_pass(k, lay, lanes, qv, kvh, head0, k.mov(0, "u32"), seq_len, "ia")
    out = k.global_ptr("out")

    def write(i, c4, mx, total, acc4):
        head = k.add(head0, i) if i is not None else head0
        inv = safe_reciprocal(k, total)
        addr = k.add(out, k.mul_wide(k.mad(head, lay.nc, c4), 16))
        k.store("global", "f32", addr, [k.mul(a, inv) for a in acc4])

    emit_combine(k, st, write)
    k.ret()
    return k
