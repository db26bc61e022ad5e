"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition, presence and
frequency penalties; and the model's own log-probabilities (:func:`log_softmax`, :func:`top_logprobs`).

Order of operations (the same as transformers' default logits processors, with OpenAI's additive
penalties first): presence/frequency penalty → repetition penalty → (temperature 0: argmax) →
temperature → top-k → top-p → draw from the softmax.
The draw uses a ``numpy.random.Generator`` so a seed reproduces a sequence exactly.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from realizar.errors import InvalidRequestError

__all__ = [
    "greedy",
    "apply_repetition_penalty",
    "apply_presence_frequency_penalty",
    "log_softmax",
    "top_logprobs",
    "apply_top_k",
    "apply_top_p",
    "probabilities",
    "sample_token",
    "Sampler",
]


def _check_logits(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise InvalidRequestError(f"expected a non-empty 1-D logits vector, got shape {logits.shape}")
    if np.isnan(logits).any():
        raise InvalidRequestError("logits contain NaN")
    return logits


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit (the first one on ties)."""
    return int(np.argmax(_check_logits(logits)))


def apply_repetition_penalty(logits: np.ndarray, previous: Iterable[int], penalty: float) -> np.ndarray:
    """CTRL-style penalty on every token id in ``previous``: positive logits are divided by
    ``penalty``, negative ones multiplied. Returns a new float64 array (``penalty == 1`` is a no-op)."""
    out = np.array(logits, dtype=np.float64)
    if penalty == 1.0:
        return out
    ids = np.unique(np.fromiter(previous, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < out.shape[0])]
    if ids.size:
        vals = out[ids]
        out[ids] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def apply_presence_frequency_penalty(
    logits: np.ndarray, generated: Iterable[int], presence: float, frequency: float
) -> np.ndarray:
    """OpenAI's additive penalties over the tokens generated so far (not the prompt): each token id
    seen ``c > 0`` times has ``presence + frequency * c`` subtracted from its logit (negative values
    encourage repeats). Returns a new float64 array."""
    out = np.array(logits, dtype=np.float64)
    if presence == 0.0 and frequency == 0.0:
        return out
    ids = np.fromiter(generated, dtype=np.int64)
    ids = ids[(ids >= 0) & (ids < out.shape[0])]
    if ids.size:
        seen, counts = np.unique(ids, return_counts=True)
        out[seen] -= presence + frequency * counts
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities in float64 (stable: the maximum is subtracted first)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - np.max(z)
    return z - np.log(np.exp(z).sum())


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely ``(token_id, logprob)`` pairs, most likely first (lower id on ties)."""
    n = min(int(n), logprobs.shape[0])
    if n <= 0:
        return []
    part = np.argpartition(-logprobs, n - 1)[:n]
    order = part[np.lexsort((part, -logprobs[part]))]
    return [(int(i), float(logprobs[i])) for i in order]


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the ``k`` largest logits (ties at the boundary are all kept); others become -inf.
    ``k <= 0`` or ``k >= vocab`` keeps everything."""
    if k <= 0 or k >= logits.shape[0]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits >= kth, logits, -np.inf)


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability mass reaches
    ``p`` (at least one token); others become -inf. ``p >= 1`` keeps everything."""
    if p >= 1.0:
        return logits
    probs = probabilities(logits)
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    # Tokens whose preceding mass already reaches p are dropped; the first token is always kept.
    # (A 1e-9 slack so that e.g. 0.5 + 0.3 "reaches" 0.8 despite rounding.)
    keep_n = int(np.searchsorted(cum, p - 1e-9, side="left")) + 1
    keep_n = min(max(keep_n, 1), logits.shape[0])
    out = np.full_like(logits, -np.inf)
    kept = order[:keep_n]
    out[kept] = logits[kept]
    return out


def probabilities(logits: np.ndarray) -> np.ndarray:
    """Softmax in float64 (stable: the maximum is subtracted first)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - np.max(z)
    e = np.exp(z)
    return e / e.sum()


def sample_token(
    logits: np.ndarray,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    previous: Iterable[int] = (),
    rng: np.random.Generator | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    generated: Iterable[int] = (),
) -> int:
    """Pick one token id. ``temperature == 0`` means greedy (after the penalties). The repetition
    penalty looks at ``previous`` (prompt and output), presence/frequency at ``generated`` only."""
    validate(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
             presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)  # fmt: skip
    z = apply_presence_frequency_penalty(_check_logits(logits), generated, presence_penalty, frequency_penalty)
    z = apply_repetition_penalty(z, previous, repetition_penalty)
    if temperature == 0.0:
        return int(np.argmax(z))
    z = z / temperature
    z = apply_top_k(z, top_k)
    z = apply_top_p(z, top_p)
    probs = probabilities(z)
    if rng is None:
        rng = np.random.default_rng()
    # Inverse-CDF draw: one uniform number per token, so a seed fixes the whole sequence.
    u = rng.random()
    idx = int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] == 0.0 and idx > 0:  # never land on a filtered token through rounding
        idx -= 1
    return idx


def validate(
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    repetition_penalty: float,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
) -> None:
    if not (temperature >= 0.0 and np.isfinite(temperature)):
        raise InvalidRequestError(f"temperature must be a finite number >= 0, got {temperature}")
    if int(top_k) != top_k or top_k < 0:
        raise InvalidRequestError(f"top_k must be an integer >= 0, got {top_k}")
    if not (0.0 < top_p <= 1.0):
        raise InvalidRequestError(f"top_p must be in (0, 1], got {top_p}")
    if not (repetition_penalty > 0.0 and np.isfinite(repetition_penalty)):
        raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {repetition_penalty}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (-2.0 <= value <= 2.0):
            raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}")


class Sampler:
    """Sampling settings plus a seeded random generator; call it with logits and the history."""

    def __init__(
        self,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
    ):
        validate(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty)  # fmt: skip
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.repetition_penalty = float(repetition_penalty)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.rng = np.random.default_rng(seed)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax can be taken where they live."""
        return (self.temperature == 0.0 and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0 and self.frequency_penalty == 0.0)  # fmt: skip

    def __call__(self, logits: np.ndarray, previous: Iterable[int] = (), generated: Iterable[int] = ()) -> int:
        """``previous``: prompt and output ids (repetition penalty); ``generated``: output ids only
        (presence and frequency penalties)."""
        if self.plain_greedy and hasattr(logits, "greedy_token"):
            return int(logits.greedy_token())  # logits still on the GPU: read only the argmax there
        return sample_token(
            logits,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            previous=previous,
            rng=self.rng,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            generated=generated,
        )
