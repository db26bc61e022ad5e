"""Shared pieces of the paged-KV kernels: the pool layout, the storage dtypes and their conversions.

Pool of one layer (K and V alike): ``[num_blocks, num_kv_heads, block_size, head_dim]`` elements of
``kv_dtype``; position ``p`` of a sequence with block table ``table`` (u32 block ids) lives in block
``table[p // block_size]`` at row ``p % block_size``. Block 0 is the null block (padding rows write
there). Storage dtypes: ``f32``; ``f16`` and ``bf16`` (rounded to nearest even on the way in, widened
exactly on the way out). Every kernel accumulates in f32.
"""

from __future__ import annotations

from ptx_gen.builder import KernelBuilder, Reg
from ptx_gen.types import ptx_type

KV_DTYPES = ("f32", "f16", "bf16")
BLOCK_SIZES = (16, 32, 64)
ELEM_BYTES = {"f32": 4, "f16": 2, "bf16": 2}

_f16 = ptx_type("f16")
_bf16 = ptx_type("bf16")


def check_paged(block_size: int, kv_dtype: str) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")


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


def load_values(k: KernelBuilder, addr: Reg, n: int, kv_dtype: str, pred: Reg | None = None) -> list:
    """``n`` (a multiple of 4) consecutive stored values at ``addr`` as f32 (zeros where ``pred`` is
    false), in 16-byte loads where the byte count allows (``addr`` aligned to them), else 8-byte."""
    es = ELEM_BYTES[kv_dtype]
    nbytes = n * es
    vec_bytes = 16 if nbytes % 16 == 0 else 8
    guard = {} if pred is None else {"pred": pred, "other": 0.0 if kv_dtype == "f32" else 0}
    out: list = []
    for off in range(0, nbytes, vec_bytes):
        vec = vec_bytes // 4
        if kv_dtype == "f32":
            out.extend(k.load("global", "f32", addr, off, vec=vec, **guard))
        else:
            for w in k.load("global", "b32", addr, off, vec=vec, **guard):
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
