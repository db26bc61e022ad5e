"""Prefill: a chunk of S prompt tokens of one sequence through every layer at once.

The chunk runs the layer program (:mod:`realizar.gpu.decoder`) over S rows: the Linear at S rows (the
f16 GEMMs of the batched kernels), the attention seam a :class:`~realizar.gpu.attention.PrefillChunk`
(K/V appended through the sequence's block table, causal tensor-core attention over every cached
position). After the last chunk the final norm, the LM head GEMV and the on-device argmax run on the
last row only, into the row-0 logits and token a decode step uses, so decoding continues from the cache
as after any step.

Rounding, stated: activations enter the GEMMs as f16 (11-bit significands) and weights are rounded
to f16 when expanded; products accumulate in f32. The token-by-token path keeps x in f32 and
weights exact, so logits differ at the level of f16 rounding (relative ~1e-3), not more.
"""

from __future__ import annotations

import numpy as np

from realizar.cuda import GraphCache
from realizar.errors import ShapeError
from realizar.gpu.attention import PrefillChunk
from realizar.gpu.decoder import Activations

__all__ = ["GRAPH_ROWS", "MAX_GRAPHS", "Prefill"]

GRAPH_ROWS = 64  # with graphs, chunk rows are padded to a multiple of this so lengths share a graph
MAX_GRAPHS = 16  # chunk graphs kept (least recently used dropped)


class Prefill:
    """Chunks of up to ``chunk`` tokens of one sequence through the program of ``backend`` (a
    :class:`~realizar.gpu.batch.GpuBatchBackend`: its weights, Linear, cache, stream and outputs), the
    sequence's block table in ``backend.prefill_table``."""

    def __init__(self, backend, chunk: int):
        cfg, ops = backend.config, backend.ops
        self.backend = backend
        self.chunk = c = int(chunk)
        if c < 1:
            raise ShapeError(f"prefill chunk must be a positive number of tokens, got {chunk}")
        self.ids = ops.buffer(c, np.uint32)
        self.acts = Activations.allocate(ops, cfg, c, one_row=True, many_rows=True,
                                         split_ffn=backend.weights.split_ffn, logit_rows=0)
        self.q = ops.buffer(c * cfg.q_dim)
        self.hidden = None  # f32 [chunk, hidden]: final-norm rows for embeddings (allocated at first use)
        self.graphs = GraphCache(backend.stream, mode=backend.graph_mode, capture_on="repeat", capacity=MAX_GRAPHS)

    def free(self) -> None:
        self.graphs.close()
        if self.hidden is not None:
            self.hidden.free()
        self.acts.free()
        self.ids.free()
        self.q.free()

    def run_chunk(self, ids, pos0: int, last: bool) -> None:
        """Prefill ``ids`` (at most ``chunk``) at positions ``pos0 ..``; with ``last``, the logits and
        greedy token of the final position.

        With graphs on, the chunk runs ``rows`` = ``len(ids)`` rounded up to :data:`GRAPH_ROWS` (the
        extra rows take token 0; they only write cache positions past the chunk, which nothing reads
        before a later append overwrites them, or the null block, and the causal mask keeps them out
        of the real rows). A (rows, pos0) seen again replays the graph captured at its second run."""
        b = self.backend
        s, n = b.stream, len(ids)
        rows = n if self.graphs.mode == "eager" else min(-(-n // GRAPH_ROWS) * GRAPH_ROWS, self.chunk,
                                                         b.context_length - pos0)
        if b.linear.reserve(b.weights.layer_linears, rows):
            b.clear_graphs()  # graphs read the old expansion scratch
        s.synchronize()  # the previous chunk's embedding has read the ids buffer
        padded = np.zeros(rows, np.uint32)
        padded[:n] = ids
        self.ids.copy_from_host_at(padded, 0)
        attention = PrefillChunk(b.kv, b.config, b.weights.inv_freq, b.prefill_table, pos0, rows, self.q)
        self.graphs.run((rows, pos0), lambda: b.decoder.issue(self.acts, self.ids, rows, b.linear, attention, s))
        if last:
            self._last_row(n)

    def final_rows(self, n: int) -> np.ndarray:
        """The final RMSNorm of the last chunk's first ``n`` rows, f32 ``[n, hidden]`` on the host."""
        b, cfg = self.backend, self.backend.config
        if self.hidden is None:
            self.hidden = b.ops.buffer(self.chunk * cfg.hidden_size)
        b.ops.rmsnorm(self.acts.x, b.weights.output_norm, self.hidden, cfg.rms_norm_eps, rows=n, stream=b.stream)
        b.stream.synchronize()
        return self.hidden.copy_to_host_at(0, n * cfg.hidden_size).reshape(n, cfg.hidden_size)

    def _last_row(self, n: int) -> None:
        """Final norm, LM head and argmax of row ``n - 1`` into the backend's row-0 logits and token."""
        b = self.backend
        b.decoder.head(self.acts, 1, b.linear, b.stream, first=n - 1, logits=b.acts.logits)
        b.ops.argmax(b.acts.logits, b.tokens, n=b.config.vocab_size, stream=b.stream, scratch=b.argmax_scratch)
