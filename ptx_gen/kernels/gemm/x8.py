"""The x8 activation format: what the quantized batch GEMM (:mod:`ptx_gen.kernels.gemm.gemm_x8`) reads for X,
and the kernel that writes it (``quantize_x8``).

Each row (token) of X, ``in_dim`` values (a multiple of 256), is cut into *units* of 256 values. A unit
is stored as

* 256 int8 **codes** ``q`` (row ``t``'s codes start ``t * ldq`` bytes into the codes buffer, unit ``u``
  at byte ``256 u`` of the row): ``q = rint(x * (127 / amax))`` (f32 product, round to nearest even),
  ``amax`` the unit's largest ``|x|``, so ``|q| <= 127``;
* a 32-byte **record** (row ``t``, unit ``u`` at byte ``32 (t * units + u)`` of the records buffer):
  bytes 0..7 and 8..15 the low and high base-256 digits of the 8 sums ``S_j`` of the codes of each
  32 values (``S_j = 256 hi_j + lo_j``, ``lo_j`` in [-128, 127], both signed bytes, so that an int8
  MMA multiplies them), bytes 16..19 the unit's scale ``d = amax / 127`` (f32; 0 for a unit of zeros).

X is then ``d q`` exactly (the GEMM's oracle multiplies that). One scale per 256 values, not per 32
as llama.cpp's q8_1: the weight types' integer sub-block scales (Q4_K, Q5_K, Q6_K) then weight exact
int32 sums across a unit, and float work runs once a unit, not once per 32 values; the per-32 sums
give the types with a min or a code offset their terms exactly.
"""

from __future__ import annotations

import numpy as np

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.gemv.quant_layout import F16_TYPE

UNIT = 256
RECORD = 32  # bytes of a unit's record
RECORD_D = 16  # byte offset of d in a record
WARPS = 8  # units a CTA quantizes (one a warp)


def quantize_x8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy definition of the format for X ``[rows, in_dim]`` (f16 or f32): (codes int8 ``[rows, in_dim]``,
    d f32 ``[rows, units]``, sums int32 ``[rows, units, 8]``), with the kernel's f32 arithmetic."""
    x = np.asarray(x, np.float32)
    rows, in_dim = x.shape
    if in_dim % UNIT:
        raise ValueError(f"in_dim must be a multiple of {UNIT}, got {in_dim}")
    u = x.reshape(rows, in_dim // UNIT, UNIT)
    amax = np.abs(u).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((u * inv[..., None]).astype(np.float32)).astype(np.int32)
    sums = q.reshape(rows, in_dim // UNIT, 8, 32).sum(axis=-1)
    return q.reshape(rows, in_dim).astype(np.int8), d, sums


def records(d: np.ndarray, sums: np.ndarray) -> np.ndarray:
    """The records (uint8 ``[rows, units, RECORD]``) of scales ``d`` and sums ``sums``."""
    rows, units = d.shape
    lo = ((sums + 128) & 255) - 128
    hi = (sums - lo) >> 8
    rec = np.zeros((rows, units, RECORD), np.uint8)
    rec[..., 0:8] = lo.astype(np.int8).view(np.uint8)
    rec[..., 8:16] = hi.astype(np.int8).view(np.uint8)
    rec[..., RECORD_D:RECORD_D + 4] = np.ascontiguousarray(d, np.float32)[..., None].view(np.uint8)
    return rec


def dequantize_x8(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``d q`` in float64, ``[rows, in_dim]``."""
    rows, in_dim = codes.shape
    q = codes.astype(np.float64).reshape(rows, -1, UNIT)
    return (q * d.astype(np.float64)[..., None]).reshape(rows, in_dim)


@kernel("quantize_x8", grid=[{"in_dim": d, "xh": h} for d in (256, 2048, 4096, 14336) for h in (True, False)])
def quantize_x8(m: Module, in_dim: int = 4096, xh: bool = True) -> KernelBuilder:
    """X (``xh``: f16, else f32; rows ``lda`` values apart) to x8 codes (rows ``ldq`` bytes apart) and
    records. Params: x, q, s, lda, ldq. Launch: grid (ceil(units / meta["units_per_cta"]), rows), block
    meta["block"]; ldq a multiple of 8 and X 16-byte aligned with lda a multiple of 8 values."""
    if in_dim <= 0 or in_dim % UNIT:
        raise ValueError(f"in_dim must be a positive multiple of {UNIT}, got {in_dim}")
    units = in_dim // UNIT
    name = f"quantize_x8_k{in_dim}" + ("_h" if xh else "")
    k = m.kernel(name, [("x", "u64"), ("q", "u64"), ("s", "u64"), ("lda", "u32"), ("ldq", "u32")],
                 max_threads=32 * WARPS)
    k.meta.update(block=32 * WARPS, units_per_cta=WARPS)
    tid = k.tid()
    lane, warp = k.and_(tid, 31), k.shr(tid, 5)
    unit = k.mad(k.ctaid(), WARPS, warp)
    tok = k.ctaid("y")
    done = k.new_label("done")
    k.bra(done, k.setp("ge", unit, units))
    k.grid_dependency_wait()  # X comes from the kernel before
    esize = 2 if xh else 4
    first = k.add(k.mul(tok, k.param("lda")), k.mad(unit, UNIT, k.shl(lane, 3)))  # (below 2**32 values)
    src = k.add(k.global_ptr("x"), k.mul_wide(first, esize))
    if xh:  # 8 halves: one 16-byte load
        words = k.load("global", "u32", src, vec=4)
        vals = [k.cvt(Reg(h.name, F16_TYPE), "f32") for w in words for h in k.unpack_b32(w)]
    else:
        vals = list(k.load("global", "f32", src, vec=4)) + list(k.load("global", "f32", src, 16, vec=4))
    amax = None
    for v in vals:
        a = k.abs(v)
        amax = a if amax is None else k.max(amax, a)
    amax = k.warp_reduce(amax, "max")
    d = k.div(amax, 127.0)
    inv = k.selp(k.div(127.0, amax), 0.0, k.setp("gt", amax, 0.0), "f32")
    q = [k.cvt(k.mul(v, inv), "s32", rounding="rni") for v in vals]
    words = [k.prmt(k.prmt(q[4 * i], q[4 * i + 1], 0x0040), k.prmt(q[4 * i + 2], q[4 * i + 3], 0x0040), 0x5410)
             for i in range(2)]
    dst = k.add(k.global_ptr("q"), k.add(k.mul_wide(tok, k.param("ldq")), k.cvt(k.mad(unit, UNIT, k.shl(lane, 3)), "u64")))
    k.store("global", "u32", dst, words)
    s = q[0]
    for v in q[1:]:
        s = k.add(s, v)
    s = k.add(s, k.shfl("bfly", s, 1))
    s = k.add(s, k.shfl("bfly", s, 2))  # lanes 4 j .. 4 j + 3: the sum of 32-value block j
    lo = k.sub(k.and_(k.add(s, 128), 255), 128)
    hi = k.shr(k.sub(s, lo), 8)  # (arithmetic: s32)
    rec = k.add(k.global_ptr("s"), k.mul_wide(k.mad(tok, units, unit), RECORD))
    blk = k.cvt(k.shr(lane, 2), "u64")
    with k.if_(k.setp("eq", k.and_(lane, 3), 0)):
        k.store("global", "u8", k.add(rec, blk), k.cvt(lo, "u8"))
        k.store("global", "u8", k.add(rec, blk), k.cvt(hi, "u8"), 8)
    with k.if_(k.setp("eq", lane, 0)):
        k.store("global", "f32", rec, d, RECORD_D)
    k.label(done)
    k.ret()
    return k
