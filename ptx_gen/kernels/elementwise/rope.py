"""Rotary position embedding of Q and K in place, in one launch.

Q is ``[n_tokens, n_q, head_dim]`` and K ``[n_tokens, n_kv, head_dim]`` (f32, contiguous). Pair ``i``
(``i < rot_dim / 2``) of a head is rotated by ``pos * inv_freq[i]``:

* interleaved (llama GGUF, ``neox=False``): elements ``(2i, 2i + 1)``;
* NeoX (``neox=True``, Qwen/GPT-NeoX style): elements ``(i, i + rot_dim / 2)``.

``inv_freq`` (``rot_dim / 2`` f32) is a device table made on the host (``theta ** (-2i / rot_dim)``
in float64 rounded to f32, or a scaled variant), so the angle is ``f32(pos) * inv_freq[i]`` rounded
to f32 exactly like a float32 reference computes it. The angle is then reduced to [-pi, pi] with a
two-constant Cody-Waite step before ``sin.approx``/``cos.approx`` (absolute error ~5e-7).

The position of token ``t`` is ``pos + t`` (a parameter) or, with ``pos_from_buffer``, the u32
``positions[t]`` of a device buffer, so a captured graph replays with a new position.
Grid: ``(ceil((n_q + n_kv) * rot_dim / 2 / block), n_tokens)``.
"""

from __future__ import annotations

import math

import numpy as np

from ptx_gen.builder import KernelBuilder, Module
from ptx_gen.catalog import kernel

TWO_PI_HI = float(np.float32(2 * math.pi))
TWO_PI_LO = float(np.float32(2 * math.pi - float(np.float32(2 * math.pi))))
BLOCK = 128


@kernel("rope", grid=[{"head_dim": d, "neox": nx, "pos_from_buffer": pb}
                      for d in (64, 80, 128, 256) for nx in (False, True) for pb in (False, True)]
        + [{"head_dim": 96, "rot_dim": 32, "neox": True}])
def rope(m: Module, head_dim: int = 128, rot_dim: int = 0, neox: bool = False,
         pos_from_buffer: bool = False) -> KernelBuilder:
    """Rotate the first ``rot_dim`` (0: all) dims of every Q and K head of every token in place.
    Params: q, k, inv_freq (rot_dim/2 f32), pos (u32) or positions (u32 buffer), n_q, n_kv.
    Launch: grid (ceil((n_q + n_kv) * rot_dim / 2 / 128), n_tokens), block 128."""
    rot_dim = rot_dim or head_dim
    if head_dim % 2 or not 2 <= head_dim <= 512 or rot_dim % 2 or not 2 <= rot_dim <= head_dim:
        raise ValueError(f"need even head_dim <= 512 and even rot_dim <= head_dim; got {head_dim}, {rot_dim}")
    half = rot_dim // 2
    params = [("q", "u64"), ("k", "u64"), ("inv_freq", "u64")]
    params.append(("positions", "u64") if pos_from_buffer else ("pos", "u32"))
    params += [("n_q", "u32"), ("n_kv", "u32")]
    name = f"rope_d{head_dim}_r{rot_dim}" + ("_neox" if neox else "_interleaved") + ("_posbuf" if pos_from_buffer else "")
    k = m.kernel(name, params, max_threads=BLOCK)
    k.meta.update(block=BLOCK, pairs_per_head=half)
    n_q, n_kv = k.param("n_q"), k.param("n_kv")
    idx = k.global_index_x()
    total = k.mul(k.add(n_q, n_kv), half)
    end = k.new_label("end")
    k.bra(end, k.setp("ge", idx, total))
    t = k.ctaid("y")
    head = k.div(idx, half)
    i = k.sub(idx, k.mul(head, half))
    is_q = k.setp("lt", head, n_q)
    # element offset of this head's first value
    q_row = k.mad(t, n_q, head)
    k_row = k.sub(k.mad(t, n_kv, head), n_q)
    row = k.selp(q_row, k_row, is_q)
    base = k.selp(k.global_ptr("q"), k.global_ptr("k"), is_q)
    vbase = k.add(base, k.mul_wide(row, head_dim * 4))
    if pos_from_buffer:
        pos = k.load("global", "u32", k.add(k.global_ptr("positions"), k.mul_wide(t, 4)))
    else:
        pos = k.add(k.param("pos"), t)
    inv = k.load("global", "f32", k.add(k.global_ptr("inv_freq"), k.mul_wide(i, 4)), nc=True)
    angle = k.mul(k.cvt(pos, "f32"), inv)
    turns = k.cvt(k.cvt(k.mul(angle, 1.0 / (2 * math.pi)), "s32", rounding="rni"), "f32")
    r = k.fma(k.neg(turns), TWO_PI_HI, angle)
    r = k.fma(k.neg(turns), TWO_PI_LO, r)
    c, s = k.cos(r), k.sin(r)
    if neox:
        a0 = k.add(vbase, k.mul_wide(i, 4))
        a1 = k.add(a0, half * 4)
        x0 = k.load("global", "f32", a0)
        x1 = k.load("global", "f32", a1)
    else:
        a0 = k.add(vbase, k.mul_wide(i, 8))
        x0, x1 = k.load("global", "f32", a0, vec=2)
    o0 = k.sub(k.mul(x0, c), k.mul(x1, s))
    o1 = k.fma(x0, s, k.mul(x1, c))
    if neox:
        k.store("global", "f32", a0, o0)
        k.store("global", "f32", a1, o1)
    else:
        k.store("global", "f32", a0, [o0, o1])
    k.label(end)
    k.ret()
    return k


def inv_freq_table(rot_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """``theta ** (-2i / rot_dim)`` for i < rot_dim / 2 in float64, rounded to f32 (what a float32
    reference computes). ``scaling``: ``{"type": "linear", "factor": f}`` divides the frequencies by f;
    ``{"type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position"}``
    applies Llama 3.1's smooth wavelength-dependent scaling."""
    inv = theta ** (-np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    if scaling:
        kind = scaling.get("type", "linear")
        f = float(scaling["factor"])
        if kind == "linear":
            inv = inv / f
        elif kind == "llama3":
            lo, hi = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
            old = float(scaling.get("original_max_position", 8192))
            wavelen = 2 * math.pi / inv
            low_wl, high_wl = old / lo, old / hi
            smooth = (old / wavelen - lo) / (hi - lo)
            scaled = np.where(wavelen > low_wl, inv / f, inv)
            mid = (wavelen <= low_wl) & (wavelen >= high_wl)
            scaled = np.where(mid, (1 - smooth) * inv / f + smooth * inv, scaled)
            inv = scaled
        else:
            raise ValueError(f"unknown rope scaling type {kind!r}")
    return inv.astype(np.float32)
