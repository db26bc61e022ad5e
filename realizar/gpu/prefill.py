"""Batched prefill: a chunk of S prompt tokens through every layer at once, on tensor cores.

Per layer, for the chunk's rows (x: the f32 residual stream ``[S, hidden]``):

1. RMSNorm of every row, written as f16 (the GEMM's A operand);
2. each weight is expanded into f16 rows (``dequant_f16``) in one scratch buffer reused by every GEMM
   (one weight at a time: the quantized copy the decode GEMV reads stays the only copy of the model),
   then ``gemm_f16`` (f16 ``mma.sync``, f32 accumulation) computes QKV (+ bias);
3. RoPE (after qwen3's per-head q/k norm) for positions ``pos0 .. pos0 + S - 1``, K and V appended to
   the cache, Q laid out per head; causal flash attention over the cache (any tokens already cached
   included), written token-major as f16;
4. the O projection adds into x (residual epilogue), RMSNorm, the gate/up GEMM applies SwiGLU in its
   epilogue (gate and up rows interleaved by the expansion) and writes f16, the down GEMM adds into x.

After the last chunk the final norm, the LM head GEMV and the on-device argmax run on the last row
only, into the same buffers a decode step uses, so the model's logits and greedy token are those of
the prompt's last position and decoding continues from the cache as after any step.

Rounding, stated: activations enter the GEMMs as f16 (11-bit significands) and weights are rounded
to f16 when expanded; products accumulate in f32. The token-by-token path keeps x in f32 and
weights exact, so logits differ at the level of f16 rounding (relative ~1e-3), not more.
"""

from __future__ import annotations

import numpy as np

from realizar import cuda
from realizar.errors import ShapeError

__all__ = ["BatchedPrefill", "PREFILL_CHUNK", "PREFILL_MIN_BATCH", "batched_prefill_unsupported"]

PREFILL_CHUNK = 2048  # tokens per chunk: bounded scratch whatever the prompt length
# Shorter prompts go token by token through the decode graph: below this, expanding every weight to f16
# costs more than the decode steps it saves.
PREFILL_MIN_BATCH = 16
GRAPH_ROWS = 64  # with graphs, chunk rows are padded to a multiple of this so lengths share a graph
MAX_GRAPHS = 16  # chunk graphs kept (least recently used dropped)


def batched_prefill_unsupported(model) -> str | None:
    """Why ``model`` cannot take the batched path (None: it can)."""
    dev, cfg = model.device, model.config
    if dev.target.compute_capability < (8, 0):
        return f"the tensor-core GEMM needs sm_80 or newer, this device is {dev.target}"
    if cfg.hidden_size % 8 or cfg.intermediate_size % 8 or cfg.q_dim % 8:
        return "the f16 GEMM needs hidden, FFN and attention widths that are multiples of 8"
    if any(lay.gate_up is None for lay in model.layers):
        return "gate and up weights of different types (the fused SwiGLU GEMM needs one [gate; up] weight)"
    return None


class BatchedPrefill:
    """Scratch buffers for chunks of up to ``chunk`` tokens, and the launches of one chunk."""

    def __init__(self, model, chunk: int = PREFILL_CHUNK, f16_weights: dict | None = None):
        cfg, ops = model.config, model.ops
        self.model = model
        self.f16_weights = f16_weights or {}  # {id(weight): f16 rows kept on the device}: no expansion
        self.chunk = c = int(chunk)
        if c < 1:
            raise ShapeError(f"prefill chunk must be a positive number of tokens, got {chunk}")
        self.qkv_n = cfg.q_dim + 2 * cfg.kv_dim
        weights = [w for lay in model.layers for w in (*lay.qkv, lay.attn_out, lay.gate_up, lay.down)]
        # the expansion scratch, for the weights without an f16 copy
        self.w16 = ops.buffer(max([w.out_dim * w.in_dim for w in weights if id(w) not in self.f16_weights] or [8]),
                              np.float16)
        self.ids = ops.buffer(c, np.uint32)
        self.x = ops.buffer(c * cfg.hidden_size)
        self.h16 = ops.buffer(c * max(cfg.hidden_size, cfg.q_dim), np.float16)
        self.qkv = ops.buffer(c * self.qkv_n)
        self.q = ops.buffer(c * cfg.q_dim)
        self.ffn16 = ops.buffer(c * cfg.intermediate_size, np.float16)
        self._graphs: dict[tuple[int, int], cuda.GraphExec] = {}  # (rows, pos0) -> the chunk's graph
        self._seen: dict[tuple[int, int], None] = {}  # (rows, pos0) run eagerly once

    def free(self) -> None:
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        for b in (self.w16, self.ids, self.x, self.h16, self.qkv, self.q, self.ffn16):
            b.free()

    def _linear(self, weight, x16, out, rows: int, *, ldy: int | None = None, glu: bool = False, **epilogue) -> None:
        ops, s = self.model.ops, self.model.stream
        w16 = self.f16_weights.get(id(weight))
        if w16 is None:
            w16 = self.w16
            ops.dequantize_f16(weight, w16, interleave=glu, stream=s)
        ops.gemm_f16(x16, w16, out, rows, weight.out_dim, weight.in_dim, ldy=ldy, glu=glu, stream=s, **epilogue)

    def run_chunk(self, ids: list[int], pos0: int, last: bool) -> None:
        """Prefill ``ids`` (at most ``chunk``) at positions ``pos0 ..``; with ``last``, the logits and
        greedy token of the final position.

        With graphs on, the chunk runs ``rows`` = ``len(ids)`` rounded up to :data:`GRAPH_ROWS` (the
        extra rows take token 0; they only write cache positions past the chunk, which nothing reads
        before a later append overwrites them, and the causal mask keeps them out of the real rows).
        The first chunk of a (rows, pos0) runs eagerly; the second captures a graph of the chunk's
        launches, which later ones of that (rows, pos0) replay: a fresh prompt of a recurring length
        then costs one graph launch instead of a few hundred kernel launches from Python."""
        m, kv, s = self.model, self.model.kv, self.model.stream
        n = len(ids)
        rows = min(-(-n // GRAPH_ROWS) * GRAPH_ROWS, self.chunk, m.max_len - pos0) if m.use_graph else n
        s.synchronize()  # the previous chunk's embedding has read the ids buffer
        self.ids.copy_from_host_at(np.asarray(list(ids) + [0] * (rows - n), np.uint32), 0)
        kv.set_length(None, pos0)  # (decode steps append on the device; the host count catches up here)
        key = (rows, pos0)
        graph = self._graphs.pop(key, None)
        if graph is None and key in self._seen:
            with cuda.capture(s) as cap:
                self._issue(rows, pos0)
            graph = cap.graph.instantiate()
        if graph is not None:
            graph.launch(s)
            self._graphs[key] = graph  # (most recently used last)
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs))).close()
        else:
            self._issue(rows, pos0)
            if m.use_graph:
                self._seen[key] = None
                while len(self._seen) > 4 * MAX_GRAPHS:
                    self._seen.pop(next(iter(self._seen)))
        kv.set_length(None, pos0 + n)
        if last:
            self._last_row(n)

    def _issue(self, n: int, pos0: int) -> None:
        """The launches of one chunk of ``n`` rows at ``pos0`` (no host synchronisation: capturable)."""
        m, cfg, ops, kv, s = self.model, self.model.config, self.model.ops, self.model.kv, self.model.stream
        eps = cfg.rms_norm_eps
        ops.embedding(m.embed, self.ids, self.x, n_tokens=n, stream=s)
        for i, lay in enumerate(m.layers):
            ops.rmsnorm(self.x, lay.attn_norm, self.h16, eps, rows=n, out_f16=True, stream=s)
            off = 0
            for w in lay.qkv:
                bias = None if lay.qkv_bias is None else (lay.qkv_bias, off)
                self._linear(w, self.h16, (self.qkv, off), n, ldy=self.qkv_n, bias=bias)
                off += w.out_dim
            kv.rope_append_rows(i, self.qkv, m.inv_freq, pos0, n, self.q, neox=cfg.rope_type == "neox",
                                q_norm=lay.q_norm, k_norm=lay.k_norm, eps=eps, stream=s)
            kv.prefill_attention(i, self.q, self.h16, seq_q=n, q_offset=pos0, seq_k=pos0 + n, causal=True,
                                 out_layout="tokens-f16", stream=s)
            self._linear(lay.attn_out, self.h16, self.x, n, residual=self.x)
            ops.rmsnorm(self.x, lay.ffn_norm, self.h16, eps, rows=n, out_f16=True, stream=s)
            self._linear(lay.gate_up, self.h16, self.ffn16, n, glu=True, out_f16=True)
            self._linear(lay.down, self.ffn16, self.x, n, residual=self.x)

    def _last_row(self, n: int) -> None:
        """Final norm, LM head and argmax of row ``n - 1``, into the buffers a decode step uses."""
        m, cfg, ops, s = self.model, self.model.config, self.model.ops, self.model.stream
        eps = cfg.rms_norm_eps
        ops.rmsnorm((self.x, (n - 1) * cfg.hidden_size), m.output_norm, m.h, eps, stream=s)
        ops.gemv(m.lm_head, m.h, m.logits, stream=s)
        ops.argmax(m.logits, m.token_out, stream=s)
