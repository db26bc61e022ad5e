"""The iteration-level scheduler: which sequences run in the next forward call, and their blocks.

Every :meth:`Scheduler.step`:

1. **admits** waiting sequences, by priority (a request's ``priority``: lower first), oldest first within
   a priority, while the running set has room (``max_batch``), the
   backlog of admitted-but-unprefilled tokens is under the token budget (``max_batched_tokens``),
   and the pool has blocks for the whole prompt (less the full blocks found in the prefix cache:
   those positions are never prefilled);
2. runs **prefill chunks** of the admitted sequences still prefilling, oldest first, within the budget
   left after the decode rows (at least one token); the chunk that completes a prompt yields its
   first token. While sequences are decoding, the chunks ride in the decode step as **rows** of their
   own (row i: prompt token i at its position, through its sequence's block table; the step writes every
   row's K/V before any row attends, so a prompt's rows attend causally to each other), up to the
   backend's ``max_batch`` rows: a burst of prompts costs a running stream a larger step, never a wait
   behind whole prefills. With nobody decoding, or no rows to spare (fewer than
   :data:`MIN_PREFILL_ROWS`), or for a sequence that chooses its tokens on the host, a chunk runs through
   the backend's ``prefill`` (one sequence, all its layers at once);
3. runs **one decode step of every running sequence** (those past their prefill), so streams keep
   flowing while prompts are processed. A sequence whose next position needs a new block and finds
   the pool empty **preempts the lowest-priority, youngest** admitted sequence (possibly itself): its
   blocks are freed and it waits again, in its place in the queue, with its prompt plus the tokens generated so far to be
   recomputed (the prefix cache usually keeps most of them);
4. finished sequences **retire** at once (their blocks are freed); :meth:`Scheduler.cancel` frees a
   sequence's blocks at once too.

**Overlap** (``async_scheduling``, on a backend that ``feeds_tokens``): a decode step is launched before
the previous one's tokens are read. The rows continuing from it take their input token as
:func:`~realizar.serving.backend.fed` (it stays where it was sampled), and the host then handles the
previous step's tokens (text, stop checks, streaming) while the new step runs. A sequence that stops
(end of sequence, a stop string) was already given one more row; that row's token is dropped (its K/V
write lands in the sequence's own last block, which is freed behind it: any later use of the block is
ordered after the step on the backend). A sequence whose last token is in flight gets no further row.
Steps that prefill, and batches with a row that chooses its token on the host (logprobs, processors,
penalties), read the step in flight first and run as before.

Full blocks are registered in the pool's prefix cache as soon as they are written, so a later request
with the same prefix (a system prompt, earlier chat turns) skips them. A request that could never
fit (prompt + max new tokens above the context length or the whole pool) is refused at
:meth:`Scheduler.add` with :class:`~realizar.errors.InvalidRequestError`.

Sequences are driven through a *client* (the serving engine's per-request object), duck-typed:
``needs_host_logits`` (bool), ``row_sampling(step) -> RowSampling`` (device sampling of the token of index
``step`` among those generated),
``choose(logits) -> int`` (host sampling from a float32 logits row), ``accept(token) -> bool``
(record the token; True when the sequence is finished) and ``fail(exc)`` (a client call raised: the
sequence is retired). No threads here: the caller drives :meth:`step`.
"""

from __future__ import annotations

import bisect

import numpy as np
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from realizar.errors import InvalidRequestError
from realizar.sampling import STEP_WORD, pack_specs
from realizar.serving.backend import BatchBackend, RowSampling, fed
from realizar.serving.blocks import ROOT_KEY, BlockPool
from realizar.config import ServingConfig

__all__ = ["RequestLimits", "Scheduler", "Sequence", "StepOutput", "check_request", "WAITING", "PREFILL", "DECODE", "FINISHED", "CANCELLED"]

_DEFAULTS = ServingConfig()
_GREEDY = pack_specs([RowSampling()])[0]
#: a decode step takes prompt rows only when at least this many are free (or the prompts' rest is shorter)
MIN_PREFILL_ROWS = 16

WAITING, PREFILL, DECODE, FINISHED, CANCELLED = "waiting", "prefill", "decode", "finished", "cancelled"


@dataclass(eq=False)
class Sequence:
    """One request's scheduling state. ``tokens`` = prompt + generated; positions ``< num_computed``
    have K/V in ``blocks``; ``keys`` are the prefix-cache keys of its first full blocks."""

    seq_id: int
    client: Any
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    arrival: int
    state: str = WAITING
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    preemptions: int = 0
    cached_tokens: int = 0  # positions taken from the prefix cache at the last admission
    priority: int = 0  # lower: admitted first, preempted last
    pending: int = 0  # 1: the step in flight draws its next token (row ``row`` of that step), not yet read
    row: int = 0
    spec_words: Any = None  # its device sampling row, packed once (the step word set per step)

    @property
    def order(self) -> tuple[int, int]:
        """The waiting queue's order: priority, then arrival."""
        return self.priority, self.arrival

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass(frozen=True)
class RequestLimits:
    """What every request must fit: the vocabulary, the context length, the KV pool's usable blocks."""

    vocab_size: int
    context_length: int
    usable_blocks: int
    block_size: int


def check_request(prompt_ids: Seq[int], max_new_tokens: int, limits: RequestLimits) -> list[int]:
    """The prompt's token ids, or :class:`InvalidRequestError` for a request that could never fit ``limits``."""
    tokens = [int(t) for t in prompt_ids]
    if not tokens:
        raise InvalidRequestError("the prompt is empty (no tokens)")
    vocab = limits.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary of {vocab}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    total = len(tokens) + int(max_new_tokens)
    if total > limits.context_length:
        raise InvalidRequestError(
            f"prompt of {len(tokens)} tokens + max_tokens {max_new_tokens} = {total} exceeds the "
            f"context length of {limits.context_length}"
        )
    cap = limits.usable_blocks * limits.block_size
    if total > cap:
        raise InvalidRequestError(
            f"prompt of {len(tokens)} tokens + max_tokens {max_new_tokens} = {total} exceeds the KV pool "
            f"({limits.usable_blocks} blocks of {limits.block_size} = {cap} positions)"
        )
    return tokens


@dataclass
class StepOutput:
    """What one :meth:`Scheduler.step` did."""

    admitted: list[int] = field(default_factory=list)
    #: ``(seq_id, start, n_tokens)`` of the first prefill chunk run, or None
    prefill: tuple[int, int, int] | None = None
    #: every prefill chunk run, in order
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    #: rows of the decode call (0: none)
    decode_batch: int = 0
    #: ``(seq_id, token)`` of every token produced, in order
    tokens: list[tuple[int, int]] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        return self.prefill is None and self.decode_batch == 0


class Scheduler:
    """Iteration-level scheduling of sequences over ``backend`` and a :class:`BlockPool` of its
    ``num_blocks`` blocks. Counters: ``prefilled_tokens`` (positions computed by prefill, recomputes
    included), ``cached_tokens`` (positions taken from the prefix cache), ``decoded_tokens`` (decode
    rows), ``preemptions``, ``steps``."""

    def __init__(self, backend: BatchBackend, *, max_batched_tokens: int = _DEFAULTS.max_batched_tokens, prefix_cache: bool = True,
                 max_batch: int | None = None, async_scheduling: bool = _DEFAULTS.async_scheduling):  # fmt: skip
        if int(max_batched_tokens) != max_batched_tokens or max_batched_tokens < 1:
            raise InvalidRequestError(f"max_batched_tokens must be a positive integer, got {max_batched_tokens}")
        self.backend = backend
        self.block_size = int(backend.block_size)
        self.pool = BlockPool(int(backend.num_blocks), self.block_size, prefix_cache=prefix_cache)
        self.max_batched_tokens = int(max_batched_tokens)
        self.max_batch = int(min(max_batch or backend.max_batch, backend.max_batch))
        self.context_length = int(backend.context_length)
        self.waiting: list[Sequence] = []  # by priority, then arrival
        self.running: list[Sequence] = []  # by admission
        self._next_id = 0
        self._arrivals = 0
        #: decode steps overlap the host's handling of the previous step's tokens
        self.overlapped = bool(async_scheduling) and bool(getattr(backend, "feeds_tokens", False))
        self._inflight: tuple[Any, list[Sequence]] | None = None  # (PendingTokens, rows) of the step in flight
        self.prefilled_tokens = self.cached_tokens = self.decoded_tokens = 0
        self.preemptions = self.steps = 0

    # -- requests ----------------------------------------------------------------------------------

    def max_sequence_tokens(self) -> int:
        """The most positions one sequence can ever hold: context length and the whole pool."""
        return min(self.context_length, self.pool.usable * self.block_size)

    def add(self, prompt_ids: Seq[int], max_new_tokens: int, client: Any, priority: int = 0) -> Sequence:
        """Queue a request (``priority``: lower first). Raises :class:`InvalidRequestError` when it could
        never fit."""
        tokens = self.check(prompt_ids, max_new_tokens)
        seq = Sequence(self._next_id, client, tokens, len(tokens), int(max_new_tokens), self._arrivals,
                       priority=int(priority))
        self._next_id += 1
        self._arrivals += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.order)
        return seq

    def check(self, prompt_ids: Seq[int], max_new_tokens: int) -> list[int]:
        """The prompt's token ids, or :class:`InvalidRequestError` for a request that could never fit.
        Reads only what never changes (vocabulary, context, pool size): safe from any thread."""
        return check_request(prompt_ids, max_new_tokens, self.limits())

    def limits(self) -> "RequestLimits":
        """What a request must fit (never changes)."""
        return RequestLimits(int(self.backend.config.vocab_size), self.context_length, self.pool.usable,
                             self.block_size)

    def cancel(self, seq: Sequence) -> bool:
        """Drop a waiting or running sequence at once (its blocks freed); False if already done."""
        if seq.state == WAITING:
            self.waiting.remove(seq)
        elif seq.state in (PREFILL, DECODE):
            self._release(seq)
            self.running.remove(seq)
        else:
            return False
        seq.state = CANCELLED
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    # -- internals ---------------------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.blocks)
        seq.blocks, seq.keys, seq.num_computed = [], [], 0

    def _retire(self, seq: Sequence, out: StepOutput) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.state = FINISHED
        out.finished.append(seq.seq_id)

    def _preempt(self, seq: Sequence, out: StepOutput) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.state = WAITING
        seq.preemptions += 1
        self.preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.order)
        out.preempted.append(seq.seq_id)

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.block_size
        while len(seq.keys) < min(seq.num_computed, len(seq.tokens)) // bs:  # (full blocks of known tokens)
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else ROOT_KEY
            seq.keys.append(self.pool.register(seq.blocks[i], parent, seq.tokens[i * bs : (i + 1) * bs]))

    def _admit(self, out: StepOutput) -> None:
        pool = self.pool
        while self.waiting and len(self.running) < self.max_batch:
            backlog = sum(len(s.tokens) - s.num_computed for s in self.running if s.state == PREFILL)
            if backlog >= self.max_batched_tokens:
                break
            seq = self.waiting[0]
            hit, _ = pool.lookup_prefix(seq.tokens)
            need = pool.blocks_for(len(seq.tokens)) - len(hit)
            if need > pool.num_available - pool.evictable_among(hit):
                break  # first come, first served: nothing younger jumps the queue
            hit, keys = pool.match_prefix(seq.tokens)
            seq.blocks = list(hit) + pool.allocate(need)
            seq.keys = list(keys)
            seq.num_computed = seq.cached_tokens = len(hit) * self.block_size
            self.cached_tokens += seq.cached_tokens
            seq.state = PREFILL
            self.waiting.pop(0)
            self.running.append(seq)
            out.admitted.append(seq.seq_id)

    def _call(self, seq: Sequence, out: StepOutput, fn, *args):
        """A client call; if it raises, the client is told and the sequence retired (None)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a user's logits processor may raise anything
            seq.client.fail(exc)
            if seq in self.running:
                self._retire(seq, out)
            return None

    def _emit(self, seq: Sequence, tok: int, out: StepOutput) -> None:
        seq.tokens.append(int(tok))
        out.tokens.append((seq.seq_id, int(tok)))
        self._register_full_blocks(seq)  # (a block whose last K/V an overlapped step computed)
        done = self._call(seq, out, seq.client.accept, int(tok))
        if done is None:
            return
        if done or seq.generated >= seq.max_new_tokens:
            self._retire(seq, out)

    def _choose(self, seq: Sequence, output, row: int, device_tok, out: StepOutput) -> None:
        if seq.client.needs_host_logits:
            tok = self._call(seq, out, seq.client.choose, output.logits(row))
            if tok is None:
                return
        else:
            tok = int(device_tok)
        self._emit(seq, tok, out)

    # -- one iteration --------------------------------------------------------------------------------

    def step(self) -> StepOutput:
        out = StepOutput()
        self.steps += 1
        self._admit(out)
        decoding = [s for s in self.running if s.state == DECODE]
        prefilling = [s for s in self.running if s.state == PREFILL]
        overlap = self.overlapped and not any(s.client.needs_host_logits for s in decoding)

        # prefill chunks, oldest admitted sequence first, within the budget the decode rows leave (at
        # least one token a step, so a prompt always advances): as rows of the decode step while sequences
        # decode, else (or for a sequence whose tokens are chosen on the host) through the backend's prefill
        budget = max(1, self.max_batched_tokens - len(decoding))
        chunks: list[tuple[Sequence, int, int]] = []  # (sequence, start, n): prompt rows of the decode step
        spare = min(budget, int(self.backend.max_batch) - len(decoding)) if decoding else 0
        rest = sum(len(p.tokens) - p.num_computed for p in prefilling if not p.client.needs_host_logits)
        if rest and spare >= min(MIN_PREFILL_ROWS, rest):
            for pre in prefilling:
                if spare <= 0:
                    break
                if not pre.client.needs_host_logits:
                    n = min(spare, len(pre.tokens) - pre.num_computed)
                    chunks.append((pre, pre.num_computed, n))
                    spare -= n
                    budget -= n
            prefilling = [p for p in prefilling if p.client.needs_host_logits]  # (the rest wait for rows)
        if self._inflight is not None and (prefilling or not overlap):
            self._settle(out)
            decoding = [s for s in decoding if s.state == DECODE]
        for pre in prefilling:
            if budget <= 0:
                break
            start = pre.num_computed
            n = min(budget, len(pre.tokens) - start)
            budget -= n
            output = self.backend.prefill(pre.tokens[start : start + n], start, pre.blocks)
            pre.num_computed += n
            self.prefilled_tokens += n
            self._register_full_blocks(pre)
            out.prefills.append((pre.seq_id, start, n))
            if out.prefill is None:
                out.prefill = (pre.seq_id, start, n)
            if pre.num_computed == len(pre.tokens):
                pre.state = DECODE  # decodes from the next step on
                device_tok = None
                if not pre.client.needs_host_logits:
                    device_tok = output.sample([self._row_spec(pre)])[0]
                self._choose(pre, output, 0, device_tok, out)

        # one decode step of every sequence that was past its prefill at the start of this step (but not of
        # one whose last token is in flight)
        rows: list[Sequence] = []
        for seq in decoding:
            if seq.state != DECODE or seq.generated + seq.pending >= seq.max_new_tokens:
                continue  # preempted below for an older sequence's block, or done once the step in flight is read
            if not self._ensure_block(seq, out):
                continue
            rows.append(seq)
        rows = [s for s in rows if s.state == DECODE]
        chunks = [c for c in chunks if c[0].state == PREFILL]
        if not rows and not chunks:
            if self._inflight is not None:
                self._settle(out)
            return out
        tokens = [fed(s.row) if s.pending else s.tokens[s.num_computed] for s in rows]
        positions, tables = [s.num_computed for s in rows], [s.blocks for s in rows]
        ends: list[tuple[Sequence, int]] = []  # (sequence, row) of each prompt completed by its rows
        for pre, start, n in chunks:  # (those preempted above for an older sequence's block are gone)
            tokens += pre.tokens[start : start + n]
            positions += range(start, start + n)
            tables += [pre.blocks] * n
            pre.num_computed += n
            self.prefilled_tokens += n
            self._register_full_blocks(pre)  # (any later read of them is ordered after this step)
            out.prefills.append((pre.seq_id, start, n))
            if out.prefill is None:
                out.prefill = (pre.seq_id, start, n)
            if pre.num_computed == len(pre.tokens):
                ends.append((pre, len(tokens) - 1))
        output = self.backend.decode(tokens, positions, tables)
        out.decode_batch = len(rows)
        self.decoded_tokens += len(rows)
        for s in rows:
            s.num_computed += 1
        specs = self._step_specs(rows, len(tokens), ends)
        for pre, _ in ends:
            pre.state = DECODE  # decodes from the next step on
        if overlap:
            launched = output.launch(specs)
            if self._inflight is not None:
                self._settle(out)
            for i, s in enumerate(rows):
                s.pending, s.row = 1, i
            for pre, i in ends:
                pre.pending, pre.row = 1, i
            self._inflight = (launched, rows + [pre for pre, _ in ends])
            return out
        for s in rows:
            self._register_full_blocks(s)
        device = ends or any(not s.client.needs_host_logits for s in rows)
        toks = output.sample(specs) if device else [None] * len(tokens)
        for i, s in enumerate(rows):
            self._choose(s, output, i, toks[i], out)
        for pre, i in ends:
            self._choose(pre, output, i, toks[i], out)
        return out

    def _settle(self, out: StepOutput) -> None:
        """Read the step in flight and hand its tokens to their sequences (those still decoding)."""
        launched, rows = self._inflight
        self._inflight = None
        toks = launched.wait().tolist()
        for s in rows:
            tok = toks[s.row]
            if s.pending:
                s.pending = 0
                if s.state == DECODE:
                    self._emit(s, tok, out)

    @staticmethod
    def _row_spec(seq: Sequence) -> RowSampling:
        return seq.client.row_sampling(seq.generated + seq.pending)

    @staticmethod
    def _step_specs(rows: list[Sequence], n: int | None = None, ends: Seq[tuple[Sequence, int]] = ()) -> np.ndarray:
        """The device sampling rows of a decode step of ``n`` rows (default: ``len(rows)``), packed
        (:func:`realizar.sampling.pack_specs`): each sequence's row packed once, its step set here (a row
        chosen on the host: greedy, ignored); after the decode rows, prompt rows greedy (their tokens are
        dropped) but the row that ends a prompt (``ends``: (sequence, row)): that sequence's first token."""
        for s in rows + [pre for pre, _ in ends]:
            if s.spec_words is None:
                spec = RowSampling() if s.client.needs_host_logits else s.client.row_sampling(0)
                s.spec_words = pack_specs([spec])[0]
        n = len(rows) if n is None else n
        if n == len(rows):
            words = np.stack([s.spec_words for s in rows])
        else:
            words = np.zeros((n, len(_GREEDY)), np.uint32)
            words[:] = _GREEDY
            if rows:
                words[: len(rows)] = np.stack([s.spec_words for s in rows])
            for pre, i in ends:
                words[i] = pre.spec_words
        words[: len(rows), STEP_WORD] = [s.generated + s.pending for s in rows]
        for pre, i in ends:
            words[i, STEP_WORD] = pre.generated
        return words

    def _ensure_block(self, seq: Sequence, out: StepOutput) -> bool:
        """A block for ``seq``'s next position, preempting the youngest sequences as needed; False
        when ``seq`` itself was the one preempted."""
        if seq.num_computed // self.block_size < len(seq.blocks):
            return True
        while self.pool.num_available == 0:
            victim = max(self.running, key=lambda s: s.order)
            self._preempt(victim, out)
            if victim is seq:
                return False
        seq.blocks += self.pool.allocate(1)
        return True
