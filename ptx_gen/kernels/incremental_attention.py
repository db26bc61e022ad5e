"""Incremental (decode) attention in one pass: a query per head against the first ``seq_len`` cache rows.

One block per (KV head, subgroup of its query heads); the block walks the whole sequence, so this
kernel suits short sequences and serves as the simple reference path. Long sequences belong to
flash decoding (``flash_decoding.py``), which splits the rows over many blocks.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel
from ptx_gen.kernels.decode_core import (
    block_heads, build_decode_pass, decode_layout, emit_combine, lane_setup, load_q, load_seq_len, safe_reciprocal,
    seq_len_param,
)

_GRID = [
    {"head_dim": 64, "group": 1},
    {"head_dim": 64, "group": 7},
    {"head_dim": 80, "group": 2, "indirect": True},
    {"head_dim": 128, "group": 4},
    {"head_dim": 256, "group": 8, "indirect": True},
    {"head_dim": 48, "group": 3},
    {"head_dim": 96, "group": 5},
    {"head_dim": 32, "group": 16},
]


@kernel("incremental_attention", grid=_GRID)
def incremental_attention(
    m: Module, head_dim: int = 128, group: int = 1, indirect: bool = False,
    heads_per_block: int | None = None, warps: int = 8, unroll: int | None = None, prefetch: bool = False,
) -> KernelBuilder:
    """out[h] = softmax(q[h] . K[h // group, :L] / sqrt(D)) @ V[h // group, :L] for one query per head.

    q, out: [num_heads, head_dim]; k_cache, v_cache: [num_kv_heads, max_len, head_dim]; L = seq_len
    (a value, or a device u32 at seq_len_ptr when ``indirect``), clamped to max_len; L = 0 gives
    zeros. Launch: grid (num_kv_heads * meta['subgroups']), block meta['block']."""
    lay = decode_layout(head_dim, group, heads_per_block, warps, unroll, prefetch)
    name = (f"incremental_attention_d{head_dim}_g{group}_hb{lay.heads_per_block}_w{warps}_u{lay.unroll}"
            f"{'_pf' if prefetch else ''}{'_ind' if indirect else ''}")
    params = [("q", "u64"), ("k_cache", "u64"), ("v_cache", "u64"), ("out", "u64"), seq_len_param(indirect),
              ("max_len", "u32")]
    k = m.kernel(name, params)  # no .maxntid: with it ptxas picked 56 registers and spilled for D=80
    k.meta.update(block=lay.threads, subgroups=lay.subgroups, heads_per_block=lay.heads_per_block,
                  layout=lay)
    kvh, head0 = block_heads(k, lay)
    lanes = lane_setup(k, lay)
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
