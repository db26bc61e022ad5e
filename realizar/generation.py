"""Text generation: prompt → prefill → sample/decode loop, streaming text with exact stop strings.

The model object only needs ``prefill(ids) -> logits``, ``decode(id) -> logits``, ``reset()`` and
``context_length`` (the NumPy :class:`~realizar.models.reference.ReferenceModel` or the GPU model). The tokenizer needs ``encode(text) -> list[int]``, ``eos_token_ids`` and
``stream_decoder(skip_special_tokens=True)`` returning an object with ``step(id) -> str`` and
``flush() -> str`` (:class:`realizar.text.tokenizer.StreamDecoder`: control tokens the model emits
are not shown as text).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from realizar.errors import ContextOverflowError, InvalidRequestError
from realizar.sampling import Sampler, log_softmax, top_logprobs, validate

__all__ = [
    "SamplingParams",
    "TokenChunk",
    "GenerationResult",
    "GenerationStream",
    "Generator",
    "StopStringMatcher",
    "SequenceState",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to generate. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable
    those filters; ``seed`` makes sampling reproducible; generation ends at ``max_tokens``, at an
    end-of-sequence token (the tokenizer's EOS ids plus ``stop_token_ids``) or just before the first
    occurrence of any ``stop`` string, which is never emitted. ``presence_penalty`` and
    ``frequency_penalty`` are OpenAI's (over the generated tokens). ``logprobs``: None, or how many
    of the most likely tokens each :class:`TokenChunk` lists besides the chosen token's logprob.
    ``priority``: where a serving engine schedules the request: a lower value is admitted first and
    preempted last (equal values: first come, first served)."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: callables ``fn(generated_ids, logits) -> logits`` applied in order to each step's logits (a
    #: float32 host copy) before sampling: constraints (a -inf mask), penalties, biases
    logits_processors: tuple = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    priority: int = 0

    @property
    def needs_host_logits(self) -> bool:
        """True when choosing a token needs the whole logits row on the host: logprobs, logits
        processors or a penalty (which depends on the sequence's history)."""
        return (self.logprobs is not None or bool(self.logits_processors) or self.repetition_penalty != 1.0
                or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)  # fmt: skip

    def validate(self) -> None:
        if int(self.max_tokens) != self.max_tokens or self.max_tokens < 0:
            raise InvalidRequestError(f"max_tokens must be an integer >= 0, got {self.max_tokens}")
        validate(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )
        if self.seed is not None and (int(self.seed) != self.seed or not 0 <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [0, 2**64), got {self.seed}")
        if isinstance(self.priority, bool) or int(self.priority) != self.priority or abs(self.priority) >= 2**31:
            raise InvalidRequestError(f"priority must be an integer in (-2**31, 2**31), got {self.priority!r}")
        if self.logprobs is not None and (int(self.logprobs) != self.logprobs or self.logprobs < 0):
            raise InvalidRequestError(f"logprobs must be None or an integer >= 0, got {self.logprobs}")
        if isinstance(self.stop, str):
            raise InvalidRequestError("stop must be a tuple of strings, not a single string")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {self.stop!r}")


@dataclass(frozen=True)
class TokenChunk:
    """One generated token and the text it released (possibly ``""``: an incomplete UTF-8 sequence,
    text held back because it may begin a stop string, or the end-of-sequence token). When
    ``SamplingParams.logprobs`` is set: ``logprob`` of this token and the ``top_logprobs``
    ``(token_id, logprob)`` pairs, most likely first, from the log-softmax of the model's raw logits
    (before penalties, processors and temperature)."""

    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length"
    prefill_seconds: float
    decode_seconds: float

    @property
    def decode_tokens_per_second(self) -> float:
        n = self.completion_tokens - 1  # the first token comes out of the prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


# ----------------------------------------------------------------------------------------------
# Stop strings
# ----------------------------------------------------------------------------------------------


class StopStringMatcher:
    """Cuts a stream of text deltas before the first stop string to be completed.

    Text that might be the beginning of a stop string is held back until it is clear either way, so
    a stop string split across tokens is still caught and no part of it is ever emitted.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add ``delta``; return the text safe to emit now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text
        # The stop string that completes first (smallest end; on a tie the longer one) wins, so the
        # result does not depend on how the text was split into deltas.
        best: tuple[int, int] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best = (i + len(s), i)
        if best is not None:
            cut = best[1]
            self.stopped = True
            self.held = ""
            return text[:cut]
        hold = 0
        for s in self.stops:
            for m in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:m]):
                    hold = m
                    break
        self.held = text[len(text) - hold :]
        return text[: len(text) - hold]

    def release(self) -> str:
        """End of generation: the held text was not a stop string after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def _eos_ids(tokenizer: Any) -> tuple[int, ...]:
    ids = getattr(tokenizer, "eos_token_ids", ())
    if callable(ids):
        ids = ids()
    if ids is None:
        return ()
    if isinstance(ids, (int, np.integer)):
        return (int(ids),)
    return tuple(int(i) for i in ids)


# ----------------------------------------------------------------------------------------------
# The generation loop
# ----------------------------------------------------------------------------------------------


class GenerationStream:
    """Iterator of :class:`TokenChunk`; once exhausted, ``result`` holds the :class:`GenerationResult`
    (and ``finish_reason`` the reason). Closing it early stops the generation."""

    def __init__(self, run: Iterator[TokenChunk], state: dict):
        self._run = run
        self._state = state

    def __iter__(self) -> "GenerationStream":
        return self

    def __next__(self) -> TokenChunk:
        return next(self._run)

    def close(self) -> None:
        self._run.close()

    @property
    def prompt_tokens(self) -> int:
        return self._state["prompt_tokens"]

    @property
    def finish_reason(self) -> str | None:
        return self._state.get("finish_reason")

    @property
    def result(self) -> GenerationResult | None:
        return self._state.get("result")


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int]) -> list[int]:
    """The token ids of ``prompt`` (text, encoded by ``tokenizer``, or ids); InvalidRequestError if none."""
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequestError("the prompt is empty (no tokens)")
    return ids


class Generator:
    """Drives a model and a tokenizer: :meth:`stream` yields tokens as they come, :meth:`generate`
    returns the whole :class:`GenerationResult`. The KV cache is reset for every call."""

    def __init__(self, model: Any, tokenizer: Any, eos_token_ids: Sequence[int] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids(tokenizer)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> GenerationStream:
        params = params or SamplingParams()
        params.validate()
        ids = self.encode_prompt(prompt)
        ctx = int(self.model.context_length)
        if len(ids) + params.max_tokens > ctx:
            raise ContextOverflowError(
                f"prompt of {len(ids)} tokens + max_tokens {params.max_tokens} = "
                f"{len(ids) + params.max_tokens} exceeds the context length of {ctx}"
            )
        state: dict = {"prompt_tokens": len(ids)}
        return GenerationStream(self._run(ids, params, state), state)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        on_chunk: Callable[[TokenChunk], None] | None = None,
    ) -> GenerationResult:
        """Generate to the end; ``on_chunk`` (optional) is called with every :class:`TokenChunk`."""
        stream = self.stream(prompt, params)
        for chunk in stream:
            if on_chunk is not None:
                on_chunk(chunk)
        assert stream.result is not None
        return stream.result

    def _run(self, ids: list[int], params: SamplingParams, state: dict) -> Iterator[TokenChunk]:
        seq = SequenceState(ids, params, self.tokenizer, self.eos_token_ids)
        prefill_s = decode_s = 0.0

        def finish_up() -> None:
            state["finish_reason"] = seq.finish_reason
            state["result"] = seq.result(prefill_s, decode_s)

        if params.max_tokens == 0:
            finish_up()
            return

        self.model.reset()
        t0 = time.perf_counter()
        logits = self.model.prefill(ids)
        t_step: float | None = None
        while True:
            logits, logprobs = seq.process_logits(logits)
            tok = seq.sample(logits)
            now = time.perf_counter()
            if t_step is None:
                prefill_s = now - t0  # prefill and the first sample
            else:
                decode_s += now - t_step  # one decode step and its sample
            chunk = seq.accept(tok, logprobs)
            if seq.finished:
                finish_up()
                yield chunk
                return
            yield chunk
            t_step = time.perf_counter()
            logits = self.model.decode(tok)


class SequenceState:
    """The per-sequence half of generation, shared by :class:`Generator` (one sequence) and the
    serving engine (:mod:`realizar.serving`, many sequences in one batch): sampling settings and
    their seeded random generator, the generated ids, streaming text with stop strings, EOS and
    ``max_tokens``, logprobs and logits processors.

    One step: ``logits, logprobs = process_logits(raw)``, ``tok = sample(logits)`` (or a token the
    caller drew elsewhere when :attr:`needs_host_logits` is false), ``chunk = accept(tok, logprobs)``;
    after the chunk that ends the sequence :attr:`finished` is true and :attr:`finish_reason` says why.
    """

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, tokenizer: Any, eos_token_ids: Sequence[int]):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.sampler = Sampler(params.temperature, params.top_k, params.top_p, params.repetition_penalty,
                               params.seed, params.presence_penalty, params.frequency_penalty)  # fmt: skip
        self.stop_ids = set(int(t) for t in eos_token_ids) | {int(t) for t in params.stop_token_ids}
        self.decoder = tokenizer.stream_decoder(skip_special_tokens=True)
        self.matcher = StopStringMatcher(params.stop)
        self.generated: list[int] = []
        self.pieces: list[str] = []
        self.history = list(self.prompt_ids)  # prompt and output: what the repetition penalty sees
        self.finish_reason = "length"
        self.finished = params.max_tokens == 0

    @property
    def needs_host_logits(self) -> bool:
        """True when choosing a token needs the whole logits row on the host (:attr:`SamplingParams.needs_host_logits`)."""
        return self.params.needs_host_logits

    def process_logits(self, logits: Any) -> tuple[Any, np.ndarray | None]:
        """Logprobs of the raw logits (when asked for) and the logits after the processors."""
        params = self.params
        logprobs = None
        if params.logprobs is not None:
            logits = np.asarray(logits)  # a GPU model's logits come to the host only here
            logprobs = log_softmax(logits)
        if params.logits_processors:
            logits = np.array(logits, dtype=np.float32)
            for process in params.logits_processors:
                logits = process(self.generated, logits)
        return logits, logprobs

    def sample(self, logits: Any) -> int:
        """Draw the next token from (processed) logits with this sequence's sampler."""
        return self.sampler(logits, self.history, self.generated)

    def accept(self, tok: int, logprobs: np.ndarray | None = None) -> TokenChunk:
        """Record the next token; returns its :class:`TokenChunk` (the text it releases)."""
        tok = int(tok)
        params = self.params
        matcher, decoder = self.matcher, self.decoder
        self.generated.append(tok)
        self.history.append(tok)
        if tok in self.stop_ids:
            self.finish_reason, self.finished = "stop", True
            tail = matcher.feed(decoder.flush())
            text = tail if matcher.stopped else tail + matcher.release()
        else:
            text = matcher.feed(decoder.step(tok))
            if matcher.stopped:
                self.finish_reason, self.finished = "stop", True
            elif len(self.generated) >= params.max_tokens:
                self.finish_reason, self.finished = "length", True
                text += matcher.feed(decoder.flush())
                if matcher.stopped:
                    self.finish_reason = "stop"
                else:
                    text += matcher.release()
        self.pieces.append(text)
        if logprobs is not None:
            tops = tuple(top_logprobs(logprobs, params.logprobs or 0))
            return TokenChunk(tok, text, float(logprobs[tok]), tops)
        return TokenChunk(tok, text)

    def result(
        self, prefill_seconds: float, decode_seconds: float, finish_reason: str | None = None
    ) -> GenerationResult:
        return GenerationResult(
            text="".join(self.pieces),
            token_ids=list(self.generated),
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.generated),
            finish_reason=finish_reason or self.finish_reason,
            prefill_seconds=prefill_seconds,
            decode_seconds=decode_seconds,
        )
