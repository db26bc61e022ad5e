"""The Attention seam of the layer program (:mod:`realizar.gpu.decoder`), over the paged KV cache.

Two kinds, each with ``append(layer, qkv, weights)`` ((q/k norm,) RoPE, K/V into the cache; returns
where the rotated Q is) and ``attend(layer, q, out, out_f16)``:

* :class:`DecodeRows`: the rows of a decode step, row r one token of its own sequence at its own
  position, read through its own block table; positions, lengths and tables are device u32 buffers, so
  the launches are the same every step (graph-capturable). Q is rotated in place in the qkv rows.
* :class:`PrefillChunk`: ``rows`` tokens of one sequence at positions ``pos0 ..`` through one block
  table; Q goes to a head-major buffer and attention (causal, over every cached position before it
  too) runs on tensor cores, its output token-major f16.
"""

from __future__ import annotations

from typing import Any

from realizar.errors import ShapeError

__all__ = ["DecodeRows", "PrefillChunk"]


class DecodeRows:
    """Attention of ``rows`` decode rows over ``kv`` (a :class:`~realizar.gpu.paged_kv.PagedKVCache`).
    ``positions``, ``lengths``: device u32 ``[rows]``; ``tables``: device u32 ``[rows, table_stride]``."""

    def __init__(self, kv, config, inv_freq, positions, lengths, tables, table_stride: int, rows: int):
        self.kv, self.config, self.inv_freq = kv, config, inv_freq
        self.positions, self.lengths, self.tables = positions, lengths, tables
        self.table_stride, self.rows = table_stride, rows
        self.qkv_n = config.q_dim + 2 * config.kv_dim
        self.neox = config.rope_type == "neox"

    def append(self, layer: int, qkv, weights, *, stream: Any = None):
        self.kv.append_decode(layer, qkv, self.inv_freq, self.positions, self.tables, self.table_stride, self.rows,
                              q_norm=weights.q_norm, k_norm=weights.k_norm, eps=self.config.rms_norm_eps,
                              neox=self.neox, stream=stream)
        return qkv

    def attend(self, layer: int, q, out, *, out_f16: bool, stream: Any = None) -> None:
        self.kv.decode_attention(layer, q, out, self.lengths, self.tables, self.table_stride, self.rows,
                                 out_f16=out_f16, q_stride=self.qkv_n, stream=stream)


class PrefillChunk:
    """Attention of a prefill chunk: ``rows`` tokens at positions ``pos0 ..`` of the sequence whose
    block table is ``table`` (device u32); ``q``: f32 ``[heads, rows, head_dim]`` scratch."""

    def __init__(self, kv, config, inv_freq, table, pos0: int, rows: int, q):
        self.kv, self.config, self.inv_freq, self.table = kv, config, inv_freq, table
        self.pos0, self.rows, self.q = pos0, rows, q
        self.neox = config.rope_type == "neox"

    def append(self, layer: int, qkv, weights, *, stream: Any = None):
        self.kv.append_rows(layer, qkv, self.inv_freq, self.pos0, self.rows, self.q, self.table, neox=self.neox,
                            q_norm=weights.q_norm, k_norm=weights.k_norm, eps=self.config.rms_norm_eps, stream=stream)
        return self.q

    def attend(self, layer: int, q, out, *, out_f16: bool, stream: Any = None) -> None:
        if not out_f16:
            raise ShapeError("the prefill attention writes f16 (the Linear's input above one row)")
        self.kv.prefill_attention(layer, q, out, self.rows, self.pos0, self.pos0 + self.rows, self.table,
                                  stream=stream)
