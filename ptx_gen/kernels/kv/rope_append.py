"""Decode-step fusion of RoPE and the KV-cache append: one launch instead of two.

Input is the QKV projection of one token, ``qkv = [q (n_q x d), k (n_kv x d), v (n_kv x d)]`` (f32,
contiguous). The kernel rotates every pair of Q in place, rotates K and writes it to
``k_cache[h, pos, :]``, and copies V to ``v_cache[h, pos, :]`` (caches ``[n_kv, max_len, d]``). The
position is read from a device u32, so a captured decode graph replays with a new one; a position at
or past ``max_len`` writes nothing to the caches (the host refuses it first).

The rotation is the one of :mod:`ptx_gen.kernels.elementwise.rope` (interleaved pairs (2i, 2i+1) or NeoX pairs
(i, i + d/2); angle ``f32(pos) * inv_freq[i]`` reduced to [-pi, pi] before ``sin/cos.approx``).
Work items: ``(n_q + n_kv) * d/2`` rotation pairs, then ``n_kv * d/2`` V pairs; one item a thread.
"""

from __future__ import annotations

import math

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.elementwise.rope import TWO_PI_HI, TWO_PI_LO

BLOCK = 128


def rotate_pair(k: KernelBuilder, x0: Reg, x1: Reg, pos: Reg, inv: Reg) -> tuple[Reg, Reg]:
    """Emits the rotation of the pair (x0, x1) by the angle ``f32(pos) * inv`` (u32 ``pos``), reduced to
    [-pi, pi] before ``sin/cos.approx``; the decode and the batched append kernels share it so that a
    position rotates to the same bits in both."""
    angle = k.mul(k.cvt(pos, "f32"), inv)
    turns = k.cvt(k.cvt(k.mul(angle, 1.0 / (2 * math.pi)), "s32", rounding="rni"), "f32")
    r = k.fma(k.neg(turns), TWO_PI_HI, angle)
    r = k.fma(k.neg(turns), TWO_PI_LO, r)
    c, s = k.cos(r), k.sin(r)
    return k.sub(k.mul(x0, c), k.mul(x1, s)), k.fma(x0, s, k.mul(x1, c))


@kernel("rope_kv_append", grid=[{"head_dim": d, "neox": nx} for d in (32, 64, 80, 128, 256) for nx in (False, True)])
def rope_kv_append(m: Module, head_dim: int = 128, neox: bool = False) -> KernelBuilder:
    """Rotate Q in place, rotate K into the K cache and copy V into the V cache at position
    ``*pos_ptr``. Params: qkv, k_cache, v_cache, inv_freq (d/2 f32), pos_ptr (u32), n_q, n_kv, max_len.
    Launch: grid ceil((n_q + 2 n_kv) * d/2 / 128), block 128."""
    if head_dim % 2 or not 2 <= head_dim <= 512:
        raise ValueError(f"head_dim must be even and at most 512, got {head_dim}")
    half = head_dim // 2
    name = f"rope_kv_append_d{head_dim}" + ("_neox" if neox else "_interleaved")
    k = m.kernel(name, [("qkv", "u64"), ("k_cache", "u64"), ("v_cache", "u64"), ("inv_freq", "u64"),
                        ("pos_ptr", "u64"), ("n_q", "u32"), ("n_kv", "u32"), ("max_len", "u32")],
                 max_threads=BLOCK)
    k.meta.update(block=BLOCK, pairs_per_head=half)
    n_q, n_kv, max_len = k.param("n_q"), k.param("n_kv"), k.param("max_len")
    qkv = k.global_ptr("qkv")
    idx = k.global_index_x()
    rot_items = k.mul(k.add(n_q, n_kv), half)
    total = k.add(rot_items, k.mul(n_kv, half))
    end = k.new_label("end")
    k.bra(end, k.setp("ge", idx, total))
    pos = k.load("global", "u32", k.global_ptr("pos_ptr"))
    in_cache = k.setp("lt", pos, max_len)
    head = k.div(idx, half)  # over q heads, then k heads, then v heads
    i = k.sub(idx, k.mul(head, half))
    # the pair's two element offsets inside a head
    if neox:
        e0, e1 = i, k.add(i, half)
    else:
        e0 = k.shl(i, 1)
        e1 = k.add(e0, 1)
    src = k.add(qkv, k.mul_wide(head, head_dim * 4))  # q, k and v heads are consecutive in qkv
    x0 = k.load("global", "f32", k.add(src, k.mul_wide(e0, 4)))
    x1 = k.load("global", "f32", k.add(src, k.mul_wide(e1, 4)))
    kv_head = k.sub(head, n_q)  # valid for k items; for v items subtract n_kv more
    with k.if_(k.setp("lt", idx, rot_items)):
        inv = k.load("global", "f32", k.add(k.global_ptr("inv_freq"), k.mul_wide(i, 4)), nc=True)
        o0, o1 = rotate_pair(k, x0, x1, pos, inv)
        with k.if_(k.setp("lt", head, n_q)):  # a Q pair: back in place
            k.store("global", "f32", k.add(src, k.mul_wide(e0, 4)), o0)
            k.store("global", "f32", k.add(src, k.mul_wide(e1, 4)), o1)
            k.bra(end)
        with k.if_(in_cache):  # a K pair: into the cache row
            row = k.add(k.global_ptr("k_cache"), k.mul_wide(k.mad(kv_head, max_len, pos), head_dim * 4))
            k.store("global", "f32", k.add(row, k.mul_wide(e0, 4)), o0)
            k.store("global", "f32", k.add(row, k.mul_wide(e1, 4)), o1)
        k.bra(end)
    with k.if_(in_cache):  # a V pair: copied as is
        v_head = k.sub(kv_head, n_kv)
        row = k.add(k.global_ptr("v_cache"), k.mul_wide(k.mad(v_head, max_len, pos), head_dim * 4))
        k.store("global", "f32", k.add(row, k.mul_wide(e0, 4)), x0)
        k.store("global", "f32", k.add(row, k.mul_wide(e1, 4)), x1)
    k.label(end)
    k.ret()
    return k
