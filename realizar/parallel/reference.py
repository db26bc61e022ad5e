"""The sharded NumPy forward: ``N`` ranks, each holding its slice of the weights (cut from the raw GGUF
bytes by a :class:`~realizar.parallel.sharding.ShardingPlan`) and its KV heads, computing its part
with the building blocks of :mod:`realizar.models.reference`; the collectives are simulated.

Per layer, on every rank ``r`` (``x`` is the same on all ranks, as after a real all-reduce)::

    q_r, k_r, v_r = split(W_qkv[r] · rms(x) + b_qkv[r])       # its nh/N query and nkv/N KV heads
    cache_r <- rope(k_r), v_r                                   # its KV heads only
    x += all_reduce_r(W_o[:, cols r] · attn_r)                  # partial sums, summed over ranks
    x += all_reduce_r(W_down[:, cols r] · (silu(W_gate[r] · rms(x)) * (W_up[r] · rms(x))))

and the logits are the final RMSNorm then each rank's vocabulary rows of the LM head, put together by
an all-gather (:func:`all_gather`) or reduced to the greedy token by :func:`distributed_argmax`
without moving the logits. This is the oracle of the multi-GPU model: it must equal
:class:`~realizar.models.reference.ReferenceModel` up to the float32 rounding of the summation order.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from realizar.errors import InvalidRequestError, ShapeError
from realizar.models.config import ModelConfig
from realizar.models.names import OUTPUT, OUTPUT_NORM, TOKEN_EMBD
from realizar.models.reference import KVCache, cache_attention, decoder_layer, rms_norm
from realizar.models.rope import rope_inv_freq
from realizar.models.tensor import QuantTensor
from realizar.parallel.sharding import ShardingPlan, make_plan

__all__ = ["ShardedReferenceModel", "all_reduce", "all_gather", "distributed_argmax"]


# ----------------------------------------------------------------------------------------------
# Simulated collectives
# ----------------------------------------------------------------------------------------------


def all_reduce(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Sum over ranks (NCCL's ``ncclSum``), in float32, rank 0 first: every rank gets this array."""
    if not parts:
        raise ShapeError("an all-reduce needs at least one rank")
    out = np.array(parts[0], dtype=np.float32, copy=True)
    for p in parts[1:]:
        if p.shape != out.shape:
            raise ShapeError(f"all-reduce of parts shaped {out.shape} and {p.shape}")
        out += p
    return out


def all_gather(parts: Sequence[np.ndarray], per_rank: int, total: int) -> np.ndarray:
    """Concatenate each rank's rows along the last axis as NCCL's all-gather does: every piece is
    padded to ``per_rank`` (NCCL moves equal counts), then the padding past ``total`` is dropped."""
    padded = []
    for r, p in enumerate(parts):
        width = p.shape[-1]
        if width > per_rank:
            raise ShapeError(f"rank {r} contributes {width} values to an all-gather of {per_rank} per rank")
        pad = np.zeros((*p.shape[:-1], per_rank - width), dtype=p.dtype)
        padded.append(np.concatenate([p, pad], axis=-1))
    out = np.concatenate(padded, axis=-1)
    if out.shape[-1] < total:
        raise ShapeError(f"the all-gather holds {out.shape[-1]} values, fewer than {total}")
    return out[..., :total]


def distributed_argmax(parts: Sequence[np.ndarray], bounds: Sequence[tuple[int, int]]) -> int:
    """The greedy token from each rank's logits ``[rows r]`` without gathering them: each rank finds
    its (max value, global index); the pairs (8 bytes per rank) are compared, the largest value
    winning and the lowest index breaking ties — exactly ``np.argmax`` of the concatenated logits."""
    if len(parts) != len(bounds):
        raise ShapeError(f"{len(parts)} logit pieces for {len(bounds)} vocabulary ranges")
    best_val, best_idx = -np.inf, -1
    for p, (start, stop) in zip(parts, bounds):
        if p.ndim != 1 or p.shape[0] != stop - start:
            raise ShapeError(f"a logit piece of shape {p.shape} for the vocabulary rows [{start}, {stop})")
        i = int(np.argmax(p))
        v = float(p[i])
        # Ranks are visited in vocabulary order, so a later equal value has a higher index: keep the first.
        if v > best_val or best_idx < 0:
            best_val, best_idx = v, start + i
    return best_idx


# ----------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------


class _RankLayer:
    __slots__ = ("attn_norm", "w_qkv", "b_qkv", "q_norm", "k_norm", "w_o", "ffn_norm", "w_gate_up", "w_down")


class _Rank:
    """One rank's dequantized weights (its slices; replicated tensors shared between ranks) and KV cache."""

    def __init__(self, config: ModelConfig, plan: ShardingPlan, rank: int, tensors: Mapping[str, QuantTensor],
                 dense: dict[int, np.ndarray], max_len: int):
        rc = plan.rank_config(rank)
        self.config = rc
        shards = plan.shard(tensors, rank)

        def get(name: str) -> np.ndarray | None:
            t = shards.get(name)
            if t is None:
                return None
            if plan.tensors[name].split == "replicate":  # the same object on every rank: dequantize once
                if id(t) not in dense:
                    dense[id(t)] = np.asarray(t.dequantize(), dtype=np.float32)
                return dense[id(t)]
            return np.asarray(t.dequantize(), dtype=np.float32)

        self.embedding = get(TOKEN_EMBD)
        self.output_norm = get(OUTPUT_NORM).reshape(-1)
        self.lm_head = get(OUTPUT)  # [rows of this rank's vocabulary, hidden]
        self.vocab = plan.vocab[rank]
        self.layers: list[_RankLayer] = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            L = _RankLayer()
            L.attn_norm = get(p + "attn_norm.weight").reshape(-1)
            L.w_qkv = np.concatenate([get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")])
            biases = [get(p + f"attn_{x}.bias") for x in "qkv"]
            if all(b is None for b in biases):
                L.b_qkv = None
            else:
                sizes = (rc.q_dim, rc.kv_dim, rc.kv_dim)
                L.b_qkv = np.concatenate([np.zeros(n, np.float32) if b is None else b.reshape(-1)
                                          for b, n in zip(biases, sizes)])
            qn, kn = get(p + "attn_q_norm.weight"), get(p + "attn_k_norm.weight")
            L.q_norm = None if qn is None else qn.reshape(-1)
            L.k_norm = None if kn is None else kn.reshape(-1)
            L.w_o = get(p + "attn_output.weight")  # [hidden, this rank's q columns]
            L.ffn_norm = get(p + "ffn_norm.weight").reshape(-1)
            L.w_gate_up = np.concatenate([get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")])
            L.w_down = get(p + "ffn_down.weight")  # [hidden, this rank's FFN columns]
            self.layers.append(L)
        self.cache = KVCache(config.num_layers, rc.num_kv_heads, max_len, rc.head_dim)

    def shard(self, li: int, s: int) -> tuple:
        """Layer ``li`` of this rank for :func:`decoder_layer`: its weights, its heads' config and the
        attention of ``s`` new positions over its cache (its KV heads only)."""
        return self.layers[li], self.config, cache_attention(self.cache, li, s, self.config)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Logits of this rank's vocabulary rows for the final hidden states ``x``."""
        return rms_norm(x, self.output_norm, self.config.rms_norm_eps) @ self.lm_head.T


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class ShardedReferenceModel:
    """``world_size`` simulated ranks running a model sharded by :func:`make_plan`; the same interface
    as :class:`~realizar.models.reference.ReferenceModel` (``prefill``, ``decode``, ``reset``,
    ``position``), returning all-gathered logits. ``last_pieces`` holds each rank's logit rows of the
    last call (what :func:`distributed_argmax` reduces); :meth:`greedy_token` is that argmax."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, QuantTensor], world_size: int,
                 max_len: int | None = None):
        self.config = config
        self.plan = make_plan(config, tensors, world_size)
        self.world_size = world_size
        self.max_len = int(max_len if max_len is not None else config.context_length)
        dense: dict[int, np.ndarray] = {}
        self.ranks = [_Rank(config, self.plan, r, tensors, dense, self.max_len) for r in range(world_size)]
        ff = tensors.get("rope_freqs.weight")
        inv_freq = rope_inv_freq(config, None if ff is None else ff.dequantize())
        ang = np.arange(self.max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
        self._cos, self._sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        self.last_pieces: list[np.ndarray] = []

    @classmethod
    def from_loaded(cls, loaded, world_size: int, max_len: int | None = None) -> "ShardedReferenceModel":
        return cls(loaded.config, loaded.tensors, world_size, max_len=max_len)

    @property
    def position(self) -> int:
        return self.ranks[0].cache.length

    @property
    def context_length(self) -> int:
        return self.max_len

    def reset(self) -> None:
        for r in self.ranks:
            r.cache.reset()

    def prefill(self, token_ids: Sequence[int] | np.ndarray, all_logits: bool = False) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise InvalidRequestError("prefill needs at least one token")
        return self._forward(ids, all_logits)

    def decode(self, token_id: int) -> np.ndarray:
        return self._forward(np.asarray([int(token_id)], dtype=np.int64), False)

    def greedy_token(self) -> int:
        """The argmax of the last position's logits, reduced across ranks without gathering them."""
        return distributed_argmax([p[-1] if p.ndim == 2 else p for p in self.last_pieces], self.plan.vocab)

    def _forward(self, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        c = self.config
        s = ids.shape[0]
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= c.vocab_size)][0])
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary of {c.vocab_size}")
        for r in self.ranks:
            r.cache.check_room(s)
        start = self.position
        cos, sin = self._cos[start : start + s], self._sin[start : start + s]

        x = self.ranks[0].embedding[ids]  # every rank looks up the same rows of its whole embedding
        for li in range(c.num_layers):
            x = decoder_layer(x, [r.shard(li, s) for r in self.ranks], cos, sin, reduce=all_reduce)
        for r in self.ranks:
            r.cache.advance(s)

        # The last position as a vector (not a 1-row matrix), as ReferenceModel computes it.
        pieces = [r.logits(x if all_logits else x[-1]) for r in self.ranks]
        self.last_pieces = pieces
        return all_gather(pieces, self.plan.vocab_per_rank, c.vocab_size)
