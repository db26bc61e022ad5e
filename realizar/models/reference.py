"""The NumPy reference model: a llama-family decoder computed in float32 on the CPU.

Weights are dequantized once, at construction, and every step is plain vectorised NumPy (a whole prompt is one set of matrix products). It is the
oracle for the GPU model and the fallback when no GPU is present.

Per layer::

    h = x + W_o · attn(rope(norm_q(W_q · rms(x) + b_q)), rope(norm_k(W_k · rms(x) + b_k)), W_v · rms(x) + b_v)
    x = h + W_down · (silu(W_gate · rms(h)) * (W_up · rms(h)))

(a mixture-of-experts layer: the same SwiGLU per chosen expert, weighted by the router's probabilities),
then a final RMSNorm and the LM head (``token_embd`` when the embeddings are tied).
"""

from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING, Sequence

import numpy as np

from realizar.errors import (
    ContextOverflowError,
    InvalidRequestError,
    ModelFormatError,
    ShapeError,
)
from realizar.models.attention import gqa_attention
from realizar.models.config import ModelConfig
from realizar.models.rope import rope_inv_freq

if TYPE_CHECKING:  # pragma: no cover
    from realizar.models.loaded import LoadedModel
    from realizar.models.tensor import QuantTensor

__all__ = ["KVCache", "ReferenceModel", "apply_rope", "cache_attention", "decoder_layer", "feed_forward",
           "moe_feed_forward", "project_qkv", "rms_norm", "route"]


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: ``x / sqrt(mean(x²) + eps) * weight``."""
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + np.asarray(eps, dtype=x.dtype))).astype(x.dtype) * weight


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), written to avoid overflow warnings of exp(-x) for very negative x.
    return x * (0.5 * (1.0 + np.tanh(0.5 * x))).astype(x.dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rope_type: str) -> np.ndarray:
    """Rotate ``x [S, heads, D]`` by angles whose cos/sin are ``[S, D/2]``.

    ``"neox"`` pairs ``(x[i], x[i + D/2])``; ``"normal"`` pairs ``(x[2i], x[2i + 1])``.
    """
    c = cos[:, None, :]
    s = sin[:, None, :]
    out = np.empty_like(x)
    if rope_type == "neox":
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * c - b * s
        out[..., half:] = b * c + a * s
    elif rope_type == "normal":
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = b * c + a * s
    else:
        raise ModelFormatError(f"unknown rope_type {rope_type!r} (expected 'normal' or 'neox')")
    return out


def project_qkv(L, x: np.ndarray, c: ModelConfig, cos: np.ndarray, sin: np.ndarray):
    """One layer's attention inputs for rows ``x [S, hidden]``: RMSNorm, the QKV projection (+ bias),
    qwen3's per-head q/k norm and RoPE; returns q ``[S, heads, D]`` and k, v ``[S, kv_heads, D]`` (head
    counts from ``c``: a tensor-parallel rank passes its own config)."""
    s, eps = x.shape[0], c.rms_norm_eps
    h = rms_norm(x, L.attn_norm, eps)
    qkv = h @ L.w_qkv.T
    if L.b_qkv is not None:
        qkv += L.b_qkv
    q_end, k_end = c.q_dim, c.q_dim + c.kv_dim
    q = qkv[:, :q_end].reshape(s, c.num_heads, c.head_dim)
    k = qkv[:, q_end:k_end].reshape(s, c.num_kv_heads, c.head_dim)
    v = qkv[:, k_end:].reshape(s, c.num_kv_heads, c.head_dim)
    if L.q_norm is not None:
        q = rms_norm(q, L.q_norm, eps)
    if L.k_norm is not None:
        k = rms_norm(k, L.k_norm, eps)
    return apply_rope(q, cos, sin, c.rope_type), apply_rope(k, cos, sin, c.rope_type), v


def route(logits: np.ndarray, c: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """The experts each row chooses and their weights, from router ``logits [S, experts]``: the softmax, its
    ``num_experts_used`` largest (the lower expert first among equal ones), renormalised to sum to 1 when
    ``expert_weights_norm``. Returns (ids ``[S, k]`` int64, weights ``[S, k]`` float32), largest first."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :c.num_experts_used]
    w = np.take_along_axis(p, ids, axis=-1)
    if c.expert_weights_norm:
        w /= w.sum(axis=-1, keepdims=True)
    return ids, w.astype(np.float32)


def moe_feed_forward(L, h: np.ndarray, c: ModelConfig) -> np.ndarray:
    """A mixture-of-experts FFN over normalised rows ``h``: each row through its chosen experts' SwiGLU FFNs,
    weighted by :func:`route`; every expert runs once over the rows that chose it."""
    ids, w = route(h @ L.router.T, c)
    out = np.zeros_like(h)
    f = c.expert_ffn_size
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        gu = h[rows] @ L.w_gate_up_exps[e].T
        y = (silu(gu[:, :f]) * gu[:, f:]) @ L.w_down_exps[e].T
        out[rows] += w[rows, slot][:, None] * y
    return out


def feed_forward(L, x: np.ndarray, c: ModelConfig) -> np.ndarray:
    """The feed-forward block's output for rows ``x`` (added to them by the caller):
    ``W_down (silu(W_gate rms(x)) * W_up rms(x))``, or a mixture of experts (:func:`moe_feed_forward`)."""
    h = rms_norm(x, L.ffn_norm, c.rms_norm_eps)
    if getattr(L, "router", None) is not None:
        return moe_feed_forward(L, h, c)
    gu = h @ L.w_gate_up.T
    f = c.intermediate_size
    return (silu(gu[:, :f]) * gu[:, f:]) @ L.w_down.T


def decoder_layer(x: np.ndarray, shards, cos: np.ndarray, sin: np.ndarray, reduce=None) -> np.ndarray:
    """THE layer program on the CPU: ``x [S, hidden]`` through one transformer layer.

    ``shards``: ``(L, c, attend)`` per rank (one for an unsplit model): a layer's weights, the config
    of its heads, and ``attend(q, k, v) -> [S, heads * D]``, which writes k, v to that rank's cache and
    attends q over it (causal over a prompt, or per row over each row's sequence). Each rank's partial
    attention and FFN outputs are summed by ``reduce`` (a tensor-parallel all-reduce; one rank: its own
    output) and added to x::

        x = x + reduce(W_o attend(rope(q), rope(k), v))  ;  x = x + reduce(W_down swiglu(x))
    """
    def total(parts: list[np.ndarray]) -> np.ndarray:
        return parts[0] if reduce is None else reduce(parts)

    attn = []
    for L, c, attend in shards:
        q, k, v = project_qkv(L, x, c, cos, sin)
        attn.append(attend(q, k, v) @ L.w_o.T)
    x = x + total(attn)
    return x + total([feed_forward(L, x, c) for L, c, _ in shards])


def cache_attention(cache: "KVCache", li: int, s: int, c: ModelConfig):
    """``attend`` for :func:`decoder_layer`: ``s`` new positions of layer ``li`` written after what
    ``cache`` holds, each query attending causally over the cache (``c``: the heads of this cache)."""

    def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        cache.write(li, k.transpose(1, 0, 2), v.transpose(1, 0, 2))
        kc, vc = cache.view(li, extra=s)
        attn = gqa_attention(q.transpose(1, 0, 2), kc, vc, causal=True)  # [heads, S, d]
        return attn.transpose(1, 0, 2).reshape(s, c.num_heads * c.head_dim)

    return attend


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


def _lazy_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zero-filled array whose pages are committed on first write, 4 KiB at a time.

    ``np.zeros`` of a large array asks for transparent huge pages, so the first write of a few
    positions per head would zero a whole 2 MiB page per head and layer (slow for long contexts);
    an anonymous ``mmap`` is zeroed by the kernel page by page as it is touched.
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < (1 << 20):
        return np.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


class KVCache:
    """Preallocated keys and values: per layer ``[num_kv_heads, max_len, head_dim]``.

    ``length`` counts the positions written so far. :meth:`write` stores a block of positions for one
    layer at ``length``; :meth:`advance` moves ``length`` once every layer has written. The arrays are
    reserved up front but their memory is committed page by page as positions are written, so an
    unused long context costs address space only.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, max_len: int, head_dim: int, dtype=np.float32):
        if max_len <= 0:
            raise ShapeError(f"KV cache max_len must be positive, got {max_len}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.max_len = max_len
        self.head_dim = head_dim
        shape = (num_kv_heads, max_len, head_dim)
        self.k = [_lazy_zeros(shape, dtype) for _ in range(num_layers)]
        self.v = [_lazy_zeros(shape, dtype) for _ in range(num_layers)]
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (keeps the first ``length``)."""
        if not 0 <= length <= self.length:
            raise ShapeError(f"cannot truncate a KV cache of length {self.length} to {length}")
        self.length = length

    @property
    def remaining(self) -> int:
        return self.max_len - self.length

    def check_room(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ContextOverflowError(
                f"{self.length} cached + {n} new tokens = {self.length + n} exceeds the context "
                f"length of {self.max_len}"
            )

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store ``k, v [KVH, S, D]`` at positions ``length .. length + S - 1`` of ``layer``."""
        s = k.shape[1]
        self.check_room(s)
        self.k[layer][:, self.length : self.length + s] = k
        self.v[layer][:, self.length : self.length + s] = v

    def view(self, layer: int, extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of ``layer`` for positions ``0 .. length + extra - 1``."""
        n = self.length + extra
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def advance(self, n: int) -> None:
        self.check_room(n)
        self.length += n


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class _Layer:
    __slots__ = ("attn_norm", "w_qkv", "b_qkv", "q_norm", "k_norm", "w_o", "ffn_norm", "w_gate_up", "w_down", "router",
                 "w_gate_up_exps", "w_down_exps")


class ReferenceModel:
    """Float32 NumPy forward pass of a llama / mistral / qwen2 / qwen3 model.

    ``prefill(token_ids)`` runs a block of tokens (continuing after whatever the cache already holds)
    and returns the logits of the last position, or of every position with ``all_logits=True``;
    ``decode(token_id)`` runs one token. ``reset()`` empties the cache. ``max_len`` caps the KV cache
    (default: the model's context length).

    RoPE frequencies come from :func:`realizar.models.rope.rope_inv_freq` (llama-3
    ``rope_freqs.weight`` factors, ``llama3`` and ``linear`` scaling; other kinds raise
    :class:`UnsupportedError`). A sliding attention window
    (``config.extra["sliding_window"]``) is not applied, so results are exact only up to the window.
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, "QuantTensor"], max_len: int | None = None):
        self.config = config
        c = config
        if c.num_heads % c.num_kv_heads != 0:
            raise ModelFormatError(f"num_heads {c.num_heads} is not a multiple of num_kv_heads {c.num_kv_heads}")
        if c.head_dim % 2 != 0:
            raise ModelFormatError(f"head_dim {c.head_dim} must be even for RoPE")

        def get(name: str, shape: tuple[int, ...], required: bool = True) -> np.ndarray | None:
            t = tensors.get(name)
            if t is None:
                if required:
                    raise ModelFormatError(f"missing tensor {name}")
                return None
            arr = np.asarray(t.dequantize(), dtype=np.float32)
            if arr.shape != shape:
                if arr.size == math.prod(shape) and len(shape) == 1:
                    arr = arr.reshape(shape)
                else:
                    raise ModelFormatError(f"tensor {name} has shape {arr.shape}, expected {shape}")
            return arr

        H, D = c.hidden_size, c.head_dim
        self.embedding = get("token_embd.weight", (c.vocab_size, H))
        self.output_norm = get("output_norm.weight", (H,))
        out = get("output.weight", (c.vocab_size, H), required=False)
        self.lm_head = self.embedding if out is None else out

        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            L = _Layer()
            L.attn_norm = get(p + "attn_norm.weight", (H,))
            wq = get(p + "attn_q.weight", (c.q_dim, H))
            wk = get(p + "attn_k.weight", (c.kv_dim, H))
            wv = get(p + "attn_v.weight", (c.kv_dim, H))
            L.w_qkv = np.ascontiguousarray(np.concatenate([wq, wk, wv], axis=0))
            del wq, wk, wv
            bq = get(p + "attn_q.bias", (c.q_dim,), required=c.qkv_bias)
            bk = get(p + "attn_k.bias", (c.kv_dim,), required=c.qkv_bias)
            bv = get(p + "attn_v.bias", (c.kv_dim,), required=c.qkv_bias)
            if bq is None and bk is None and bv is None:
                L.b_qkv = None
            else:
                L.b_qkv = np.concatenate(
                    [
                        bq if bq is not None else np.zeros(c.q_dim, np.float32),
                        bk if bk is not None else np.zeros(c.kv_dim, np.float32),
                        bv if bv is not None else np.zeros(c.kv_dim, np.float32),
                    ]
                )
            L.q_norm = get(p + "attn_q_norm.weight", (D,), required=c.qk_norm)
            L.k_norm = get(p + "attn_k_norm.weight", (D,), required=c.qk_norm)
            L.w_o = get(p + "attn_output.weight", (H, c.q_dim))
            L.ffn_norm = get(p + "ffn_norm.weight", (H,))
            L.router = None
            if c.is_moe:
                E, Fe = c.num_experts, c.expert_ffn_size
                L.router = get(p + "ffn_gate_inp.weight", (E, H))
                wg = get(p + "ffn_gate_exps.weight", (E, Fe, H))
                wu = get(p + "ffn_up_exps.weight", (E, Fe, H))
                L.w_gate_up_exps = np.ascontiguousarray(np.concatenate([wg, wu], axis=1))
                del wg, wu
                L.w_down_exps = get(p + "ffn_down_exps.weight", (E, H, Fe))
                self.layers.append(L)
                continue
            wg = get(p + "ffn_gate.weight", (c.intermediate_size, H))
            wu = get(p + "ffn_up.weight", (c.intermediate_size, H))
            L.w_gate_up = np.ascontiguousarray(np.concatenate([wg, wu], axis=0))
            del wg, wu
            L.w_down = get(p + "ffn_down.weight", (H, c.intermediate_size))
            self.layers.append(L)

        ff = tensors.get("rope_freqs.weight")
        self.inv_freq = rope_inv_freq(c, None if ff is None else ff.dequantize())
        self.max_len = int(max_len if max_len is not None else c.context_length)
        self.cache = KVCache(c.num_layers, c.num_kv_heads, self.max_len, D)
        self._cos: np.ndarray | None = None
        self._sin: np.ndarray | None = None

    @classmethod
    def from_loaded(cls, loaded: "LoadedModel", max_len: int | None = None) -> "ReferenceModel":
        return cls(loaded.config, loaded.tensors, max_len=max_len)

    # -- the interface the generator uses --------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.max_len

    @property
    def position(self) -> int:
        """Number of tokens in the KV cache."""
        return self.cache.length

    def reset(self) -> None:
        self.cache.reset()

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def prefill(self, token_ids: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Run ``token_ids`` after the cached positions; logits ``[vocab]`` (or ``[S, vocab]``)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise InvalidRequestError("prefill needs at least one token")
        return self._forward(ids, all_logits)

    def decode(self, token_id: int) -> np.ndarray:
        """Run one token; logits ``[vocab]``."""
        return self._forward(np.asarray([int(token_id)], dtype=np.int64), False)

    def hidden_states(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """The final-norm hidden rows ``[S, hidden]`` of ``token_ids`` as a sequence of its own from position 0
        (what the LM head reads: ``hidden_states(ids) @ lm_head.T`` are a fresh prefill's logits), for
        embeddings. The KV cache is neither read nor written: safe beside a generation, or another call."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise InvalidRequestError("hidden_states needs at least one token")
        c, s = self.config, ids.shape[0]
        if s > self.max_len:
            raise ContextOverflowError(f"{s} tokens exceed the context length of {self.max_len}")
        own = KVCache(c.num_layers, c.num_kv_heads, s, self.cache.head_dim)  # (this call's alone)
        return rms_norm(self._stack(ids, own), self.output_norm, c.rms_norm_eps)

    # -- the forward pass --------------------------------------------------------------------------

    def _check_vocab(self, ids: np.ndarray) -> None:
        vocab = self.config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary of {vocab}")

    def _rope_tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._cos is None:  # (sin first: a thread that sees cos set finds sin set too)
            ang = np.arange(self.max_len, dtype=np.float64)[:, None] * self.inv_freq[None, :]
            self._sin = np.sin(ang).astype(np.float32)
            self._cos = np.cos(ang).astype(np.float32)
        return self._cos[positions], self._sin[positions]

    def _stack(self, ids: np.ndarray, cache: "KVCache") -> np.ndarray:
        """The layer stack over ``ids`` after what ``cache`` holds (their K/V written, the cache advanced): the
        hidden rows ``[S, hidden]`` before the final norm."""
        c = self.config
        s = ids.shape[0]
        self._check_vocab(ids)
        cache.check_room(s)
        start = cache.length
        cos, sin = self._rope_tables(np.arange(start, start + s))
        x = self.embedding[ids]  # [S, hidden] (a copy: fancy indexing)
        for li, L in enumerate(self.layers):
            x = decoder_layer(x, [(L, c, cache_attention(cache, li, s, c))], cos, sin)
        cache.advance(s)
        return x

    def _forward(self, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        x = self._stack(ids, self.cache)
        eps = self.config.rms_norm_eps
        if all_logits:
            return rms_norm(x, self.output_norm, eps) @ self.lm_head.T
        return rms_norm(x[-1], self.output_norm, eps) @ self.lm_head.T
