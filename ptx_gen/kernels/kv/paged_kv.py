"""Shared pieces of the paged-KV kernels: the pool layout, the storage dtypes and their conversions.

Pool of one layer (K and V alike): ``[num_blocks, num_kv_heads, block_size, head_dim]`` elements of
``kv_dtype``; position ``p`` of a sequence with block table ``table`` (u32 block ids) lives in block
``table[p // block_size]`` at row ``p % block_size``. Block 0 is the null block (padding rows write
there). Storage dtypes: ``f32``; ``f16`` and ``bf16`` (rounded to nearest even on the way in, widened
exactly on the way out); ``q8_0`` (GGML's Q8_0 per 32 values of a head row): int8 codes in the pool
``[num_blocks, num_kv_heads, block_size, head_dim]`` plus a separate scales pool ``[num_blocks,
num_kv_heads, block_size, head_dim / 32]`` f16 (a row's scales 2 * head_dim / 32 bytes apart, so the codes
keep the 16-byte loads of the other dtypes and the scales of a block's rows sit together). Quantisation of
32 f32 values ``x``: ``d = max|x| / 127`` (f32 division), ``id = 1 / d`` (0 when ``d`` is 0), codes
``rint(x * id)`` (f32 product, nearest even), stored scale ``f16(d)``; a value reads back as ``code *
f32(scale)``. Every kernel accumulates in f32.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.types import ptx_type

KV_DTYPES = ("f32", "f16", "bf16", "q8_0")
BLOCK_SIZES = (16, 32, 64)
ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 1}  # q8_0: the codes (scales in their own pool)
QK = 32  # values per q8_0 scale

_f16 = ptx_type("f16")
_bf16 = ptx_type("bf16")


def check_paged(block_size: int, kv_dtype: str, head_dim: int | None = None) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    if kv_dtype == "q8_0" and head_dim is not None and head_dim % QK:
        raise ValueError(f"a q8_0 pool needs head_dim a multiple of {QK}, got {head_dim}")


def kv_params(kv_dtype: str) -> list:
    """Kernel parameters of the pools: k_pool, v_pool (+ k_scales, v_scales for q8_0)."""
    params = [("k_pool", "u64"), ("v_pool", "u64")]
    if kv_dtype == "q8_0":
        params += [("k_scales", "u64"), ("v_scales", "u64")]
    return params


def scale_row(k: KernelBuilder, scales: Reg, page: Reg, kvh: Reg, n_kv: Reg, row: Reg, block_size: int,
              head_dim: int) -> Reg:
    """Address of the f16 scales of row ``row`` of kv head ``kvh`` in block ``page`` of a q8_0 scales pool."""
    r = k.mad(k.mad(page, n_kv, kvh), block_size, row)
    return k.add(scales, k.mul_wide(r, head_dim // QK * 2))


def f16_bits_to_f32(k: KernelBuilder, h: Reg) -> Reg:
    """A 16-bit register holding f16 bits -> f32 (exact)."""
    return k.cvt(Reg(h.name, _f16), "f32")


def q8_values(k: KernelBuilder, words: list, scale: Reg | list) -> list:
    """The int8 codes of b32 ``words`` (low byte first) times ``scale`` (f32; or one f32 per value) as f32."""
    out = []
    for w in words:
        for b in range(4):
            code = k.cvt(k.bfe(w, 8 * b, 8, "s32"), "f32")
            out.append(k.mul(code, scale if isinstance(scale, Reg) else scale[len(out)]))
    return out


def load_words(k: KernelBuilder, addr: Reg, nbytes: int, pred: Reg | None = None) -> list:
    """``nbytes`` (a multiple of 4) at ``addr`` as b32 words, in the widest loads the byte count allows
    (``addr`` aligned to them); zeros where ``pred`` is false."""
    guard = {} if pred is None else {"pred": pred, "other": 0}
    vec_bytes = 16 if nbytes % 16 == 0 else 8 if nbytes % 8 == 0 else 4
    out: list = []
    for off in range(0, nbytes, vec_bytes):
        w = k.load("global", "b32", addr, off, vec=vec_bytes // 4, **guard)
        out.extend(w if isinstance(w, tuple) else [w])
    return out


def quantize_q8(k: KernelBuilder, slots: list, lane: Reg, head_dim: int) -> tuple[list, list]:
    """Q8_0 of the warp's head row. ``slots``: (value f32, group) per value a lane holds, the group (of 32
    row values) a compile-time int or a pair ``(g_low, g_high)`` for lanes 0-15 / 16-31. Every lane of
    the warp must run this (butterfly shuffles). Returns (codes s32 per slot, scales f16 bits per group)."""
    hi = k.setp("ge", lane, 16)
    groups = head_dim // QK
    ids, scales = [], []
    for g in range(groups):
        cand = None
        for x, grp in slots:
            a = k.abs(x)
            if isinstance(grp, tuple):
                if g not in grp:
                    continue
                if grp[0] != grp[1]:
                    a = k.selp(a, 0.0, hi) if grp[1] == g else k.selp(0.0, a, hi)
            elif grp != g:
                continue
            cand = a if cand is None else k.max(cand, a)
        for off in (16, 8, 4, 2, 1):
            cand = k.max(cand, k.shfl("bfly", cand, off))
        d = k.div(cand, 127.0)
        ids.append(k.selp(k.rcp(d), 0.0, k.setp("gt", d, 0.0)))
        scales.append(k.bitcast(k.cvt(d, "f16"), "b16"))
    codes = []
    for x, grp in slots:
        if isinstance(grp, tuple):
            inv = ids[grp[0]] if grp[0] == grp[1] else k.selp(ids[grp[1]], ids[grp[0]], hi)
        else:
            inv = ids[grp]
        codes.append(k.cvt(k.mul(x, inv), "s32", "rni"))
    return codes, scales


def log2(n: int) -> int:
    return n.bit_length() - 1


def pool_row(k: KernelBuilder, pool: Reg, page: Reg, kvh: Reg, n_kv: Reg, row: Reg, block_size: int,
             head_dim: int, kv_dtype: str) -> Reg:
    """Address of row ``row`` (< block_size) of kv head ``kvh`` in block ``page`` of ``pool``."""
    r = k.mad(k.mad(page, n_kv, kvh), block_size, row)
    return k.add(pool, k.mul_wide(r, head_dim * ELEM_BYTES[kv_dtype]))


def to_f32(k: KernelBuilder, word: Reg, kv_dtype: str) -> list:
    """The two 16-bit values of a b32 word (low half first) as f32."""
    if kv_dtype == "f16":
        lo, hi = k.unpack_b32(word)
        return [k.cvt(Reg(lo.name, _f16), "f32"), k.cvt(Reg(hi.name, _f16), "f32")]
    lo = k.bitcast(k.shl(word, 16, "b32"), "f32")  # bf16 -> f32 is exact: the bits move up
    hi = k.bitcast(k.and_(word, 0xFFFF0000, "b32"), "f32")
    return [lo, hi]


def load_values(k: KernelBuilder, addr: Reg, n: int, kv_dtype: str, pred: Reg | None = None,
                space: str = "global") -> list:
    """``n`` (a multiple of 4) consecutive stored values at ``addr`` (in ``space``) as f32 (zeros where ``pred``
    is false), in 16-byte loads where the byte count allows (``addr`` aligned to them), else 8-byte."""
    es = ELEM_BYTES[kv_dtype]
    nbytes = n * es
    vec_bytes = 16 if nbytes % 16 == 0 else 8
    guard = {} if pred is None else {"pred": pred, "other": 0.0 if kv_dtype == "f32" else 0}
    out: list = []
    for off in range(0, nbytes, vec_bytes):
        vec = vec_bytes // 4
        if kv_dtype == "f32":
            out.extend(k.load(space, "f32", addr, off, vec=vec, **guard))
        else:
            for w in k.load(space, "b32", addr, off, vec=vec, **guard):
                out.extend(to_f32(k, w, kv_dtype))
    return out


def narrow(k: KernelBuilder, x: Reg, kv_dtype: str) -> Reg:
    """f32 -> the storage type's 16-bit register (rounded to nearest even). bf16 is rounded with integer
    arithmetic (the bits plus 0x7FFF plus the kept lowest bit, NaN kept quiet), the same on every target."""
    if kv_dtype == "f16":
        return k.bitcast(k.cvt(x, "f16"), "b16")
    bits = k.bitcast(x, "u32")
    rounded = k.shr(k.add(bits, k.add(k.and_(k.shr(bits, 16), 1, "u32"), 0x7FFF)), 16)
    nan = k.setp("gt", k.and_(bits, 0x7FFFFFFF, "u32"), 0x7F800000)
    hi = k.selp(k.or_(k.shr(bits, 16), 0x40, "u32"), rounded, nan)
    return k.bitcast(k.cvt(hi, "u16"), "b16")


def store_pair(k: KernelBuilder, base: Reg, off: tuple, x0: Reg, x1: Reg, ok: Reg | None, neox: bool,
               kv_dtype: str) -> None:
    """Store the pair (x0, x1) at element offsets ``off`` (u32 element indices: (e0, e1) for NeoX pairs,
    (e0, None) for adjacent ones) of the row at ``base``, converted to ``kv_dtype``."""
    es = ELEM_BYTES[kv_dtype]
    if kv_dtype == "f32":
        if neox:
            k.store("global", "f32", k.add(base, k.mul_wide(off[0], es)), x0, pred=ok)
            k.store("global", "f32", k.add(base, k.mul_wide(off[1], es)), x1, pred=ok)
        else:
            k.store("global", "f32", k.add(base, k.mul_wide(off[0], es)), [x0, x1], pred=ok)
        return
    h0, h1 = narrow(k, x0, kv_dtype), narrow(k, x1, kv_dtype)
    if neox:
        k.store("global", "b16", k.add(base, k.mul_wide(off[0], es)), h0, pred=ok)
        k.store("global", "b16", k.add(base, k.mul_wide(off[1], es)), h1, pred=ok)
    else:
        k.store("global", "b32", k.add(base, k.mul_wide(off[0], es)), k.pack_b32(h0, h1), pred=ok)
