"""Random GGUF weights and float64 oracles for the transformer-layer kernels (CPU and GPU tests,
the emulator checks and the GEMV benchmark share them)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from realizar.models.quants import LAYOUTS, dequantize
from realizar.models.reference import apply_rope, rms_norm

# f16 fields of each block that must hold finite numbers (name -> offset)
_F16_FIELDS = {
    "Q8_0": ("d",), "Q4_0": ("d",), "Q4_1": ("d", "m"), "Q5_0": ("d",), "Q5_1": ("d", "m"),
    "Q4_K": ("d", "dmin"), "Q5_K": ("d", "dmin"), "Q6_K": ("d",),
}


def random_weight(rng: np.random.Generator, wtype: str, out_dim: int, in_dim: int, scale: float = 1.0) -> np.ndarray:
    """Raw GGUF bytes (uint8) of an ``out_dim x in_dim`` tensor of type ``wtype`` with random codes and
    finite random scales: any byte pattern is a valid block once its f16 fields are finite."""
    lay = LAYOUTS[T[wtype]]
    if wtype == "F32":
        return (rng.standard_normal((out_dim, in_dim)) * scale).astype(np.float32).reshape(-1).view(np.uint8)
    if wtype == "F16":
        return (rng.standard_normal((out_dim, in_dim)) * scale).astype(np.float16).reshape(-1).view(np.uint8)
    if wtype == "BF16":
        f = (rng.standard_normal((out_dim, in_dim)) * scale).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).reshape(-1).view(np.uint8)
    nb = out_dim * in_dim // lay.block_size
    raw = rng.integers(0, 256, size=(nb, lay.type_size), dtype=np.uint8)
    for name in _F16_FIELDS[wtype]:
        off = lay.offset(name)
        mag = scale / (64.0 if wtype in ("Q4_K", "Q5_K", "Q6_K") else 16.0)
        vals = (rng.uniform(0.25, 1.0, nb) * mag * rng.choice([-1.0, 1.0], nb)).astype(np.float16)
        raw[:, off:off + 2] = vals.view(np.uint8).reshape(nb, 2)
    return raw.reshape(-1)


def epilogue_buffers(ops, rng: np.random.Generator, m: int, cols: int, *, bias: bool, residual: str | None,
                     out_f16: bool):
    """A GEMM test's output and epilogue operands on ``ops``'s device: ``(y, keywords, b, r)``. ``y`` is ``m x
    cols`` NaN-poisoned, or holds ``r`` when ``residual == "in_place"`` (then the residual is ``y`` itself);
    ``keywords`` has ``bias`` (``b``) and ``residual`` (``r``, or ``y``) when asked for. ``b`` and ``r`` are
    drawn in that order whatever is asked for (the same random stream for every epilogue)."""
    b = rng.standard_normal(cols).astype(np.float32)
    r = rng.standard_normal((m, cols)).astype(np.float32)
    ytype = np.float16 if out_f16 else np.float32
    y = ops.to_device(r.astype(ytype) if residual == "in_place" else np.full((m, cols), np.nan, ytype))
    kw = {}
    if bias:
        kw["bias"] = ops.to_device(b)
    if residual is not None:
        kw["residual"] = y if residual == "in_place" else ops.to_device(r)
    return y, kw, b, r


def dequant(raw: np.ndarray, wtype: str, out_dim: int, in_dim: int) -> np.ndarray:
    return dequantize(raw, T[wtype], (out_dim, in_dim))


def gemv_oracle(raw, wtype, out_dim, in_dim, x, bias=None, residual=None) -> np.ndarray:
    """float64 y = W x (+ bias) (+ residual) with W the dequantized weights."""
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    y = w @ np.asarray(x, np.float64)
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    return y


def gemv_tolerance(raw, wtype, out_dim, in_dim, x) -> np.ndarray:
    """Per-row scale for the relative error: sum_k |W[r,k] x[k]| (the size of what is summed)."""
    w = dequant(raw, wtype, out_dim, in_dim).astype(np.float64)
    return np.abs(w) @ np.abs(np.asarray(x, np.float64))


def rmsnorm_oracle(x, weight, eps, residual=None):
    x = np.asarray(x, np.float64)
    if residual is not None:
        x = x + residual
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight, x


def rope_oracle(v: np.ndarray, ang: np.ndarray, neox: bool, rot_dim: int | None = None) -> np.ndarray:
    """RoPE of ``v`` [heads, head_dim] by the angles ``ang`` [rot_dim / 2] (position times each pair's
    frequency): interleaved pairs (2i, 2i+1) (llama GGUF) or NeoX halves (i, i + rot_dim/2); the
    dimensions past ``rot_dim`` (default head_dim) pass through."""
    v = np.asarray(v, np.float64)
    rd = rot_dim or v.shape[1]
    half = rd // 2
    cos, sin = np.cos(ang), np.sin(ang)
    out = v.copy()
    if neox:
        a, b = v[:, :half], v[:, half:rd]
        out[:, :half] = a * cos - b * sin
        out[:, half:rd] = a * sin + b * cos
    else:
        a, b = v[:, 0:rd:2], v[:, 1:rd:2]
        out[:, 0:rd:2] = a * cos - b * sin
        out[:, 1:rd:2] = a * sin + b * cos
    return out


def silu(g):
    g = np.asarray(g, np.float64)
    return g / (1.0 + np.exp(-g))


def check_gemv_cols(y, raw, wtype, out_dim, in_dim, x, *, glu=False, bias=None, residual=None, out_f16=False,
                    padding_nan=True, what="") -> None:
    """Assert that ``y`` [cols, ldy] (any float dtype, ldy >= out_dim) is the columns GEMV of ``x``
    [cols, >= in_dim] (the tensor-core GEMV over several columns; x past in_dim is not read):
    ``y[c] = W x[c] (+ bias) (+ residual[c])`` with W the dequantized ``out_dim x in_dim`` weight ``raw``,
    or with ``glu`` ``silu(G x[c]) * (U x[c])`` with ``raw`` = [G; U] of 2 out_dim rows.

    Every one of the cols x out_dim outputs must be finite (not left NaN-poisoned) and within
    ``1e-6 * scale`` of the float64 value, scale being the size of what is summed: sum_k |W[r,k] x[c,k]|
    (+ |bias|) (+ |residual|), or for glu (|g| + sum_k |G[r,k] x[c,k]|) (|u| + sum_k |U[r,k] x[c,k]|);
    f16 outputs (``out_f16``) may be off by one more rounding, 2**-11 |value| + 2**-24. With
    ``padding_nan`` every output past out_dim (``y[:, out_dim:]``) must still be NaN (no stray store)."""
    y = np.asarray(y, np.float64)
    what = f"{wtype} {out_dim}x{in_dim} cols={len(y)}{' glu' if glu else ''}{' ' + what if what else ''}"
    if padding_nan:
        assert np.isnan(y[:, out_dim:]).all(), f"{what}: a store past out_dim"
    y = y[:, :out_dim]
    assert np.isfinite(y).all(), f"{what}: unwritten (NaN-poisoned) outputs"
    w = dequant(raw, wtype, 2 * out_dim if glu else out_dim, in_dim).astype(np.float64)
    xs = np.asarray(x, np.float64)[:, :in_dim]
    if glu:
        g, u = xs @ w[:out_dim].T, xs @ w[out_dim:].T
        ref = silu(g) * u
        scale = (np.abs(g) + np.abs(xs) @ np.abs(w[:out_dim]).T) * (np.abs(u) + np.abs(xs) @ np.abs(w[out_dim:]).T)
    else:
        ref, scale = xs @ w.T, np.abs(xs) @ np.abs(w).T
        if bias is not None:
            ref, scale = ref + bias, scale + np.abs(bias)
        if residual is not None:
            res = np.asarray(residual, np.float64)[:, :out_dim]
            ref, scale = ref + res, scale + np.abs(res)
    tol = 1e-6 * scale + (2.0**-11 * np.abs(ref) + 2.0**-24 if out_f16 else 0.0)
    bad = np.abs(y - ref) > tol
    assert not bad.any(), f"{what}: {bad.sum()} wrong, worst {(np.abs(y - ref) / scale).max():.2e} of the scale"


def rope_append_rows_oracle(qkv: np.ndarray, n_q: int, n_kv: int, d: int, pos0: int, inv: np.ndarray, neox: bool,
                            q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None, eps: float = 1e-6):
    """float64 (q [n_q, S, d], k [n_kv, S, d], v [n_kv, S, d]) of ``qkv [S, (n_q + 2 n_kv) d]`` (token s
    at position pos0 + s): the reference model's rms_norm (with q_norm/k_norm) and apply_rope, at the
    f32 angle ``f32(pos) * inv_freq`` the kernels use."""
    s = qkv.shape[0]
    x = qkv.astype(np.float64).reshape(s, n_q + 2 * n_kv, d)
    q, k, v = x[:, :n_q], x[:, n_q:n_q + n_kv], x[:, n_q + n_kv:]
    if q_norm is not None:
        q = rms_norm(q, q_norm.astype(np.float64), eps)
        k = rms_norm(k, k_norm.astype(np.float64), eps)
    pos = (pos0 + np.arange(s)).astype(np.float32)
    ang = (pos[:, None] * inv[None, :].astype(np.float32)).astype(np.float64)
    kind = "neox" if neox else "normal"
    q, k = apply_rope(q, np.cos(ang), np.sin(ang), kind), apply_rope(k, np.cos(ang), np.sin(ang), kind)
    return q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2)
