"""Reference (CPU, NumPy) attention with grouped-query heads.

These functions are the oracle for the GPU attention kernels, so their signatures are kept stable:

* :func:`attention_with_cache_gqa` — one decode step: a single query per head over the past positions
  in a KV cache plus the current position's key/value.
* :func:`multi_head_attention` — prefill: a block of queries over a block of keys/values, optionally
  causal.

Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Scores are scaled by
``1 / sqrt(head_dim)`` and the softmax subtracts the row maximum before exponentiating. The arithmetic is
done in the dtype of the inputs (promoted to at least float32), so a caller that passes float64 arrays
gets a float64 oracle.
"""

from __future__ import annotations

import numpy as np

from realizar.errors import ShapeError

__all__ = ["attention_with_cache_gqa", "multi_head_attention", "gqa_attention"]


def _compute_dtype(*arrays: np.ndarray) -> np.dtype:
    dtype = np.result_type(*arrays, np.float32)
    if not np.issubdtype(dtype, np.floating):
        raise ShapeError(f"attention needs floating-point inputs, got {dtype}")
    return dtype


def _check_heads(num_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads != 0:
        raise ShapeError(
            f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads


def gqa_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True, q_offset: int | None = None
) -> np.ndarray:
    """Attention of ``q [H, Sq, D]`` over ``k, v [KVH, Sk, D]``; returns ``[H, Sq, D]``.

    With ``causal``, query ``i`` sits at absolute position ``q_offset + i`` and sees keys ``0 ..
    q_offset + i``. ``q_offset`` defaults to ``Sk - Sq`` — the queries are the last ``Sq`` positions
    of the sequence, as when a KV cache already holds earlier tokens.
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ShapeError(f"expected 3-D q, k, v; got {q.shape}, {k.shape}, {v.shape}")
    num_heads, s_q, head_dim = q.shape
    num_kv_heads, s_k, _ = k.shape
    if k.shape != v.shape or k.shape[2] != head_dim:
        raise ShapeError(f"k {k.shape} and v {v.shape} must be [KVH, Sk, {head_dim}]")
    group = _check_heads(num_heads, num_kv_heads)
    if s_k == 0:
        raise ShapeError("attention over zero keys")
    if q_offset is None:
        q_offset = s_k - s_q
    if causal and (q_offset < 0 or q_offset + s_q > s_k):
        raise ShapeError(f"causal queries at positions {q_offset}..{q_offset + s_q - 1} need {s_k} keys")

    dtype = _compute_dtype(q, k, v)
    qg = np.asarray(q, dtype=dtype).reshape(num_kv_heads, group * s_q, head_dim)
    kk = np.asarray(k, dtype=dtype)
    vv = np.asarray(v, dtype=dtype)
    scale = dtype.type(1.0 / np.sqrt(head_dim))

    # [KVH, group*Sq, Sk]: one batched matmul per KV head.
    scores = np.matmul(qg, kk.transpose(0, 2, 1))
    scores *= scale
    if causal:
        q_pos = q_offset + np.arange(s_q)
        mask = np.arange(s_k)[None, :] > q_pos[:, None]  # [Sq, Sk], True = hidden
        if mask.any():
            scores = scores.reshape(num_kv_heads, group, s_q, s_k)
            scores[:, :, mask] = -np.inf
            scores = scores.reshape(num_kv_heads, group * s_q, s_k)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, vv)  # [KVH, group*Sq, D]
    return out.reshape(num_heads, s_q, head_dim)


def multi_head_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = True) -> np.ndarray:
    """Prefill attention: ``q [H, S, D]``, ``k, v [KVH, S, D]`` → ``[H, S, D]``.

    ``k``/``v`` may hold more positions than ``q`` (earlier tokens of the sequence); the queries are then
    the last positions, bottom-right aligned for the causal mask.
    """
    if q.ndim == 3 and k.ndim == 3 and k.shape[1] < q.shape[1]:
        raise ShapeError(f"k has {k.shape[1]} positions, fewer than the {q.shape[1]} queries")
    return gqa_attention(q, k, v, causal=causal)


def attention_with_cache_gqa(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    current_k: np.ndarray,
    current_v: np.ndarray,
) -> np.ndarray:
    """One decode step: ``q [H, D]`` over the cached ``[KVH, L, D]`` plus the current ``[KVH, D]``.

    The current key/value are appended as position ``L`` (the query's own position), so ``L`` may be 0.
    Returns ``[H, D]`` in the compute dtype.
    """
    if q.ndim != 2 or current_k.ndim != 2 or current_v.ndim != 2:
        raise ShapeError(
            f"expected q [H, D] and current k/v [KVH, D]; got {q.shape}, {current_k.shape}, {current_v.shape}"
        )
    if k_cache.ndim != 3 or v_cache.shape != k_cache.shape:
        raise ShapeError(f"caches must both be [KVH, L, D]; got {k_cache.shape}, {v_cache.shape}")
    num_kv_heads, _, head_dim = k_cache.shape
    if current_k.shape != (num_kv_heads, head_dim) or current_v.shape != (num_kv_heads, head_dim):
        raise ShapeError(
            f"current k/v must be [{num_kv_heads}, {head_dim}]; got {current_k.shape}, {current_v.shape}"
        )
    if q.shape[1] != head_dim:
        raise ShapeError(f"q head_dim {q.shape[1]} != cache head_dim {head_dim}")
    dtype = _compute_dtype(q, k_cache, v_cache, current_k, current_v)
    k = np.concatenate([np.asarray(k_cache, dtype=dtype), np.asarray(current_k, dtype=dtype)[:, None, :]], axis=1)
    v = np.concatenate([np.asarray(v_cache, dtype=dtype), np.asarray(current_v, dtype=dtype)[:, None, :]], axis=1)
    out = gqa_attention(np.asarray(q, dtype=dtype)[:, None, :], k, v, causal=False)
    return out[:, 0, :]
