"""GpuBatchBackend: many sequences per decode step on the GPU, over a paged KV cache.

The backend of :class:`realizar.serving.ServingEngine` on a GPU (the protocol is
:class:`realizar.serving.backend.BatchBackend`). It shares a :class:`~realizar.gpu.model.GpuModel`'s
weights and kernels and keeps its own :class:`~realizar.gpu.paged_kv.PagedKVCache`: one pool of
``block_size``-position blocks per layer, a sequence's positions found through its block table.

* :meth:`GpuBatchBackend.decode`: B sequences advance one token each in one graph replay. Their token
  ids, positions, lengths and block tables travel in one packed host-to-device copy; B is padded up to
  a *bucket* (1, 2, 4, 8, 16, 24, 32, 48, 64, ...) and each bucket's step, the sampler of every row
  included, is captured once (launched when the output is sampled: the specs travel with the step). The
  padding rows read token 0 at position 0 through an all-zero block table: they write only the
  reserved null block 0, which no sequence owns.
  Per layer: RMSNorm of every row (f16), the linear layers as one small-M GEMM on the quantized
  weights (:meth:`_linear`), RoPE with the K/V append through each row's table, paged flash decoding
  of every row over its own length, the O projection + residual, RMSNorm, the fused gate/up GEMM with
  SwiGLU, the down projection + residual; final norm and the LM head for every row. B = 1 runs the
  single-stream decode GEMVs (f32 activations) instead, as :class:`GpuModel` does.
* :meth:`GpuBatchBackend.prefill`: a chunk of one sequence's prompt (of at least ``prefill_min_batch``
  tokens; shorter ones go token by token through the 1-row decode step) through
  :class:`~realizar.gpu.prefill.BatchedPrefill` (the tensor-core prefill), its K/V appended and read
  through the sequence's block table, so a prompt whose first blocks came from the prefix cache starts
  at the first uncached position.
* :class:`GpuBatchOutput.sample`: every row sampled on the GPU (greedy, temperature, top-k, top-p,
  a counter-based seed per request), 4 bytes a row read back. A greedy single row ends its step in the
  two-launch argmax of :class:`GpuModel`'s graph instead of the one-block-per-row sampler (a variant of
  bucket 1's graph), so one stream served alone decodes as fast as :class:`GpuModel`; :meth:`GpuBatchOutput.logits` copies a
  row's logits to the host for requests that need them (logprobs, logits processors, penalties).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from realizar import cuda
from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError, UnsupportedError
from realizar.gpu.argmax import ARGMAX_SCRATCH
from realizar.gpu.prefill import PREFILL_MIN_BATCH, BatchedPrefill, batched_prefill_unsupported
from realizar.gpu.sampling import SPEC_WORDS, pack_specs
from realizar.models.kv_formats import KV_FORMATS, block_bytes

__all__ = ["BUCKETS", "GpuBatchBackend", "GpuBatchOutput", "bucket_for"]

# decode batch sizes captured as graphs (a batch runs in the smallest bucket that holds it)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# batches up to this many rows run their linear layers on the quantized small-M GEMM (gemm_q, each weight
# byte read once); larger ones on the f16 GEMM (tools/bench_gemm_q.py: gemm_q is the faster of the two up
# to about 32 rows on the 8B shapes, the f16 GEMM from 64 on)
GEMM_Q_MAX_ROWS = 32
# batches of 2..this many rows run the linear layers whose type and row length the tensor-core GEMV takes
# on its columns kernel (gemv_cols: each weight unit read and decoded once, the MMAs per row); the rest on
# gemm_q. (Batches of one row run GpuModel's decode GEMVs.) The kernel takes up to GEMV_COLS_MAX_ROWS;
# the default stops at 4, where it is still the faster of the two (H200, 8B shapes, tools/bench_gemm_q.py:
# one layer's four linear layers Q4_K 60 against 106 µs at 2 rows, 85 against 108 at 4, 171 against 112
# at 8; bench_serving 8B steps 2.44 / 3.35 against 4.04 / 4.20 ms at 2 / 4 rows, 6.30 against 4.42 at 8)
GEMV_COLS_MAX_ROWS = 8
GEMV_COLS_DEFAULT_ROWS = 4
# f16 copies of the weights are kept for the large batches when they take at most this share of the free
# device memory (f16_weights=None): each step then skips expanding every weight
F16_WEIGHTS_SHARE = 0.4
DEFAULT_MAX_CONTEXT = 8192


def _ints(values: Any, what: str) -> list[int]:
    """``values`` (an iterable of integers) as a list of Python ints, or InvalidRequestError naming ``what``."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} must be integers: {e}") from None


def bucket_for(rows: int, max_batch: int) -> int:
    """The graph bucket that holds ``rows`` sequences (at most ``max_batch``)."""
    for b in BUCKETS:
        if b >= rows:
            return min(b, max_batch) if rows <= max_batch else b
    return max_batch


class _SequenceKV:
    """The KV interface :class:`BatchedPrefill` calls, bound to one sequence's device block table."""

    def __init__(self, kv, table):
        self.kv = kv
        self.table = table

    def set_length(self, layer, length) -> None:
        """The paged cache keeps no host lengths: the scheduler owns them."""

    def rope_append_rows(self, layer, qkv, inv_freq, pos0, count, q_out, *, neox=False, q_norm=None, k_norm=None,
                         eps=1e-6, stream=None) -> None:
        self.kv.append_rows(layer, qkv, inv_freq, pos0, count, q_out, self.table, neox=neox, q_norm=q_norm,
                            k_norm=k_norm, eps=eps, stream=stream)

    def prefill_attention(self, layer, q, out, seq_q, q_offset, seq_k, causal=True, *, out_layout="tokens-f16",
                          stream=None) -> None:
        if out_layout != "tokens-f16" or not causal:
            raise ShapeError("the paged prefill attention is causal with token-major f16 output")
        self.kv.prefill_attention(layer, q, out, seq_q, q_offset, seq_k, self.table, stream=stream)


class _PrefillModel:
    """What :class:`BatchedPrefill` reads of a model: the shared weights, a paged KV view and this
    backend's last-row buffers (so a prefill never touches the GpuModel's own decode state)."""

    def __init__(self, backend: "GpuBatchBackend"):
        m = backend.model
        self.config, self.ops, self.stream, self.device = m.config, m.ops, backend.stream, m.device
        self.layers, self.embed, self.lm_head = m.layers, m.embed, m.lm_head
        self.inv_freq, self.output_norm = m.inv_freq, m.output_norm
        self.max_len = backend.context_length
        self.use_graph = backend.use_graph
        self.kv = _SequenceKV(backend.kv, backend.prefill_table)
        self.h = backend.h
        self.logits = backend.logits
        self.token_out = backend.tokens


class GpuBatchOutput:
    """The logits of ``rows`` sequences after a step, on the GPU (row-major ``[rows, vocab]``).

    A decode step is launched lazily: :meth:`sample` sends the rows' sampling specs with the step's
    inputs and replays the bucket's graph, sampler included (one copy in, one graph, 4 bytes a row
    out); :meth:`logits` first runs the step if nothing has."""

    def __init__(self, backend: "GpuBatchBackend", rows: int, pending: int | None = None):
        self._backend = backend
        self.rows = rows
        self._pending = pending  # decode: the bucket whose step has not run yet
        self._step = backend.steps

    def _check(self) -> None:
        if self._step != self._backend.steps:
            raise InvalidRequestError("these logits were overwritten by a later step of the model")

    def sample(self, specs: Sequence[Any]) -> np.ndarray:
        """One token per row (int64), drawn on the GPU per ``specs`` (``RowSampling``)."""
        self._check()
        if len(specs) != self.rows:
            raise ShapeError(f"sample needs one spec per row: {self.rows} rows, {len(specs)} specs")
        tokens = self._run_pending(specs)
        return tokens if tokens is not None else self._backend._sample(self.rows, specs)

    def logits(self, i: int) -> np.ndarray:
        """Row ``i``'s logits on the host (float32 ``[vocab]``)."""
        self._check()
        if not 0 <= i < self.rows:
            raise ShapeError(f"row {i} outside the {self.rows} rows of this step")
        self._run_pending(None)
        return self._backend._row_logits(i)

    def _run_pending(self, specs: Sequence[Any] | None) -> np.ndarray | None:
        """Run the staged decode step with ``specs`` (None: greedy) and return its tokens; None when
        there is no staged step (a prefill's output, or a step that has run)."""
        if self._pending is None:
            return None
        bucket, self._pending = self._pending, None
        return self._backend._run_decode(bucket, self.rows, specs)


class GpuBatchBackend:
    """Batched decode and paged prefill over a :class:`GpuModel`'s weights (see the module docstring).

    ``num_blocks`` KV blocks of ``block_size`` positions (block 0 reserved), or as many as
    ``kv_memory`` bytes hold (a float in (0, 1]: that fraction of the free device memory);
    ``kv_dtype``: the cache's element type; ``max_batch``: most sequences per decode step;
    ``max_context``: most positions per sequence (the block tables' width); ``f16_weights``: keep f16
    copies of the weights for batches of more than GEMM_Q_MAX_ROWS rows and the prefill GEMMs (None:
    when they fit in F16_WEIGHTS_SHARE of the free memory; False: expand each weight per step);
    ``gemv_cols_rows``: batches of up to this many rows (0..GEMV_COLS_MAX_ROWS; 0: none) run the
    tensor-core GEMV's columns kernel where it applies, the rest gemm_q (default GEMV_COLS_DEFAULT_ROWS)."""

    def __init__(self, model, *, num_blocks: int | None = None, kv_memory: float | int | None = None,
                 block_size: int = 32, kv_dtype: str = "f16", max_batch: int = 64, max_context: int | None = None,
                 use_graph: bool = True, prefill_chunk: int = 512, f16_weights: bool | None = None,
                 prefill_min_batch: int = PREFILL_MIN_BATCH, gemv_cols_rows: int = GEMV_COLS_DEFAULT_ROWS):
        from realizar.gpu.paged_kv import PagedKVCache

        why = batched_prefill_unsupported(model)
        if why is not None:
            raise UnsupportedError(f"batched decoding needs the batched prefill's kernels: {why}")
        if kv_dtype not in KV_FORMATS:
            raise ShapeError(f"kv_dtype must be one of {KV_FORMATS}, got {kv_dtype!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= BUCKETS[-1]:
            raise ShapeError(f"max_batch must be an integer in [1, {BUCKETS[-1]}], got {max_batch!r}")
        if isinstance(gemv_cols_rows, bool) or not isinstance(gemv_cols_rows, int) \
                or not 0 <= gemv_cols_rows <= GEMV_COLS_MAX_ROWS:
            raise ShapeError(f"gemv_cols_rows must be an integer in [0, {GEMV_COLS_MAX_ROWS}], got {gemv_cols_rows!r}")
        self.gemv_cols_rows = gemv_cols_rows
        self.model = model
        self.config = cfg = model.config
        self.ops, self.device = model.ops, model.device
        self.device.make_current()
        self.stream = cuda.Stream(self.device)
        self.block_size = int(block_size)
        self.kv_dtype = kv_dtype
        self.max_batch = int(max_batch)
        self.context_length = int(min(cfg.context_length, max_context or DEFAULT_MAX_CONTEXT))
        self.table_stride = -(-self.context_length // self.block_size)
        self._f16 = self._make_f16_weights(f16_weights)
        self.f16_weights = bool(self._f16)
        if num_blocks is None:
            per_block = block_bytes(cfg, self.block_size, kv_dtype)
            if kv_memory is None:
                kv_memory = 0.5
            free, _ = self.device.memory_info()
            budget = int(kv_memory * free) if isinstance(kv_memory, float) and kv_memory <= 1 else int(kv_memory)
            num_blocks = budget // per_block
        if num_blocks < 2:
            raise ShapeError(f"the KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.kv = PagedKVCache(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.num_blocks,
                               block_size=self.block_size, kv_dtype=kv_dtype, ops=self.ops,
                               max_batch=self.max_batch)
        self.use_graph = use_graph
        ops, b, h = self.ops, self.max_batch, cfg.hidden_size
        self.qkv_n = cfg.q_dim + 2 * cfg.kv_dim
        # the packed per-step values: ids [B] | positions [B] | lengths [B] | specs [B, 8] | tables [B, stride]
        self._tables_at = (3 + SPEC_WORDS) * b
        self._n_step = self._tables_at + b * self.table_stride
        self._step_host = cuda.PinnedArray(self._n_step, np.uint32, device=self.device)
        self.step = ops.buffer(self._n_step, np.uint32, zero=True)
        self.prefill_table = ops.buffer(self.table_stride, np.uint32, zero=True)
        self.x = ops.buffer(b * h)
        self.h = ops.buffer(h)  # B = 1: the normed row (f32 GEMV input); prefill: the last row
        self.h16 = ops.buffer(b * max(h, cfg.q_dim), np.float16)
        self.qkv = ops.buffer(b * self.qkv_n)
        self.attn = ops.buffer(cfg.q_dim)  # B = 1: attention output (f32 GEMV input)
        self.ffn = ops.buffer(cfg.intermediate_size)  # B = 1
        self.ffn16 = ops.buffer(b * cfg.intermediate_size, np.float16)
        self.logits = ops.buffer(b * cfg.vocab_size)
        self.tokens = ops.buffer(b, np.uint32)
        self._tokens_host = cuda.PinnedArray(b, np.uint32, device=self.device)
        self._specs_host = cuda.PinnedArray(b * SPEC_WORDS, np.uint32, device=self.device)  # prefill rows
        self.specs = ops.buffer(b * SPEC_WORDS, np.uint32, zero=True)
        self._argmax_partials = ops.buffer(ARGMAX_SCRATCH, np.uint64)  # not the model's: its graph runs on its stream
        self.pdl = model.pdl  # programmatic dependent launch between the step graph's kernels (sm_90)
        self._w16 = None  # a larger f16 expansion scratch, only if the LM head needs one (see _ensure_scratch)
        self._graphs: dict[tuple[int, bool], cuda.GraphExec] = {}  # (bucket, ends in argmax) -> its step
        self._prefill = BatchedPrefill(_PrefillModel(self), prefill_chunk, f16_weights=self._f16)
        self.prefill_chunk = self._prefill.chunk
        # shorter prompts run token by token through the 1-row decode step (f32 activations, exact GEMVs):
        # below this, the batched prefill's weight expansion and launches cost more than the steps
        self.prefill_min_batch = int(prefill_min_batch)
        self.steps = 0

    # ---- linear layers of B rows ------------------------------------------------------------------
    def _weights(self) -> list:
        m = self.model
        return [w for lay in m.layers for w in (*lay.qkv, lay.attn_out, lay.gate_up, lay.down)] + [m.lm_head]

    def _make_f16_weights(self, wanted: bool | None) -> dict:
        """{id(weight): its f16 rows} for the large batches' GEMMs (gate/up interleaved as the SwiGLU
        GEMM reads them); ``wanted`` None: when they fit in F16_WEIGHTS_SHARE of the free memory."""
        m, ops = self.model, self.ops
        weights = list({id(w): w for w in self._weights()}.values())
        need = sum(2 * w.out_dim * w.in_dim for w in weights)
        free, _ = self.device.memory_info()
        if wanted is False or (wanted is None and need > F16_WEIGHTS_SHARE * free):
            return {}
        if need > free:
            raise ShapeError(f"f16 weights need {need / 2**30:.1f} GiB, the device has {free / 2**30:.1f} GiB free")
        glu = {id(lay.gate_up) for lay in m.layers}
        out = {}
        for w in weights:
            buf = ops.buffer(w.out_dim * w.in_dim, np.float16)
            ops.dequantize_f16(w, buf, interleave=id(w) in glu, stream=self.stream)
            out[id(w)] = buf
        self.stream.synchronize()
        return out

    def _linear(self, weight, x16, out, rows: int, **epilogue) -> None:
        """out[:rows] = x16[:rows] W^T (+ epilogue): up to ``gemv_cols_rows`` rows on the tensor-core GEMV's
        columns kernel where it takes W, else up to GEMM_Q_MAX_ROWS rows from W's quantized blocks
        (gemm_q); more on the f16 GEMM, over W's f16 copy or W expanded into a scratch first."""
        ops, s = self.ops, self.stream
        if rows <= self.gemv_cols_rows and self._gemv_cols_applies(weight, rows, epilogue.get("glu", False)):
            ops.gemv_cols(weight, x16, out, rows, xh=True, stream=s, **epilogue)
            return
        if rows <= GEMM_Q_MAX_ROWS:
            ops.gemm_q(x16, weight, out, rows, stream=s, **epilogue)
            return
        kept = self._f16.get(id(weight))
        if kept is not None:
            ops.gemm_f16(x16, kept, out, rows, weight.out_dim, weight.in_dim, stream=s, **epilogue)
            return
        w16 = self._w16 or self._prefill.w16
        if w16.count < weight.out_dim * weight.in_dim:
            raise UnsupportedError(f"no f16 scratch for {weight!r}: _ensure_scratch runs before a step")
        glu = epilogue.get("glu", False)
        ops.dequantize_f16(weight, w16, interleave=glu, stream=s)
        ops.gemm_f16(x16, w16, out, rows, weight.out_dim, weight.in_dim, stream=s, **epilogue)

    def _gemv_cols_applies(self, weight, rows: int, glu: bool) -> bool:
        """Whether ``weight``'s layer at ``rows`` rows runs on the tensor-core GEMV's columns kernel."""
        from realizar.gpu.gemv import cols_per_launch

        n_out = weight.out_dim // 2 if glu else weight.out_dim
        cols = min(rows, cols_per_launch(weight.wtype, glu))
        return self.ops.mma_cols_config(n_out, weight.in_dim, weight.wtype, cols, glu=glu,
                                        layout=weight.layout) is not None

    def _ensure_scratch(self, rows: int) -> None:
        """An f16 scratch for every weight the quantized GEMM does not take at ``rows`` rows: the
        prefill's (sized for the layer weights), or a larger one when the LM head needs expanding."""
        m = self.model
        if rows <= GEMM_Q_MAX_ROWS or id(m.lm_head) in self._f16:
            return
        need = m.lm_head.out_dim * m.lm_head.in_dim
        if need > self._prefill.w16.count and (self._w16 is None or self._w16.count < need):
            if self._w16 is not None:
                self._w16.free()
            self._w16 = self.ops.buffer(need, np.float16)

    # ---- one decode step --------------------------------------------------------------------------
    def _issue_decode(self, b: int, argmax: bool = False) -> None:
        """The launches of one decode step of ``b`` rows (no host synchronisation: capturable), ending in
        the per-row sampler, or with ``argmax`` (one greedy row) in the argmax."""
        m, cfg, ops, kv, s = self.model, self.config, self.ops, self.kv, self.stream
        eps, mb, qkv_n = cfg.rms_norm_eps, self.max_batch, self.qkv_n
        ids, pos, lens, tables = (self.step, 0), (self.step, mb), (self.step, 2 * mb), (self.step, self._tables_at)
        neox = cfg.rope_type == "neox"
        ops.embedding(m.embed, ids, self.x, n_tokens=b, stream=s)
        for i, lay in enumerate(m.layers):
            if b == 1:
                ops.rmsnorm(self.x, lay.attn_norm, self.h, eps, stream=s)
                off = 0
                for w in lay.qkv:
                    bias = None if lay.qkv_bias is None else (lay.qkv_bias, off)
                    ops.gemv(w, self.h, (self.qkv, off), bias=bias, stream=s)
                    off += w.out_dim
            else:
                ops.rmsnorm(self.x, lay.attn_norm, self.h16, eps, rows=b, out_f16=True, stream=s)
                off = 0
                for w in lay.qkv:
                    bias = None if lay.qkv_bias is None else (lay.qkv_bias, off)
                    self._linear(w, self.h16, (self.qkv, off), b, ldy=qkv_n, bias=bias)
                    off += w.out_dim
            kv.append_decode(i, self.qkv, m.inv_freq, pos, tables, self.table_stride, b, q_norm=lay.q_norm,
                             k_norm=lay.k_norm, eps=eps, neox=neox, stream=s)
            if b == 1:
                kv.decode_attention(i, (self.qkv, 0), self.attn, lens, tables, self.table_stride, 1, q_stride=qkv_n,
                                    stream=s)
                ops.gemv(lay.attn_out, self.attn, self.x, residual=self.x, stream=s)
                ops.rmsnorm(self.x, lay.ffn_norm, self.h, eps, stream=s)
                ops.gemv_glu(lay.gate_up, self.h, self.ffn, stream=s)
                ops.gemv(lay.down, self.ffn, self.x, residual=self.x, stream=s)
            else:
                kv.decode_attention(i, (self.qkv, 0), self.h16, lens, tables, self.table_stride, b, q_stride=qkv_n,
                                    out_f16=True, stream=s)
                self._linear(lay.attn_out, self.h16, self.x, b, residual=self.x)
                ops.rmsnorm(self.x, lay.ffn_norm, self.h16, eps, rows=b, out_f16=True, stream=s)
                self._linear(lay.gate_up, self.h16, self.ffn16, b, glu=True, out_f16=True)
                self._linear(lay.down, self.ffn16, self.x, b, residual=self.x)
        if b == 1:
            ops.rmsnorm(self.x, m.output_norm, self.h, eps, stream=s)
            ops.gemv(m.lm_head, self.h, self.logits, stream=s)
        else:
            ops.rmsnorm(self.x, m.output_norm, self.h16, eps, rows=b, out_f16=True, stream=s)
            self._linear(m.lm_head, self.h16, self.logits, b)
        if argmax:
            ops.argmax(self.logits, self.tokens, n=cfg.vocab_size, stream=s, scratch=self._argmax_partials)
        else:
            ops.sample_rows(self.logits, (self.step, 3 * mb), self.tokens, b, cfg.vocab_size, stream=s)

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               block_tables: Sequence[Sequence[int]]) -> GpuBatchOutput:
        """Advance ``len(tokens)`` sequences by one token each: row r feeds ``tokens[r]`` at
        ``positions[r]`` (its K/V written there, attention over positions 0..positions[r]) through
        ``block_tables[r]``. The inputs are checked and staged now; the step runs when the output is
        sampled or read (:class:`GpuBatchOutput`)."""
        n = len(tokens)
        if not 1 <= n <= self.max_batch or len(positions) != n or len(block_tables) != n:
            raise ShapeError(f"decode takes 1..{self.max_batch} rows with one position and block table each, "
                             f"got {n} tokens, {len(positions)} positions, {len(block_tables)} tables")
        b = bucket_for(n, self.max_batch)
        mb, stride, vocab, at = self.max_batch, self.table_stride, self.config.vocab_size, self._tables_at
        # checked on Python lists (cheaper than numpy at these sizes), staged in few numpy copies: a step of
        # one row or of 64 costs the host a few µs, not a numpy write per value
        lens, flat = self._check_blocks(block_tables)
        tok, pos = _ints(tokens, "token ids"), _ints(positions, "positions")
        if min(tok) < 0 or max(tok) >= vocab:
            raise InvalidRequestError(f"token id {next(t for t in tok if not 0 <= t < vocab)} outside the "
                                      f"vocabulary of {vocab}")
        if min(pos) < 0 or max(pos) >= self.context_length:
            p = next(p for p in pos if not 0 <= p < self.context_length)
            raise ContextOverflowError(f"position {p} is past the context length of {self.context_length}")
        for r, (blocks, p) in enumerate(zip(lens, pos)):
            if blocks * self.block_size <= p or blocks > stride:
                raise ShapeError(f"row {r}: position {p} needs block {p // self.block_size}, the table has "
                                 f"{blocks} blocks (at most {stride})")
        self.device.make_current()
        self.stream.synchronize()  # the previous step's copy has left the staging array
        host = self._step_host.array
        host[:3 * mb] = 0
        host[:n], host[mb: mb + n], host[2 * mb: 2 * mb + n] = tok, pos, [p + 1 for p in pos]
        host[at: at + b * stride] = 0
        if n == 1:
            host[at: at + lens[0]] = flat
        elif flat.size:  # row r's table at at + r * stride
            counts = np.asarray(lens)
            starts = np.repeat(at + stride * np.arange(n) - (np.cumsum(counts) - counts), counts)
            host[starts + np.arange(flat.size)] = flat
        self.steps += 1
        return GpuBatchOutput(self, n, pending=b)

    def _run_decode(self, b: int, rows: int, specs: Sequence[Any] | None) -> np.ndarray:
        """Send the staged step (and ``specs``; None: greedy) and run bucket ``b``'s step; the tokens."""
        mb, host = self.max_batch, self._step_host.array
        staged = host[3 * mb: 3 * mb + mb * SPEC_WORDS].reshape(mb, SPEC_WORDS)
        staged[:] = 0
        if specs is not None:
            pack_specs(specs, out=staged)
        # one greedy row: the argmax (as GpuModel's graph ends), not the sampler's one block for the whole row
        argmax = b == 1 and (specs is None or specs[0].temperature == 0)
        self.step.copy_from_host_at(host[: self._tables_at + b * self.table_stride], 0, stream=self.stream)
        graph = self._graphs.get((b, argmax))
        if graph is not None:
            graph.launch(self.stream)
        else:
            self._ensure_scratch(b)
            with cuda.programmatic_dependent_launch(self.pdl):
                self._issue_decode(b, argmax)  # eager: loads every kernel before a capture
                if self.use_graph:
                    with cuda.capture(self.stream) as cap:
                        self._issue_decode(b, argmax)
                    self._graphs[(b, argmax)] = cap.graph.instantiate()
        out = self._tokens_host.array[:rows]
        self.tokens.copy_to_host_at(0, rows, out, stream=self.stream)
        self.stream.synchronize()
        return out.astype(np.int64)

    def _check_blocks(self, tables: Sequence[Sequence[int]]) -> tuple[list[int], np.ndarray]:
        """(blocks per table, every table's block ids in a row as int64), after checking that each id is a
        block of the pool other than the null block 0."""
        lens = [len(t) for t in tables]
        try:
            flat = np.fromiter(itertools.chain.from_iterable(tables), np.int64, sum(lens))
        except (OverflowError, TypeError, ValueError) as e:
            raise InvalidRequestError(f"block ids must be integers: {e}") from None
        few = flat.tolist() if flat.size <= 64 else None  # Python's min/max beat numpy's calls on a few ids
        lo, hi = (min(few, default=1), max(few, default=1)) if few is not None else (flat.min(), flat.max())
        if lo <= 0 or hi >= self.num_blocks:
            blk = flat[(flat <= 0) | (flat >= self.num_blocks)][0]
            raise ShapeError(f"block id {blk} outside the pool's blocks 1..{self.num_blocks - 1}")
        return lens, flat

    # ---- prefill ----------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], start: int, block_table: Sequence[int]) -> GpuBatchOutput:
        """Positions ``start .. start + len(tokens) - 1`` of one sequence through every layer at once
        (chunks of ``prefill_chunk``), K/V written through ``block_table``; returns the last token's
        logits as a 1-row output."""
        ids = [int(t) for t in tokens]
        n, start = len(ids), int(start)
        if n == 0:
            raise InvalidRequestError("prefill needs at least one token")
        if start < 0 or start + n > self.context_length:
            raise ContextOverflowError(f"positions {start}..{start + n - 1} exceed the context length of "
                                       f"{self.context_length}")
        if len(block_table) * self.block_size < start + n or len(block_table) > self.table_stride:
            raise ShapeError(f"positions up to {start + n - 1} need {-(-(start + n) // self.block_size)} blocks, "
                             f"the table has {len(block_table)}")
        bad = next((t for t in ids if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} outside the vocabulary of {self.config.vocab_size}")
        self._check_blocks([block_table])
        self.device.make_current()
        self.steps += 1
        if n < self.prefill_min_batch:  # a short prompt: token by token through the 1-row decode graph
            for i, tok in enumerate(ids):
                self.decode([tok], [start + i], [block_table])
                self._run_decode(1, 1, None)
            return GpuBatchOutput(self, 1)
        table = np.zeros(self.table_stride, np.uint32)
        table[: len(block_table)] = block_table
        self.stream.synchronize()  # an earlier step may still read the table buffer
        self.prefill_table.copy_from_host(table)
        c = self.prefill_chunk
        for off in range(0, n, c):
            part = ids[off: off + c]
            self._prefill.run_chunk(part, start + off, last=off + c >= n)
        return GpuBatchOutput(self, 1)

    # ---- outputs ----------------------------------------------------------------------------------
    def _sample(self, rows: int, specs: Sequence[Any]) -> np.ndarray:
        self.device.make_current()
        staged = self._specs_host.array.reshape(self.max_batch, SPEC_WORDS)
        self.stream.synchronize()  # the previous call's spec copy has left the staging array
        pack_specs(specs, out=staged)
        self.specs.copy_from_host_at(self._specs_host.array[: rows * SPEC_WORDS], 0, stream=self.stream)
        out = self._tokens_host.array[:rows]
        self.ops.sample_rows(self.logits, self.specs, self.tokens, rows, self.config.vocab_size, stream=self.stream)
        self.tokens.copy_to_host_at(0, rows, out, stream=self.stream)
        self.stream.synchronize()
        return out.astype(np.int64)

    def _row_logits(self, i: int) -> np.ndarray:
        self.device.make_current()
        self.stream.synchronize()
        vocab = self.config.vocab_size
        return self.logits.copy_to_host_at(i * vocab, vocab)

    def close(self) -> None:
        for g in self._graphs.values():
            g.close()
        self._graphs.clear()
        self._prefill.free()
        self.kv.close()
        for buf in (self.step, self.prefill_table, self.x, self.h, self.h16, self.qkv, self.attn, self.ffn,
                    self.ffn16, self.logits, self.tokens, self.specs, self._argmax_partials, self._w16,
                    *self._f16.values()):
            if buf is not None:
                buf.free()
