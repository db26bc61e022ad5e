"""Per-row sampling of a batch of logits in one launch: greedy, temperature, top-k, top-p with a
counter-based hash RNG and the Gumbel-max trick, the device twin of ``realizar.sampling.sample_rows``
(whose comment states the semantics and the RNG bit for bit).

Launch: grid ``B`` (one CTA a row), block ``block``. Parameters: ``logits`` f32 rows ``ld`` elements
apart, ``specs`` (``SPEC_WORDS`` u32 a row, below), ``out`` u32[B], ``vocab`` (< 2**31).

Row spec, 32 bytes: ``[temperature f32 bits, top_k u32, top_p f32 bits, seed_lo, seed_hi, step, 0, 0]``.
Everything the kernel reads per step lives in that buffer, so one captured graph serves any mix of
requests (the host rewrites the specs before each replay).

Passes over the row (each a block-strided read of V floats, all CTAs' rows in parallel):

* greedy (temperature 0): 1 pass, packed (value, index) maximum as in ``argmax``;
* sampling: pass 1: z_max and z_min (z = logit * f32(1/T)); then the thresholds in the order-preserving
  u32 key space of z, by a 16-way search: each pass counts (top-k) or sums exp(z - z_max) (top-p) at 15
  pivots inside the current bracket [lo, hi), only for the elements inside it (the others cost two
  compares), and keeps the sub-bracket holding the threshold: at most 8 passes for top-k plus one pass
  for the kept mass and at most 8 for top-p (fewer when the bracket of keys is narrower); last pass:
  the Gumbel key z - flog(-flog(u)) of every kept token with z >= z_max - 20 (below that a token's key
  cannot reach the maximum token's: the noise lies in [-2.82, 16.64]) and the packed maximum.
  Worst case 1 + 8 + 1 + 8 + 1 = 19 passes; no filter: 2 passes.
The f32 arithmetic that decides the draw (z, the hash, flog, the Gumbel key) uses ``.rn`` operations,
never fused, so it equals the NumPy mirror bit for bit; only the top-p masses (``ex2.approx``, sums in
another order) differ by rounding, which matters only at a cut within ~1e-6 of ``top_p``.
"""

from __future__ import annotations

import numpy as np

from ptx_gen.builder import KernelBuilder, Module, Reg
from ptx_gen.catalog import kernel
from ptx_gen.kernels.sampling.argmax import block_max_u64, pack

SPEC_WORDS = 8
PIVOTS = 15  # per search pass: 16 sub-brackets, 4 bits of the key a pass
GUMBEL_REACH = 20.0  # z below z_max - GUMBEL_REACH never wins (noise within [-2.82, 16.64])
LOG2E = 1.4426950408889634

_M1, _M2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9
_SQRT2_BITS = 0x3FB504F3
_C3, _C5, _C7, _C9 = (float(np.float32(1 / 3)), float(np.float32(1 / 5)), float(np.float32(1 / 7)),
                      float(np.float32(1 / 9)))
_LN2_HI = float(np.uint32(0x3F317200).view(np.float32))
_LN2_LO = float(np.float32(np.log(2.0) - _LN2_HI))


def _f(k: KernelBuilder, op: str, a, b) -> Reg:
    """One IEEE-rounded f32 operation (``.rn``: ptxas never fuses it into an fma)."""
    return k._binary(op, a, b, "f32", ".rn")


def _fmix32(k: KernelBuilder, x: Reg) -> Reg:
    x = k.xor(x, k.shr(x, 16))
    x = k.mul(x, _M1, "u32")
    x = k.xor(x, k.shr(x, 13))
    x = k.mul(x, _M2, "u32")
    return k.xor(x, k.shr(x, 16))


def _flog(k: KernelBuilder, x: Reg) -> Reg:
    """The mirror's ``_flog32``: ln x for a positive normal f32, same operations, same order."""
    bits = k.bitcast(x, "u32")
    e = k.sub(k.cvt(k.shr(bits, 23), "s32"), 127, "s32")
    mb = k.or_(k.and_(bits, 0x7FFFFF), 0x3F800000)
    big = k.setp("gt", mb, _SQRT2_BITS)
    mb = k.selp(k.sub(mb, 0x00800000, "u32"), mb, big, "u32")
    e = k.add(e, k.selp(1, 0, big, "s32"), "s32")
    m = k.bitcast(mb, "f32")
    s = _f(k, "div", _f(k, "sub", m, 1.0), _f(k, "add", m, 1.0))
    s2 = _f(k, "mul", s, s)
    p = _f(k, "mul", s2, _C9)
    for c in (_C7, _C5, _C3):
        p = _f(k, "add", p, c)
        p = _f(k, "mul", p, s2)
    r = _f(k, "mul", s, p)
    r = _f(k, "add", r, s)
    r = _f(k, "add", r, r)
    ef = k.cvt(e, "f32")
    r = _f(k, "add", r, _f(k, "mul", ef, _LN2_LO))
    return _f(k, "add", _f(k, "mul", ef, _LN2_HI), r)


def _okey(k: KernelBuilder, z: Reg) -> Reg:
    """Order-preserving u32 key of an f32 (-0 and +0 share a key)."""
    bits = k.selp(0, k.bitcast(z, "u32"), k.setp("eq", z, 0.0), t="u32")
    neg = k.setp("ne", k.and_(bits, 0x80000000), 0)
    return k.selp(k.not_(bits), k.or_(bits, 0x80000000), neg, t="u32")


class _Reducer:
    """Block-wide reductions of small vectors; results are broadcast to every thread."""

    def __init__(self, k: KernelBuilder, block: int, width: int):
        self.k, self.warps = k, block // 32
        self.smem = k.shared_array(f"{k.name}_vec", "u32", 32 * width, align=16)
        self.tot = k.shared_array(f"{k.name}_tot", "u32", width, align=16)
        tid = k.tid()
        self.lane, self.warp = k.and_(tid, 31), k.shr(tid, 5)
        self.tid = tid

    def __call__(self, values: list[Reg], op: str) -> list[Reg]:
        k, n = self.k, len(values)
        fn = {"add": k.add, "max": k.max, "min": k.min}[op]
        t = values[0].type
        parts = [k.warp_reduce(v, op) for v in values]
        k.bar_sync()  # the previous call's readers are done with smem/tot
        with k.if_(k.setp("eq", self.lane, 0)):
            for j, p in enumerate(parts):
                k.store("shared", t, k.add(self.smem, k.shl(k.add(k.mul(self.warp, n, "u32"), j, "u32"), 2)), p)
        k.bar_sync()
        with k.if_(k.setp("lt", self.tid, n)):
            acc = k.var(t, k.load("shared", t, k.add(self.smem, k.shl(self.tid, 2))))
            for w in range(1, self.warps):
                other = k.load("shared", t, k.add(self.smem, k.shl(k.add(self.tid, w * n, "u32"), 2)))
                k.assign(acc, fn(acc, other))
            k.store("shared", t, k.add(self.tot, k.shl(self.tid, 2)), acc)
        k.bar_sync()
        return [k.load("shared", t, self.tot, 4 * j) for j in range(n)]


@kernel("sample_rows", grid=[{"block": 512}, {"block": 1024}, {"block": 256}])
def sample_rows(m: Module, block: int = 512) -> KernelBuilder:
    """out[r] = the token drawn for row r of ``logits`` under specs[r] (greedy / temperature / top-k /
    top-p, hash RNG + Gumbel-max; the mirror is realizar.sampling.sample_rows). Grid B, block ``block``."""
    if block % 32 or not 64 <= block <= 1024:
        raise ValueError(f"block must be a multiple of 32 in [64, 1024], got {block}")
    k = m.kernel(f"sample_rows_b{block}", [("logits", "u64"), ("ld", "u32"), ("specs", "u64"), ("out", "u64"),
                                            ("vocab", "u32")], max_threads=block)
    k.meta.update(block=block)
    row, tid, vocab = k.ctaid(), k.tid(), k.param("vocab")
    x_row = k.add(k.global_ptr("logits"), k.mul_wide(k.mul(row, k.param("ld"), "u32"), 4))
    spec = k.add(k.global_ptr("specs"), k.mul_wide(row, SPEC_WORDS * 4))
    t_bits, top_k, p_bits, seed_lo, seed_hi, step = (k.load("global", "u32", spec, 4 * j) for j in range(6))
    red = _Reducer(k, block, PIVOTS + 1)

    def each(body):
        with k.loop(tid, vocab, block) as i:
            body(i, k.load("global", "f32", k.add(x_row, k.mul_wide(i, 4))))

    best = k.var("u64", 0)
    greedy = k.setp("eq", k.and_(t_bits, 0x7FFFFFFF), 0)
    sampled = k.new_label("sampled")
    done = k.new_label("reduce")
    k.bra(sampled, greedy, negate=True)
    each(lambda i, x: k.assign(best, k.max(best, pack(k, x, i))))
    k.bra(done)

    k.label(sampled)
    inv_t = _f(k, "div", 1.0, k.bitcast(t_bits, "f32"))
    top_p = k.bitcast(p_bits, "f32")
    zmax, zmin = k.var("f32", float("-inf")), k.var("f32", float("inf"))

    def minmax(i, x):
        z = _f(k, "mul", x, inv_t)
        k.assign(zmax, k.max(zmax, z))
        k.assign(zmin, k.min(zmin, z))

    each(minmax)
    # z_min's key is the complement of the largest complemented key: one max-reduction for both
    zmax_key, zmin_not = red([_okey(k, zmax), k.bitcast(k.not_(_okey(k, zmin)), "u32")], "max")
    zmin_key = k.bitcast(k.not_(zmin_not), "u32")
    zmax_f = k.var("f32", float("-inf"))  # z_max as a float, for the masses and the Gumbel reach
    # recover the float from its key
    neg = k.setp("lt", zmax_key, 0x80000000)
    zbits = k.selp(k.not_(zmax_key), k.xor(zmax_key, 0x80000000), neg, t="u32")
    k.assign(zmax_f, k.bitcast(zbits, "f32"))
    hi_top = k.add(zmax_key, 1, "u32")
    floor = k.var("u32", 0)  # keep tokens with key >= floor

    def search(lo_init: Reg, target: Reg, mass: bool) -> Reg:
        """Largest key v in [lo_init, hi_top) with (count | mass)(key >= v) >= target."""
        t = "f32" if mass else "u32"
        lo, hi = k.var("u32", lo_init), k.var("u32", hi_top)
        above = k.var(t, 0.0 if mass else 0)  # count / mass of keys >= hi
        head, end = k.new_label("search"), k.new_label("searched")
        k.label(head)
        k.bra(end, k.setp("le", k.sub(hi, lo, "u32"), 1))
        width = k.cvt(k.sub(hi, lo, "u32"), "u64")
        piv = [k.add(lo, k.cvt(k.shr(k.mul(width, j, "u64"), 4), "u32"), "u32") for j in range(1, PIVOTS + 1)]
        acc = [k.var(t, 0.0 if mass else 0) for _ in range(PIVOTS)]

        def count(i, x):
            z = _f(k, "mul", x, inv_t)
            key = _okey(k, z)
            inside = k.setp("ge", key, lo)
            inside2 = k.setp("lt", key, hi)
            with k.if_(k.both(inside, inside2)):
                w = k.ex2(k.mul(_f(k, "sub", z, zmax_f), LOG2E, "f32")) if mass else 1
                for j in range(PIVOTS):
                    a = acc[j]
                    k._emit(f"add.{t} {a}, {a}, {k._op(w, a.type)};", k.setp("ge", key, piv[j]))

        each(count)
        tot = red(list(acc), "add")
        new_lo, new_hi, new_above = k.var("u32", lo), k.var("u32", piv[0]), k.var(t, k.add(above, tot[0]))
        for j in range(PIVOTS):
            have = k.add(above, tot[j])
            ok = k.setp("ge", have, target)
            k.assign(new_lo, k.selp(piv[j], new_lo, ok, "u32"))
            k.assign(new_hi, k.selp(piv[j + 1] if j + 1 < PIVOTS else hi, new_hi, ok, "u32"))
            nxt = k.add(above, tot[j + 1]) if j + 1 < PIVOTS else above
            k.assign(new_above, k.selp(nxt, new_above, ok, t))
        k.assign(lo, new_lo)
        k.assign(hi, new_hi)
        k.assign(above, new_above)
        k.bra(head)
        k.label(end)
        return lo

    # top-k: 0 < k < V
    use_k = k.both(k.setp("gt", top_k, 0), k.setp("lt", top_k, vocab))
    with k.if_(use_k):
        k.assign(floor, search(zmin_key, top_k, mass=False))
    # top-p: p < 1; target = p * (mass of the tokens kept so far)
    with k.if_(k.setp("lt", top_p, 1.0)):
        s = k.var("f32", 0.0)

        def total(i, x):
            z = _f(k, "mul", x, inv_t)
            w = k.ex2(k.mul(_f(k, "sub", z, zmax_f), LOG2E, "f32"))
            k._emit(f"add.f32 {s}, {s}, {w};", k.setp("ge", _okey(k, z), floor))

        each(total)
        target = _f(k, "mul", top_p, red([s], "add")[0])
        k.assign(floor, search(floor, target, mass=True))
    # Gumbel-max over the kept tokens
    rk = _fmix32(k, k.xor(_fmix32(k, k.xor(_fmix32(k, k.xor(seed_lo, _GOLDEN)), seed_hi)), step))
    reach = _f(k, "sub", zmax_f, GUMBEL_REACH)

    def draw(i, x):
        z = _f(k, "mul", x, inv_t)
        kept = k.both(k.setp("ge", _okey(k, z), floor), k.setp("ge", z, reach))
        with k.if_(kept):
            h = _fmix32(k, k.add(_fmix32(k, k.xor(i, rk)), rk, "u32"))
            u = _f(k, "mul", k.cvt(k.or_(k.shr(h, 8), 1), "f32"), 2.0**-24)
            g = _flog(k, k.neg(_flog(k, u)))
            k.assign(best, k.max(best, pack(k, _f(k, "sub", z, g), i)))

    each(draw)
    k.label(done)
    total_best = block_max_u64(k, best, block)
    with k.if_(k.setp("eq", tid, 0)):
        idx = k.sub(0xFFFFFFFF, k.cvt(total_best, "u32"), t="u32")
        k.store("global", "u32", k.add(k.global_ptr("out"), k.mul_wide(row, 4)), idx)
    k.ret()
    return k
