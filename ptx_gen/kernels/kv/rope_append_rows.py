"""Batched (prefill) RoPE + KV-cache append: S tokens in one launch.

Input is the QKV projection of S tokens, ``qkv [S, (n_q + 2 n_kv) * d]`` (f32), each row
``[q (n_q x d), k (n_kv x d), v (n_kv x d)]``; token ``s`` sits at position ``pos0 + s``. The kernel

* optionally RMS-normalises every Q and K head over its ``d`` values first (qwen3's q_norm / k_norm:
  ``x * rsqrt(mean(x^2) + eps) * weight``, weights ``[d]`` f32, ``qk_norm``),
* rotates Q and writes it to ``q_out [n_q, S, d]`` (the query layout of the prefill
  ``flash_attention`` kernel),
* rotates K into ``k_cache[h, pos0 + s, :]`` and copies V into ``v_cache[h, pos0 + s, :]`` (caches
  ``[n_kv, max_len, d]`` f32); positions at or past ``max_len`` write nothing to the caches.

The rotation is the decode kernel's (:func:`ptx_gen.kernels.kv.rope_append.rotate_pair`: interleaved pairs
(2i, 2i+1) or NeoX pairs (i, i + d/2), angle ``f32(pos) * inv_freq[i]`` reduced to [-pi, pi]), so a
token rotates to the same bits here as in a decode step. ``qkv`` is only read.

Mapping: one warp per (token, head row) of the ``n_q + 2 n_kv`` rows of a token; lane ``l`` holds
pairs ``l + 32 j`` in registers (loaded once: the per-head norm's sum of squares is a warp
reduction), so every load and store of a warp covers consecutive addresses.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.kv.rope_append import rotate_pair

WARPS = 4
BLOCK = 32 * WARPS

_GRID = [
    {"head_dim": 64, "neox": False, "qk_norm": False},
    {"head_dim": 64, "neox": True, "qk_norm": False},
    {"head_dim": 128, "neox": False, "qk_norm": False},
    {"head_dim": 128, "neox": True, "qk_norm": True},
    {"head_dim": 80, "neox": True, "qk_norm": False},
    {"head_dim": 96, "neox": False, "qk_norm": True},
    {"head_dim": 256, "neox": True, "qk_norm": True},
    {"head_dim": 32, "neox": False, "qk_norm": True},
]


@kernel("rope_append_rows", grid=_GRID)
def rope_append_rows(m: Module, head_dim: int = 128, neox: bool = False, qk_norm: bool = False) -> KernelBuilder:
    """RoPE (after an optional per-head RMSNorm of Q and K) of ``count`` tokens at positions
    ``pos0 + s``: Q to ``q_out [n_q, count, d]``, K and V into the caches. Params: qkv, q_out, k_cache,
    v_cache, inv_freq (d/2 f32), [q_norm, k_norm (d f32 each)], pos0, count, n_q, n_kv, max_len, [eps].
    Launch: grid (count, ceil((n_q + 2 n_kv) / 4)), block 128."""
    if head_dim % 2 or not 2 <= head_dim <= 512:
        raise ValueError(f"head_dim must be even and at most 512, got {head_dim}")
    name = f"rope_append_rows_d{head_dim}" + ("_neox" if neox else "_interleaved") + ("_qknorm" if qk_norm else "")
    params = [("qkv", "u64"), ("q_out", "u64"), ("k_cache", "u64"), ("v_cache", "u64"), ("inv_freq", "u64")]
    if qk_norm:
        params += [("q_norm", "u64"), ("k_norm", "u64")]
    params += [("pos0", "u32"), ("count", "u32"), ("n_q", "u32"), ("n_kv", "u32"), ("max_len", "u32")]
    if qk_norm:
        params.append(("eps", "f32"))
    k = m.kernel(name, params, max_threads=BLOCK)
    k.meta.update(block=BLOCK, warps=WARPS)
    half = head_dim // 2
    n_q, n_kv, max_len, count = k.param("n_q"), k.param("n_kv"), k.param("max_len"), k.param("count")
    tid = k.tid()
    lane = k.and_(tid, 31)
    s = k.ctaid("x")
    row = k.mad(k.ctaid("y"), WARPS, k.shr(tid, 5))  # warp-uniform: q heads, then k heads, then v heads
    n_rows = k.add(n_q, k.shl(n_kv, 1))
    end = k.new_label("end")
    k.bra(end, k.setp("ge", row, n_rows))
    k.bra(end, k.setp("ge", s, count))
    pos = k.add(k.param("pos0"), s)
    in_cache = k.setp("lt", pos, max_len)
    src = k.add(k.global_ptr("qkv"), k.mul_wide(k.mad(s, n_rows, row), head_dim * 4))

    idx, oks, offs, _ = lane_pairs(k, lane, half, neox)
    xs = [load_f32_pair(k, src, off, ok, neox) for off, ok in zip(offs, oks)]

    qk_rows = k.add(n_q, n_kv)
    with k.if_(k.setp("ge", row, qk_rows)):  # a V row: copied as is
        v_row = k.mad(k.sub(row, qk_rows), max_len, pos)
        dst = k.add(k.global_ptr("v_cache"), k.mul_wide(v_row, head_dim * 4))
        for (x0, x1), off, ok in zip(xs, offs, oks):
            store_f32_pair(k, dst, off, x0, x1, k.both(ok, in_cache), neox)
        k.bra(end)

    is_q = k.setp("lt", row, n_q)
    if qk_norm:
        xs = head_rmsnorm(k, xs, offs, oks, is_q, head_dim, neox)
    q_dst = k.add(k.global_ptr("q_out"), k.mul_wide(k.mad(row, count, s), head_dim * 4))
    k_row = k.mad(k.sub(row, n_q), max_len, pos)  # meaningful for K rows only
    k_dst = k.add(k.global_ptr("k_cache"), k.mul_wide(k_row, head_dim * 4))
    dst = k.selp(q_dst, k_dst, is_q)
    store_ok = k.or_(is_q, in_cache)
    inv_freq = k.global_ptr("inv_freq")
    for (x0, x1), i, off, ok in zip(xs, idx, offs, oks):
        o0, o1 = rotate_pair(k, x0, x1, pos, load_inv_freq(k, inv_freq, i, ok))
        store_f32_pair(k, dst, off, o0, o1, k.both(ok, store_ok), neox)
    k.label(end)
    k.ret()
    return k


def lane_pairs(k: KernelBuilder, lane: Reg, half: int, neox: bool, elements: bool = False):
    """This lane's pairs of a head row (one warp a row): for pair index ``i = lane + 32 j`` the lists of
    ``i``, its guard (``i < half``; None where every lane has the pair), the byte offsets of its two
    f32 elements inside the row (the second None where the pair is adjacent, interleaved RoPE) and,
    with ``elements``, their element offsets (else an empty list)."""
    idx, oks, offs, eoffs = [], [], [], []
    for j in range(-(-half // 32)):
        i = k.add(lane, 32 * j) if j else lane
        idx.append(i)
        oks.append(k.setp("lt", i, half) if 32 * (j + 1) > half else None)
        if neox:
            o0 = k.mul_wide(i, 4)
            offs.append((o0, k.add(o0, half * 4)))
            if elements:
                eoffs.append((i, k.add(i, half)))
        else:
            offs.append((k.mul_wide(i, 8), None))
            if elements:
                eoffs.append((k.shl(i, 1), None))
    return idx, oks, offs, eoffs


def load_inv_freq(k: KernelBuilder, inv_freq: Reg, i: Reg, ok: Reg | None) -> Reg:
    """``inv_freq[i]`` (f32, read-only path; 0 where ``ok`` is false)."""
    addr = k.add(inv_freq, k.mul_wide(i, 4))
    if ok is None:
        return k.load("global", "f32", addr, nc=True)
    return k.load("global", "f32", addr, nc=True, pred=ok, other=0.0)


def load_f32_pair(k: KernelBuilder, base: Reg, off: tuple, ok: Reg | None, neox: bool) -> tuple[Reg, Reg]:
    """The pair at byte offsets ``off`` of the head at ``base`` (zeros where ``ok`` is false)."""
    guard = {} if ok is None else {"pred": ok, "other": 0.0}
    if neox:
        return (k.load("global", "f32", k.add(base, off[0]), **guard),
                k.load("global", "f32", k.add(base, off[1]), **guard))
    return k.load("global", "f32", k.add(base, off[0]), vec=2, **guard)


def store_f32_pair(k: KernelBuilder, base: Reg, off: tuple, x0: Reg, x1: Reg, ok: Reg | None, neox: bool) -> None:
    if neox:
        k.store("global", "f32", k.add(base, off[0]), x0, pred=ok)
        k.store("global", "f32", k.add(base, off[1]), x1, pred=ok)
    else:
        k.store("global", "f32", k.add(base, off[0]), [x0, x1], pred=ok)


def head_rmsnorm(k: KernelBuilder, xs: list, offs: list, oks: list, is_q: Reg, head_dim: int,
                  neox: bool) -> list:
    """Emits the per-head RMSNorm of the warp's head: ``x * rsqrt(mean(x^2) + eps) * w`` with ``w`` the
    q_norm (Q rows) or k_norm (K rows) weights, in the order of the rmsnorm kernel's arithmetic."""
    ss = None
    for x0, x1 in xs:
        ss = k.mul(x0, x0) if ss is None else k.fma(x0, x0, ss)
        ss = k.fma(x1, x1, ss)
    total = k.warp_reduce(ss)
    inv = k.rsqrt(k.add(k.mul(total, 1.0 / head_dim), k.param("eps")))
    w = k.selp(k.global_ptr("q_norm"), k.global_ptr("k_norm"), is_q)
    out = []
    for (x0, x1), off, ok in zip(xs, offs, oks):
        guard = {} if ok is None else {"pred": ok, "other": 0.0}
        if neox:
            w0 = k.load("global", "f32", k.add(w, off[0]), nc=True, **guard)
            w1 = k.load("global", "f32", k.add(w, off[1]), nc=True, **guard)
        else:
            w0, w1 = k.load("global", "f32", k.add(w, off[0]), vec=2, nc=True, **guard)
        out.append((k.mul(k.mul(x0, inv), w0), k.mul(k.mul(x1, inv), w1)))
    return out
