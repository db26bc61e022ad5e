"""A :class:`~realizar.serving.backend.BatchBackend` in NumPy: the reference model's forward pass over
a paged KV pool, many sequences per decode step (the CI backend and the oracle of the GPU one).

The weights are those of a :class:`~realizar.models.reference.ReferenceModel` (dequantized once) and
every step is built from its pieces (:func:`~realizar.models.reference.rms_norm`,
:func:`~realizar.models.reference.apply_rope`, :func:`~realizar.models.attention.gqa_attention`), so a
sequence computes what the reference model computes alone up to the rounding of differently shaped
matrix products: a decode step does its projections for all B rows as one product, and attention
per row over that row's own blocks.

KV pool per layer: ``k, v [num_blocks, num_kv_heads, block_size, head_dim]``: float32 ("f32"), float16
("f16"), or float32 holding the values a "bf16" or "q8_0" cache would read back
(:func:`realizar.models.kv_formats.round_kv`, the GPU pools' rounding), so the CPU shows what each
format does to a model's logits; attention reads them as float32.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError, UnsupportedError
from realizar.models.attention import gqa_attention
from realizar.models.kv_formats import QK, block_bytes, round_kv
from realizar.models.reference import ReferenceModel, decoder_layer, rms_norm
from realizar.serving.backend import HostBatchOutput
from realizar.config import ServingConfig

__all__ = ["ReferenceBatchBackend", "KV_DTYPES"]

_DEFAULTS = ServingConfig()

# kv_dtype -> the NumPy array type of the pool (bf16 and q8_0: float32 holding the rounded values)
KV_DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": np.float32, "q8_0": np.float32}


class ReferenceBatchBackend:
    """Batched NumPy forward over a paged KV pool of ``num_blocks`` blocks of ``block_size``.

    ``model`` is a :class:`ReferenceModel` or a loaded model (``realizar.models.loader.load_model``);
    ``context_length`` defaults to the model's. ``max_batch`` caps the rows of one decode call."""

    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int = _DEFAULTS.block_size,
        kv_dtype: str = "f32",
        max_batch: int = _DEFAULTS.max_batch,
        context_length: int | None = None,
    ):
        if not isinstance(model, ReferenceModel):
            model = ReferenceModel.from_loaded(model, max_len=context_length)
        if kv_dtype not in KV_DTYPES:
            raise UnsupportedError(f"the NumPy backend stores KV as one of {tuple(KV_DTYPES)}, got {kv_dtype!r}")
        if kv_dtype == "q8_0" and model.config.head_dim % QK:
            raise ShapeError(f"a q8_0 KV cache stores groups of {QK} values of a head row; head_dim is "
                             f"{model.config.head_dim}")
        if int(num_blocks) != num_blocks or num_blocks < 2:
            raise ShapeError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if int(block_size) != block_size or block_size < 1:
            raise ShapeError(f"block_size must be a positive integer, got {block_size}")
        if int(max_batch) != max_batch or max_batch < 1:
            raise ShapeError(f"max_batch must be a positive integer, got {max_batch}")
        self.model = model
        self.config = model.config
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.max_batch = int(max_batch)
        self.feeds_tokens = True
        self._fed: np.ndarray | None = None  # the last decode call's sampled tokens (for fed() entries)
        self.kv_dtype = kv_dtype
        self.context_length = int(context_length if context_length is not None else model.context_length)
        c = self.config
        shape = (self.num_blocks, c.num_kv_heads, self.block_size, c.head_dim)
        dt = KV_DTYPES[kv_dtype]
        self.k = [np.zeros(shape, dt) for _ in range(c.num_layers)]
        self.v = [np.zeros(shape, dt) for _ in range(c.num_layers)]
        ang = np.arange(self.context_length, dtype=np.float64)[:, None] * model.inv_freq[None, :]
        self._cos = np.cos(ang).astype(np.float32)  # the reference model's tables, row for row
        self._sin = np.sin(ang).astype(np.float32)

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over all layers, K and V, in the format's own size (as a GPU pool)."""
        return block_bytes(self.config, self.block_size, self.kv_dtype)

    def _store(self, pool: np.ndarray, blk, row, x: np.ndarray) -> None:
        """Write K or V rows ``x [n, KVH, D]`` at (block, row) pairs, rounded as ``kv_dtype`` stores them."""
        pool[blk, :, row] = x if self.kv_dtype in ("f32", "f16") else round_kv(x, self.kv_dtype)

    # -- checks ------------------------------------------------------------------------------------

    def _check_tokens(self, ids: np.ndarray) -> None:
        vocab = self.config.vocab_size
        bad = (ids < 0) | (ids >= vocab)
        if bad.any():
            raise InvalidRequestError(f"token id {int(ids[bad][0])} is outside the vocabulary of {vocab}")

    def _table(self, table: Sequence[int], length: int) -> np.ndarray:
        """The block ids holding positions ``0 .. length - 1`` (checked)."""
        need = -(-length // self.block_size)
        t = np.asarray(table, dtype=np.int64).reshape(-1)
        if t.shape[0] < need:
            raise ShapeError(f"{length} positions need {need} blocks, the block table has {t.shape[0]}")
        t = t[:need]
        if need and (t.min() < 1 or t.max() >= self.num_blocks):
            raise InvalidRequestError(f"block table {t.tolist()} names blocks outside 1..{self.num_blocks - 1}")
        return t

    def _gather(self, layer: int, table: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V ``[KVH, length, D]`` (float32) of a sequence's first ``length`` positions."""
        c = self.config

        def one(pool: np.ndarray) -> np.ndarray:
            x = pool[table]  # [nb, KVH, bs, D]
            x = x.transpose(1, 0, 2, 3).reshape(c.num_kv_heads, -1, c.head_dim)[:, :length]
            return x.astype(np.float32, copy=False)

        return one(self.k[layer]), one(self.v[layer])

    # -- the forward pass ----------------------------------------------------------------------------

    def _logits(self, x: np.ndarray) -> np.ndarray:
        m = self.model
        return rms_norm(x, m.output_norm, self.config.rms_norm_eps) @ m.lm_head.T

    def prefill(self, tokens: Sequence[int], start: int, block_table: Sequence[int]) -> HostBatchOutput:
        x = self._forward(tokens, start, block_table)
        self._fed = None
        return HostBatchOutput(self._logits(x[-1:]))

    def hidden_rows(self, tokens: Sequence[int], block_table: Sequence[int]) -> np.ndarray:
        """The final-norm hidden rows ``[len(tokens), hidden]`` of a sequence prefilled from position 0 through
        ``block_table`` (embeddings; the last decode step's sampled tokens stay for its fed rows)."""
        return rms_norm(self._forward(tokens, 0, block_table), self.model.output_norm, self.config.rms_norm_eps)

    def _forward(self, tokens: Sequence[int], start: int, block_table: Sequence[int]) -> np.ndarray:
        """The residual rows of positions ``start ..`` after every layer, K/V written through ``block_table``."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        s = ids.shape[0]
        if s == 0:
            raise InvalidRequestError("prefill needs at least one token")
        if start < 0:
            raise InvalidRequestError(f"prefill start must be >= 0, got {start}")
        end = start + s
        if end > self.context_length:
            raise ContextOverflowError(f"positions up to {end} exceed the context length of {self.context_length}")
        self._check_tokens(ids)
        table = self._table(block_table, end)
        pos = np.arange(start, end)
        blk, row = table[pos // self.block_size], pos % self.block_size
        cos, sin = self._cos[pos], self._sin[pos]
        c = self.config

        def attend(li: int):
            def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
                self._store(self.k[li], blk, row, k)
                self._store(self.v[li], blk, row, v)
                kc, vc = self._gather(li, table, end)
                attn = gqa_attention(q.transpose(1, 0, 2), kc, vc, causal=True)  # [nh, S, d], q_offset = start
                return attn.transpose(1, 0, 2).reshape(s, c.num_heads * c.head_dim)
            return run

        x = self.model.embedding[ids]
        for li, L in enumerate(self.model.layers):
            x = decoder_layer(x, [(L, c, attend(li))], cos, sin)
        return x

    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], block_tables: Sequence[Sequence[int]]
    ) -> HostBatchOutput:
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        b = ids.shape[0]
        if ids.size and ids.min() < 0:  # fed(r): the previous decode call's token of row r
            prev, self._fed = self._fed, None
            if prev is None or ids.min() < -len(prev):
                raise InvalidRequestError(f"token {ids.min()}: a fed token needs the previous call to be a sampled "
                                          f"decode step with that row ({0 if prev is None else len(prev)} rows)")
            ids = np.where(ids < 0, prev[np.maximum(-1 - ids, 0) % max(1, len(prev))], ids)
        if b == 0 or b > self.max_batch:
            raise ShapeError(f"a decode step takes 1..{self.max_batch} rows, got {b}")
        if pos.shape[0] != b or len(block_tables) != b:
            raise ShapeError(
                f"{b} tokens need {b} positions and block tables, got {pos.shape[0]} and {len(block_tables)}"
            )
        if pos.min() < 0 or pos.max() >= self.context_length:
            raise ContextOverflowError(f"positions {pos.tolist()} must lie in 0..{self.context_length - 1}")
        self._check_tokens(ids)
        tables = [self._table(t, int(p) + 1) for t, p in zip(block_tables, pos)]
        blk = np.array([t[p // self.block_size] for t, p in zip(tables, pos)], dtype=np.int64)
        row = pos % self.block_size
        cos, sin = self._cos[pos], self._sin[pos]
        c = self.config

        def attend(li: int):
            def run(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:  # rows: per-row positions
                self._store(self.k[li], blk, row, k)
                self._store(self.v[li], blk, row, v)
                attn = np.empty((b, c.num_heads * c.head_dim), np.float32)
                for i in range(b):
                    kc, vc = self._gather(li, tables[i], int(pos[i]) + 1)
                    attn[i] = gqa_attention(q[i][:, None, :], kc, vc, causal=False).reshape(-1)
                return attn
            return run

        x = self.model.embedding[ids]  # [B, hidden]
        for li, L in enumerate(self.model.layers):
            x = decoder_layer(x, [(L, c, attend(li))], cos, sin)
        self._fed = None
        return HostBatchOutput(self._logits(x), on_sample=self._sampled)

    def _sampled(self, tokens: np.ndarray) -> None:
        self._fed = tokens
