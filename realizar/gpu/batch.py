"""GpuBatchBackend: the one GPU inference path — the layer program over the paged KV cache.

It runs :class:`~realizar.gpu.decoder.Decoder` for every GPU caller: the serving engine's batches (the
:class:`realizar.serving.backend.BatchBackend` protocol) and, as the batch of one, a single sequence
(:class:`~realizar.gpu.model.GpuModel`, whose own backend has one row and one block table bound once).
It shares the weights of a :class:`~realizar.gpu.model.GpuModel` and keeps its own cache: one pool of
``block_size``-position blocks per layer, a sequence's positions found through its block table.

* :meth:`GpuBatchBackend.decode`: B sequences advance one token each in one graph replay. Their token
  ids, positions, lengths and block tables travel in one packed host-to-device copy; B is padded up to
  a *bucket* (1, 2, 4, 8, 16, 24, 32, 48, 64, ...) and each bucket's step, the sampler of every row
  included, is captured once (launched when the output is sampled: the specs travel with the step). The
  padding rows read token 0 at position 0 through an all-zero block table: they write only the
  reserved null block 0, which no sequence owns. A row given :func:`~realizar.serving.backend.fed` ``(r)``
  takes the token the previous step sampled in its row r on the device (``feed_tokens`` at the start of
  the step's graph), and :meth:`GpuBatchOutput.launch` queues the step and the copy of its tokens without
  waiting: the host stages step N + 1 (two staging arrays, each reused once its upload has left) and
  launches it before it reads step N's tokens. The linear layers run on the
  :class:`~realizar.gpu.linear.Linear` chosen by B (the decode GEMV at B = 1).
* :meth:`GpuBatchBackend.prefill`: a chunk of one sequence's prompt (of at least ``prefill_min_batch``
  tokens; shorter ones go token by token through the 1-row decode step) through
  :class:`~realizar.gpu.prefill.Prefill`, its K/V appended and read through the sequence's block table,
  so a prompt whose first blocks came from the prefix cache starts at the first uncached position.
* :class:`GpuBatchOutput.sample`: every row sampled on the GPU (greedy, temperature, top-k, top-p,
  a counter-based seed per request), 4 bytes a row read back. A greedy single row ends its step in the
  two-launch argmax instead of the one-block-per-row sampler (a variant of bucket 1's graph);
  :meth:`GpuBatchOutput.logits` copies a row's logits to the host for requests that need them.

Where more than one row cannot run (before sm_80, widths the f16 kernels do not take, or a mixture of experts
whose expert count is not a multiple of 8:
:func:`~realizar.gpu.linear.rows_unsupported`), the backend runs one row at a time: ``max_batch`` 1,
prompts token by token (:attr:`batched_off` says why).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Sequence

import numpy as np

from realizar import cuda
from realizar.config import DEFAULT_MAX_CONTEXT, KV_MEMORY_SHARE, ServingConfig
from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError, UnsupportedError
from realizar.gpu.attention import DecodeRows
from realizar.gpu.argmax import ARGMAX_SCRATCH
from realizar.gpu.decoder import Activations, Decoder
from realizar.gpu.linear import Linear, rows_unsupported
from realizar.gpu.prefill import GRAPH_ROWS, Prefill
from realizar.gpu.sampling import NO_SOURCE, SPEC_WORDS, pack_specs
from realizar.models.kv_formats import KV_FORMATS, block_bytes
from realizar.sampling import RowSampling
from realizar.serving.backend import PendingTokens, fed

__all__ = ["BUCKETS", "GpuBatchBackend", "GpuBatchOutput", "bucket_for", "token_ids"]

_DEFAULTS = ServingConfig()
# decode batch sizes captured as graphs (a batch runs in the smallest bucket that holds it)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
# f16 copies of the weights are kept for the large batches when they take at most this share of the free
# device memory (f16_weights=None): each step then skips expanding every weight
F16_WEIGHTS_SHARE = 0.4


def _ints(values: Any, what: str) -> list[int]:
    """``values`` (an iterable of integers) as a list of Python ints, or InvalidRequestError naming ``what``."""
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{what} must be integers: {e}") from None


def token_ids(tokens: Any, vocab_size: int) -> np.ndarray:
    """``tokens`` as an int64 array of at least one id of the vocabulary, checked in one vectorised pass (a
    long prompt costs the host microseconds before its first launch); InvalidRequestError otherwise."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidRequestError(f"a prompt is a non-empty list of token ids, got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise InvalidRequestError(f"token ids must be integers, got {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    if ids.min() < 0 or ids.max() >= vocab_size:
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise InvalidRequestError(f"token id {bad} outside the vocabulary of {vocab_size}")
    return ids


def bucket_for(rows: int, max_batch: int) -> int:
    """The graph bucket that holds ``rows`` sequences (at most ``max_batch``)."""
    for b in BUCKETS:
        if b >= rows:
            return min(b, max_batch) if rows <= max_batch else b
    return max_batch


class GpuBatchOutput:
    """The logits of ``rows`` sequences after a step, on the GPU (row-major ``[rows, vocab]``).

    A decode step is launched lazily: :meth:`sample` sends the rows' sampling specs with the step's
    inputs and replays the bucket's graph, sampler included (one copy in, one graph, 4 bytes a row
    out); :meth:`logits` first runs the step if nothing has."""

    def __init__(self, backend: "GpuBatchBackend", rows: int, pending: tuple[int, int, bool] | None = None):
        self._backend = backend
        self.rows = rows
        self._pending = pending  # decode: (bucket, staging slot, fed rows) of the step that has not run yet
        self._step = backend.steps

    def _check(self) -> None:
        if self._step != self._backend.steps:
            raise InvalidRequestError("these logits were overwritten by a later step of the model")

    def sample(self, specs: Sequence[Any]) -> np.ndarray:
        """One token per row (int64), drawn on the GPU per ``specs`` (``RowSampling``)."""
        self._check()
        if len(specs) != self.rows:
            raise ShapeError(f"sample needs one spec per row: {self.rows} rows, {len(specs)} specs")
        return self.launch(specs).wait()

    def launch(self, specs: Sequence[Any]) -> PendingTokens:
        """:meth:`sample` without waiting: a decode step and the copy of its tokens are queued on the
        backend's stream (``wait()`` reads them)."""
        self._check()
        if len(specs) != self.rows:
            raise ShapeError(f"sample needs one spec per row: {self.rows} rows, {len(specs)} specs")
        pending = self._run_pending(specs)
        return pending if pending is not None else PendingTokens(self._backend._sample(self.rows, specs))

    def logits(self, i: int) -> np.ndarray:
        """Row ``i``'s logits on the host (float32 ``[vocab]``)."""
        self._check()
        if not 0 <= i < self.rows:
            raise ShapeError(f"row {i} outside the {self.rows} rows of this step")
        pending = self._run_pending(None)
        if pending is not None:
            pending.wait()
        return self._backend.read_logits(i)

    def _run_pending(self, specs: Sequence[Any] | None) -> "_StepTokens | None":
        """Launch the staged decode step with ``specs`` (None: greedy); None when there is no staged step (a
        prefill's output, or a step that has been launched)."""
        if self._pending is None:
            return None
        (bucket, slot, feed), self._pending = self._pending, None
        return self._backend._launch_decode(bucket, self.rows, specs, slot, feed)


class _StepTokens(PendingTokens):
    """A launched decode step's tokens: copied into a pinned array behind the step, read after its event."""

    def __init__(self, done: Any, out: np.ndarray):
        self._done, self._out = done, out

    def wait(self) -> np.ndarray:
        self._done.synchronize()
        return self._out.astype(np.int64)


class GpuBatchBackend:
    """Batched decode and paged prefill over a :class:`GpuModel`'s weights (see the module docstring).

    ``num_blocks`` KV blocks of ``block_size`` positions (block 0 reserved), or as many as
    ``kv_memory`` bytes hold (a float in (0, 1]: that fraction of the free device memory);
    ``kv_dtype``: the cache's element type; ``max_batch``: most sequences per decode step;
    ``max_context``: most positions per sequence (the block tables' width); ``f16_weights``: keep f16
    copies of the weights for the large batches' GEMMs (None: when they fit in F16_WEIGHTS_SHARE of the
    free memory; False: expand each weight per step); ``gemv_cols_rows``: batches of up to this many rows
    run the tensor-core GEMV's columns kernel where it applies (:class:`~realizar.gpu.linear.Linear`);
    ``graph``: "capture", "manual" or "eager" (:class:`~realizar.cuda.GraphCache`); ``decoder``: the
    layer program (default: the model's, adding the residual)."""

    def __init__(self, model, *, num_blocks: int | None = None, kv_memory: float | int | None = None,
                 block_size: int = _DEFAULTS.block_size, kv_dtype: str = "f16", max_batch: int = _DEFAULTS.max_batch,
                 max_context: int | None = None, use_graph: bool = True, graph: str = "capture",
                 prefill_chunk: int | None = _DEFAULTS.prefill_chunk, f16_weights: bool | None = None,
                 prefill_min_batch: int = _DEFAULTS.prefill_min_batch,
                 gemv_cols_rows: int = _DEFAULTS.gemv_cols_rows, decoder: Decoder | None = None,
                 stream: cuda.Stream | None = None):
        from realizar.gpu.paged_kv import PagedKVCache

        if kv_dtype not in KV_FORMATS:
            raise ShapeError(f"kv_dtype must be one of {KV_FORMATS}, got {kv_dtype!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= BUCKETS[-1]:
            raise ShapeError(f"max_batch must be an integer in [1, {BUCKETS[-1]}], got {max_batch!r}")
        self.model = model
        self.weights, self.config = model.weights, model.config
        cfg = self.config
        self.ops, self.device = model.ops, model.device
        self.device.make_current()
        self.linear = Linear(self.ops, cols_rows=gemv_cols_rows)
        self.decoder = decoder or Decoder(self.weights, self.ops)
        self.stream = stream or cuda.Stream(self.device)
        self._own_stream = stream is None
        #: why batches of more than one row (and batched prefill) cannot run here (None: they can)
        self.batched_off = rows_unsupported(self.device, cfg)
        self.block_size = int(block_size)
        self.kv_dtype = kv_dtype
        if self.batched_off and max_batch > 1:
            warnings.warn(f"one sequence at a time on {self.device.name}: {self.batched_off}", stacklevel=2)
        self.max_batch = 1 if self.batched_off else int(max_batch)
        self.context_length = int(min(cfg.context_length, max_context or DEFAULT_MAX_CONTEXT))
        self.table_stride = -(-self.context_length // self.block_size)
        if self.batched_off is None and f16_weights is not False:
            self._keep_f16_weights(f16_weights)
        self.f16_weights = bool(self.linear.f16_weights)
        if num_blocks is None:
            per_block = block_bytes(cfg, self.block_size, kv_dtype)
            kv_memory = KV_MEMORY_SHARE if kv_memory is None else kv_memory
            free, _ = self.device.memory_info()
            budget = int(kv_memory * free) if isinstance(kv_memory, float) and kv_memory <= 1 else int(kv_memory)
            num_blocks = budget // per_block
        if num_blocks < 2:
            raise ShapeError(f"the KV pool needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.kv = PagedKVCache(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.num_blocks,
                               block_size=self.block_size, kv_dtype=kv_dtype, ops=self.ops,
                               max_batch=self.max_batch)
        self.graph_mode = graph if use_graph else "eager"
        ops, mb = self.ops, self.max_batch
        # the packed per-step values: ids [B] | positions [B] | lengths [B] | specs [B, 8] | fed rows' sources [B]
        # | tables [B, stride], staged in two pinned arrays (step N + 1's while N's upload may be in flight)
        self._src_at = (3 + SPEC_WORDS) * mb
        self._tables_at = self._src_at + mb
        self._n_step = self._tables_at + mb * self.table_stride
        self._stage = [cuda.PinnedArray(self._n_step, np.uint32, device=self.device) for _ in range(2)]
        self._step_host = self._stage[0]  # (the synchronous paths' staging: binding a sequence)
        self._uploaded = [cuda.Event(timing=False, device=self.device) for _ in range(2)]  # slot's upload has left
        self._slot = 0
        self.step = ops.buffer(self._n_step, np.uint32, zero=True)
        self.prefill_table = ops.buffer(self.table_stride, np.uint32, zero=True)
        self.acts = Activations.allocate(ops, cfg, mb, one_row=True, many_rows=mb > 1,
                                         split_ffn=self.weights.split_ffn)
        self.tokens = ops.buffer(mb, np.uint32)
        self._tokens_host = cuda.PinnedArray(mb, np.uint32, device=self.device)
        self._step_tokens = [cuda.PinnedArray(mb, np.uint32, device=self.device) for _ in range(2)]
        self._tokens_read = [cuda.Event(timing=False, device=self.device) for _ in range(2)]
        self.feeds_tokens = True
        self._fed_rows = 0  # rows of the last decode step whose sampled tokens are in self.tokens (0: none)
        self._specs_host = cuda.PinnedArray(mb * SPEC_WORDS, np.uint32, device=self.device)  # prefill rows
        self.specs = ops.buffer(mb * SPEC_WORDS, np.uint32, zero=True)
        self.argmax_scratch = ops.buffer(ARGMAX_SCRATCH, np.uint64)
        self.pdl = model.pdl  # programmatic dependent launch between the step graph's kernels (sm_90)
        self.graphs = cuda.GraphCache(self.stream, mode=self.graph_mode, capacity=3 * len(BUCKETS), pdl=self.pdl)
        self._attention: dict[int, DecodeRows] = {}
        self._one: cuda.StepValues | None = None  # the bound single sequence's (token, pos, seq_len)
        # prompts through the layers at once (None or 0: token by token, e.g. a tensor-parallel rank's)
        self._prefill = Prefill(self, prefill_chunk) if self.batched_off is None and prefill_chunk else None
        self.prefill_chunk = self._prefill.chunk if self._prefill is not None else 0
        # shorter prompts run token by token through the 1-row decode step (f32 activations, exact GEMVs):
        # below this, the batched prefill's launches cost more than the steps
        self.prefill_min_batch = int(prefill_min_batch)
        self.steps = 0

    # ---- weights -----------------------------------------------------------------------------------
    def _keep_f16_weights(self, wanted: bool | None) -> None:
        """f16 copies of the weights for the large batches' GEMMs (gate/up interleaved as the SwiGLU
        GEMM reads them); ``wanted`` None: when they fit in F16_WEIGHTS_SHARE of the free memory."""
        weights = list({id(w): w for w in self.weights.linears}.values())
        need = sum(2 * w.out_dim * w.in_dim for w in weights)
        free, _ = self.device.memory_info()
        if wanted is False or (wanted is None and need > F16_WEIGHTS_SHARE * free):
            return
        if need > free:
            raise ShapeError(f"f16 weights need {need / 2**30:.1f} GiB, the device has {free / 2**30:.1f} GiB free")
        glu = {id(lay.gate_up) for lay in self.weights.layers if lay.gate_up is not None}
        self.linear.keep_f16(weights, glu, self.stream)

    def clear_graphs(self) -> None:
        """Drop every captured step (their buffers changed)."""
        self.graphs.clear()
        if self._prefill is not None:
            self._prefill.graphs.clear()

    # ---- one decode step --------------------------------------------------------------------------
    def _decode_rows(self, b: int) -> DecodeRows:
        att = self._attention.get(b)
        if att is None:
            mb, step = self.max_batch, self.step
            att = DecodeRows(self.kv, self.config, self.weights.inv_freq, (step, mb), (step, 2 * mb),
                             (step, self._tables_at), self.table_stride, b)
            self._attention[b] = att
        return att

    def step_phases(self, b: int, argmax: bool, feed: bool = False):
        """The launches of one decode step of ``b`` rows (no host synchronisation: capturable), pausing
        at the layer program's all-reduce points, ending in the head and the per-row sampler, or with
        ``argmax`` (one greedy row) the argmax; ``feed``: first the fed rows' ids from the last step's tokens."""
        if feed:
            self.ops.feed_tokens((self.step, 0), (self.step, self._src_at), self.tokens, b, self.max_batch,
                                 stream=self.stream)
        yield from self.decoder.phases(self.acts, (self.step, 0), b, self.linear, self._decode_rows(b), self.stream)
        self.issue_head(b, argmax)

    def issue_head(self, b: int, argmax: bool) -> None:
        """Final norm, LM head and the sampler (or argmax) of ``b`` rows."""
        cfg, s = self.config, self.stream
        self.decoder.head(self.acts, b, self.linear, s)
        if argmax:
            self.ops.argmax(self.acts.logits, self.tokens, n=cfg.vocab_size, stream=s, scratch=self.argmax_scratch)
        else:
            self.ops.sample_rows(self.acts.logits, (self.step, 3 * self.max_batch), self.tokens, b, cfg.vocab_size,
                                 stream=s)

    def issue_step(self, b: int, argmax: bool, feed: bool = False) -> None:
        for _ in self.step_phases(b, argmax, feed):
            pass

    def _launch_step(self, b: int, argmax: bool, feed: bool = False) -> None:
        if self.linear.reserve(self.weights.linears, b):
            self.clear_graphs()
        self.graphs.run((b, argmax, feed), lambda: self.issue_step(b, argmax, feed))

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               block_tables: Sequence[Sequence[int]]) -> GpuBatchOutput:
        """Advance ``len(tokens)`` sequences by one token each: row r feeds ``tokens[r]`` (an id, or
        :func:`~realizar.serving.backend.fed` ``(j)``: row j's token of the previous step, on the device) at
        ``positions[r]`` (its K/V written there, attention over positions 0..positions[r]) through
        ``block_tables[r]``. The inputs are checked and staged now; the step runs when the output is
        sampled, launched or read (:class:`GpuBatchOutput`)."""
        n = len(tokens)
        if not 1 <= n <= self.max_batch or len(positions) != n or len(block_tables) != n:
            raise ShapeError(f"decode takes 1..{self.max_batch} rows with one position and block table each, "
                             f"got {n} tokens, {len(positions)} positions, {len(block_tables)} tables")
        b = bucket_for(n, self.max_batch)
        mb, stride, vocab, at = self.max_batch, self.table_stride, self.config.vocab_size, self._tables_at
        # checked on Python lists (cheaper than numpy at these sizes), staged in few numpy copies, not a
        # numpy write per value
        lens, flat = self._check_blocks(block_tables)
        tok, pos = _ints(tokens, "token ids"), _ints(positions, "positions")
        feed = min(tok) < 0
        if feed and not -self._fed_rows <= min(tok):
            raise InvalidRequestError(f"token {min(tok)}: a fed token needs the previous call to be a sampled "
                                      f"decode step with that row ({self._fed_rows} rows)")
        if max(tok) >= vocab:
            raise InvalidRequestError(f"token id {max(tok)} outside the vocabulary of {vocab}")
        if min(pos) < 0 or max(pos) >= self.context_length:
            p = next(p for p in pos if not 0 <= p < self.context_length)
            raise ContextOverflowError(f"position {p} is past the context length of {self.context_length}")
        for r, (blocks, p) in enumerate(zip(lens, pos)):
            if blocks * self.block_size <= p or blocks > stride:
                raise ShapeError(f"row {r}: position {p} needs block {p // self.block_size}, the table has "
                                 f"{blocks} blocks (at most {stride})")
        self.device.make_current()
        slot = self._slot
        self._slot ^= 1
        self._uploaded[slot].synchronize()  # this staging array's last upload (two steps ago) has left
        self._unbind()  # the tables are restaged: a bound sequence binds again
        host = self._stage[slot].array
        host[:3 * mb] = 0
        host[mb: mb + n], host[2 * mb: 2 * mb + n] = pos, [p + 1 for p in pos]
        if feed:
            ids = np.asarray(tok, np.int64)
            host[:n] = np.maximum(ids, 0)
            host[self._src_at: self._src_at + mb] = NO_SOURCE
            host[self._src_at: self._src_at + n] = np.where(ids < 0, -1 - ids, NO_SOURCE)
        else:
            host[:n] = tok
        host[at: at + b * stride] = 0
        if n == 1:
            host[at: at + lens[0]] = flat
        elif flat.size:  # row r's table at at + r * stride
            counts = np.asarray(lens)
            starts = np.repeat(at + stride * np.arange(n) - (np.cumsum(counts) - counts), counts)
            host[starts + np.arange(flat.size)] = flat
        self.steps += 1
        return GpuBatchOutput(self, n, pending=(b, slot, feed))

    def _launch_decode(self, b: int, rows: int, specs: Sequence[Any] | None, slot: int, feed: bool) -> _StepTokens:
        """Send staging slot ``slot`` (and ``specs``; None: greedy), queue bucket ``b``'s step and the copy of
        its first ``rows`` tokens; returns them pending."""
        mb, host = self.max_batch, self._stage[slot].array
        staged = host[3 * mb: 3 * mb + mb * SPEC_WORDS].reshape(mb, SPEC_WORDS)
        staged[:] = 0
        if specs is not None:
            pack_specs(specs, out=staged)
        # one greedy row: the argmax, not the sampler's one block for the whole row
        argmax = b == 1 and (specs is None or (specs[0, 0] == 0 if isinstance(specs, np.ndarray)
                                               else specs[0].temperature == 0))
        self.step.copy_from_host_at(host[: self._tables_at + b * self.table_stride], 0, stream=self.stream)
        self._uploaded[slot].record(self.stream)
        self._launch_step(b, argmax, feed)
        self._tokens_read[slot].synchronize()  # (read two launches ago)
        out = self._step_tokens[slot].array[:rows]
        self.tokens.copy_to_host_at(0, rows, out, stream=self.stream)
        self._tokens_read[slot].record(self.stream)
        self._fed_rows = rows
        return _StepTokens(self._tokens_read[slot], out)

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

    # ---- one bound sequence (the batch of one) -------------------------------------------------------
    def _unbind(self) -> None:
        if self._one is not None:
            self._one.free()
            self._one = None

    def bind_sequence(self, block_table: Sequence[int]) -> None:
        """Bind row 0 to ``block_table`` (a backend of ``max_batch`` 1): later :meth:`step_one` calls send
        only the token, position and length; prefills go through the same table."""
        if self.max_batch != 1:
            raise ShapeError(f"bind_sequence needs a backend of max_batch 1, this one has {self.max_batch}")
        lens, flat = self._check_blocks([block_table])
        if lens[0] > self.table_stride:
            raise ShapeError(f"a table of {lens[0]} blocks, at most {self.table_stride}")
        self.device.make_current()
        self.stream.synchronize()
        host = self._step_host.array
        host[:] = 0
        host[self._tables_at: self._tables_at + lens[0]] = flat
        self.step.copy_from_host(host)
        self.prefill_table.copy_from_host(host[self._tables_at:])
        if self._one is None:
            self._one = cuda.StepValues(("token", "pos", "seq_len"), device=self.device, dest=(self.step, 0))

    def stage_one(self, token: int, position: int) -> None:
        """Send the bound sequence's next token, position and length (checked by the caller)."""
        if self._one is None:
            raise ShapeError("no bound sequence: a step with block tables replaced it (bind_sequence again)")
        self._one.set(token=token, pos=position, seq_len=position + 1)
        self._one.upload(self.stream)

    def step_one(self, token: int, position: int) -> None:
        """Run one greedy decode step of the bound sequence (checked by the caller); its logits and
        token stay on the device (:meth:`read_tokens`, :meth:`read_logits`)."""
        self.stage_one(token, position)
        self._launch_step(1, True)
        self._fed_rows = 0
        self.steps += 1

    # ---- prefill ----------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], start: int, block_table: Sequence[int] | None) -> GpuBatchOutput:
        """Positions ``start .. start + len(tokens) - 1`` of one sequence through every layer at once
        (chunks of ``prefill_chunk``), K/V written through ``block_table`` (None: the bound sequence's);
        returns the last token's logits as a 1-row output."""
        if isinstance(tokens, Sequence) and not tokens:
            raise InvalidRequestError("prefill needs at least one token")
        ids = token_ids(tokens, self.config.vocab_size)
        n, start = len(ids), int(start)
        if start < 0 or start + n > self.context_length:
            raise ContextOverflowError(f"positions {start}..{start + n - 1} exceed the context length of "
                                       f"{self.context_length}")
        if block_table is not None:
            self._take_table(block_table, start + n)
        elif self._one is None:
            raise ShapeError("prefill without a block table needs a bound sequence (bind_sequence)")
        self.device.make_current()
        self.steps += 1
        if n < self.prefill_min_batch or self._prefill is None:  # token by token through the 1-row step
            for i, tok in enumerate(ids.tolist()):
                self._token_step(tok, start + i, block_table)
            self._fed_rows = 0
            return GpuBatchOutput(self, 1)
        if block_table is not None:
            self._load_prefill_table(block_table)
        c = self._prefill.chunk
        for off in range(0, n, c):
            part = ids[off: off + c]
            if len(part) == 1:  # (a chunk of one row: the decode step's one-row kernels)
                self._token_step(int(part[0]), start + off, block_table)
            else:
                self._prefill.run_chunk(part, start + off, last=off + c >= n)
        self._fed_rows = 0
        return GpuBatchOutput(self, 1)

    def hidden_rows(self, tokens: Sequence[int], block_table: Sequence[int]) -> np.ndarray:
        """Positions ``0 ..`` of a sequence through every layer in prefill chunks, K/V through ``block_table``; the
        final-norm rows, f32 ``[len(tokens), hidden]`` (embeddings). The sampled tokens of the last decode step
        stay, for its fed rows."""
        ids = token_ids(tokens, self.config.vocab_size)
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("embedding needs at least one token")
        if n > self.context_length:
            raise ContextOverflowError(f"{n} tokens exceed the context length of {self.context_length}")
        if self._prefill is None:
            raise UnsupportedError("embeddings on the GPU run through the prefill chunks, which this backend has off")
        self._take_table(block_table, n)
        self.device.make_current()
        self._load_prefill_table(block_table)
        c, rows = self._prefill.chunk, []
        for off in range(0, n, c):
            part = ids[off: off + c]
            self._prefill.run_chunk(part, off, last=False)
            rows.append(self._prefill.final_rows(len(part)))
        return np.concatenate(rows)

    def _take_table(self, block_table: Sequence[int], end: int) -> None:
        """Check ``block_table`` for positions ``0 .. end - 1`` (its length, its blocks) before the prefill table is
        rewritten with it; a bound sequence is unbound (it binds again)."""
        self._unbind()
        if len(block_table) * self.block_size < end or len(block_table) > self.table_stride:
            raise ShapeError(f"positions up to {end - 1} need {-(-end // self.block_size)} blocks, the table has "
                             f"{len(block_table)}")
        self._check_blocks([block_table])

    def _load_prefill_table(self, block_table: Sequence[int]) -> None:
        table = np.zeros(self.table_stride, np.uint32)
        table[: len(block_table)] = block_table
        self.stream.synchronize()  # an earlier step (one in flight too) may still read the table buffer
        self.prefill_table.copy_from_host(table)

    def _token_step(self, token: int, position: int, block_table: Sequence[int] | None) -> None:
        """One prompt token through the one-row decode step (greedy: its logits and argmax stay)."""
        if block_table is None:
            self.step_one(token, position)
        else:
            self.decode([token], [position], [block_table])._run_pending(None).wait()

    # ---- before the first request ---------------------------------------------------------------------
    def warm_up(self) -> None:
        """Load every kernel and capture the graphs a served step uses, so the first requests run as fast
        as later ones: a prompt chunk of every length class (multiples of the prefill's graph rows up to the
        chunk, as many as the pool holds) and every decode bucket up to ``max_batch``, greedy and sampled,
        with and without fed rows. It writes K/V only into blocks the scheduler has not handed out (a
        sequence reads only positions it wrote) and leaves no state behind."""
        rng = np.random.default_rng(0)
        room = min((self.num_blocks - 1) * self.block_size, self.context_length)
        table = list(range(1, self.num_blocks))
        if self._prefill is not None:
            top = min(self.prefill_chunk, room)
            # longest first, twice each (the second run captures): the prefill keeps the shorter, commoner
            # lengths' graphs when it cannot keep them all
            for rows in range(top - top % GRAPH_ROWS or top, 0, -GRAPH_ROWS):
                n = min(max(rows, self.prefill_min_batch), room)  # (shorter prompts go through the decode step)
                ids = rng.integers(0, self.config.vocab_size, n).tolist()
                for _ in range(2):
                    self.prefill(ids, 0, table[: -(-n // self.block_size)]).sample([RowSampling()])
        sampled = RowSampling(temperature=1.0, seed=1)
        for b in (b for b in BUCKETS if b <= self.max_batch):
            for spec in ((RowSampling(), sampled) if b == 1 else (sampled,)):
                self.decode([1] * b, [0] * b, [[1]] * b).sample([spec] * b)
                self.decode([fed(r) for r in range(b)], [0] * b, [[1]] * b).sample([spec] * b)
        self._fed_rows = 0

    # ---- outputs ----------------------------------------------------------------------------------
    def read_tokens(self, rows: int) -> np.ndarray:
        """The tokens of the last step's first ``rows`` rows (uint32; a view of a pinned array)."""
        out = self._tokens_host.array[:rows]
        self.tokens.copy_to_host_at(0, rows, out, stream=self.stream)
        self.stream.synchronize()
        return out

    def _sample(self, rows: int, specs: Sequence[Any]) -> np.ndarray:
        self.device.make_current()
        staged = self._specs_host.array.reshape(self.max_batch, SPEC_WORDS)
        self.stream.synchronize()  # the previous call's spec copy has left the staging array
        pack_specs(specs, out=staged)
        self.specs.copy_from_host_at(self._specs_host.array[: rows * SPEC_WORDS], 0, stream=self.stream)
        self.ops.sample_rows(self.acts.logits, self.specs, self.tokens, rows, self.config.vocab_size,
                             stream=self.stream)
        self._fed_rows = 0
        return self.read_tokens(rows).astype(np.int64)

    def read_logits(self, i: int = 0) -> np.ndarray:
        """Row ``i``'s logits of the last step, on the host (float32 ``[vocab]``)."""
        self.device.make_current()
        self.stream.synchronize()
        vocab = self.config.vocab_size
        return self.acts.logits.copy_to_host_at(i * vocab, vocab)

    def close(self) -> None:
        self.graphs.close()
        if self._prefill is not None:
            self._prefill.free()
            self._prefill = None
        self.kv.close()
        self.linear.free()
        self.acts.free()
        if self._one is not None:
            self._one.free()
            self._one = None
        for buf in (self.step, self.prefill_table, self.tokens, self.specs, self.argmax_scratch):
            buf.free()
        for pinned in (*self._stage, *self._step_tokens, self._tokens_host, self._specs_host):
            pinned.free()
        if self._own_stream:
            self.stream.close()
