"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition, presence and
frequency penalties; and the model's own log-probabilities (:func:`log_softmax`, :func:`top_logprobs`).

Order of operations (the same as transformers' default logits processors, with OpenAI's additive
penalties first): presence/frequency penalty → repetition penalty → (temperature 0: argmax) →
temperature → top-k → top-p → draw from the softmax.
The draw uses a ``numpy.random.Generator`` so a seed reproduces a sequence exactly.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from realizar.errors import InvalidRequestError, ModelOutputError, ShapeError

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
    "RowSampling",
    "SPEC_WORDS",
    "pack_specs",
    "sample_rows",
    "unpack_specs",
    "top_p_margin",
]


def _check_logits(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise InvalidRequestError(f"expected a non-empty 1-D logits vector, got shape {logits.shape}")
    if np.isnan(logits).any():
        raise ModelOutputError("the model's logits contain NaN")
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


# --------------------------------------------------------------------------------------------------
# Batched sampling with a counter-based RNG: the NumPy mirror of the device kernel ``sample_rows``
# (ptx_gen/kernels/sample_rows.py). Every step below is an f32 operation with one IEEE rounding
# (multiply, add, subtract, divide) or exact integer arithmetic, so the kernel reproduces it bit for
# bit; the only approximate part is the top-p mass (exp and a sum whose order differs), which only
# matters when a cumulative mass lies within ~1e-6 of ``top_p * total`` (see :func:`top_p_margin`).
#
#   temperature 0: argmax of the logits (lowest index on ties).
#   otherwise, for token t of a row with spec (T, k, p, seed, step):
#     z_t   = f32(logit_t * f32(1 / T))
#     top-k : kth = the k-th largest z (with multiplicity); kept = {z_t >= kth}   (k = 0 or k >= V: all)
#     top-p : w_t = exp(z_t - max z) over the kept tokens, S = sum w; tau = the largest z value v with
#             sum_{z_t >= v} w_t >= p * S; kept &= {z_t >= tau}    (p = 1: no cut; ties at tau kept)
#     u_t   = f32((hash(seed, step, t) >> 8) | 1) * 2**-24              (odd multiples of 2**-24)
#     key_t = z_t - flog(-flog(u_t))                                   (Gumbel noise, f32)
#     token = argmax over kept t of key_t (lowest index on ties)
#
#   fmix32(x): x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16 (mod 2**32)
#   row key  = fmix32(fmix32(fmix32(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ step)
#   hash(t)  = fmix32(fmix32(t ^ row key) + row key)
#   flog(x)  : see :func:`_flog32` (exponent split, atanh series; f32 ops in a fixed order).
# --------------------------------------------------------------------------------------------------

_HASH_M1, _HASH_M2, _GOLDEN = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9
_SQRT2_BITS = 0x3FB504F3  # f32(sqrt(2)); mantissas above it are halved so that m is in [sqrt(1/2), sqrt(2)]
_LOG_C3, _LOG_C5, _LOG_C7, _LOG_C9 = (np.float32(1 / 3), np.float32(1 / 5), np.float32(1 / 7), np.float32(1 / 9))
_LN2_HI = np.float32(np.uint32(0x3F317200).view(np.float32))  # ln 2 to 16 bits: e * _LN2_HI is exact
_LN2_LO = np.float32(np.log(2.0) - float(_LN2_HI))
_MAX_SEED, _MAX_STEP = 1 << 64, 1 << 32


@dataclass(frozen=True)
class RowSampling:
    """How one row of a batch is sampled on the device (or by :func:`sample_rows`).

    ``temperature`` 0 means greedy; ``top_k`` 0 keeps every token; ``top_p`` 1 keeps every token;
    ``seed`` (0 .. 2**64-1) and ``step`` (0 .. 2**32-1, the index of the token being sampled) select
    the random numbers, so a request gives the same tokens alone or in any batch."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    step: int = 0

    def __post_init__(self) -> None:
        validate(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, repetition_penalty=1.0)
        if self.temperature != 0.0:
            with np.errstate(over="ignore", divide="ignore"):
                t32 = np.float32(self.temperature)
                if not (np.isfinite(t32) and t32 > 0 and np.isfinite(np.float32(1.0) / t32)):
                    raise InvalidRequestError(
                        f"temperature must be 0 or a float32 with a finite reciprocal, got {self.temperature}")
        if self.top_k >= 1 << 32:
            raise InvalidRequestError(f"top_k must be below 2**32, got {self.top_k}")
        for name, value, limit in (("seed", self.seed, _MAX_SEED), ("step", self.step, _MAX_STEP)):
            if isinstance(value, bool) or int(value) != value or not 0 <= value < limit:
                raise InvalidRequestError(f"{name} must be an integer in [0, {limit}), got {value!r}")


    def at_step(self, step: int) -> "RowSampling":
        """This spec for token index ``step``: only ``step`` is checked (the other fields were when this
        spec was made), so a serving loop pays no validation per row and token."""
        if isinstance(step, bool) or int(step) != step or not 0 <= step < _MAX_STEP:
            raise InvalidRequestError(f"step must be an integer in [0, {_MAX_STEP}), got {step!r}")
        new = object.__new__(RowSampling)
        for name in ("temperature", "top_k", "top_p", "seed"):
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "step", int(step))
        return new


# the device sampler's row layout (ptx_gen.kernels.sampling.sample_rows): u32 [temperature f32 bits, top_k,
# top_p f32 bits, seed & 0xFFFFFFFF, seed >> 32, step, 0, 0]; temperature and top_p rounded as np.float32 rounds
SPEC_WORDS = 8
STEP_WORD = 5
_ROW = struct.Struct("<fIfIII8x")
assert _ROW.size == 4 * SPEC_WORDS


def pack_specs(specs: Sequence[RowSampling], out: np.ndarray | None = None) -> np.ndarray:
    """The device layout of ``specs``: u32 ``[len(specs), SPEC_WORDS]`` rows (above). ``out`` (u32, at least that
    many rows) is filled in place, e.g. a pinned staging array; ``specs`` already packed (a u32 ``[n, 8]``
    array, e.g. a serving step's rows with their steps set) are copied."""
    n = len(specs)
    if out is None:
        out = np.zeros((n, SPEC_WORDS), np.uint32)
    elif out.dtype != np.uint32 or out.ndim != 2 or out.shape[1] != SPEC_WORDS or out.shape[0] < n:
        raise ShapeError(f"expected a u32 [>= {n}, {SPEC_WORDS}] array, got {out.dtype} {out.shape}")
    if isinstance(specs, np.ndarray):
        if specs.dtype != np.uint32 or specs.ndim != 2 or specs.shape[1] != SPEC_WORDS:
            raise ShapeError(f"packed specs must be u32 [n, {SPEC_WORDS}], got {specs.dtype} {specs.shape}")
        out[:n] = specs
        return out
    if n > 1 and all(s is specs[0] for s in specs):  # (one spec object for every row, as a batch of greedy rows)
        out[:n] = pack_specs(specs[:1])[0]
        return out
    packed = bytearray(n * _ROW.size)  # packed in Python and copied once: a serving step packs every row
    for i, s in enumerate(specs):
        if not isinstance(s, RowSampling):
            raise InvalidRequestError(f"expected RowSampling specs, got {type(s).__name__} at row {i}")
        seed = int(s.seed)
        _ROW.pack_into(packed, i * _ROW.size, s.temperature, int(s.top_k), s.top_p, seed & 0xFFFFFFFF, seed >> 32,
                       int(s.step))
    out[:n] = np.frombuffer(packed, np.uint32).reshape(n, SPEC_WORDS)
    return out


def unpack_specs(words: np.ndarray) -> list[RowSampling]:
    """The RowSampling of each packed row (what :func:`pack_specs` made)."""
    out = []
    for row in np.asarray(words, np.uint32).reshape(-1, SPEC_WORDS):
        t, k, p, lo, hi, step = _ROW.unpack(row.tobytes())
        spec = object.__new__(RowSampling)  # (values that were checked when they were packed)
        for name, value in (("temperature", float(t)), ("top_k", k), ("top_p", float(p)), ("seed", lo | hi << 32),
                            ("step", step)):
            object.__setattr__(spec, name, value)
        out.append(spec)
    return out


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.uint32).copy()
    x ^= x >> np.uint32(16)
    x *= np.uint32(_HASH_M1)
    x ^= x >> np.uint32(13)
    x *= np.uint32(_HASH_M2)
    x ^= x >> np.uint32(16)
    return x


def row_key(seed: int, step: int) -> int:
    """The per-row RNG key: fmix32(fmix32(fmix32(seed_lo ^ golden) ^ seed_hi) ^ step)."""
    lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32)
    k = _fmix32(np.array([lo ^ np.uint32(_GOLDEN)], np.uint32))
    k = _fmix32(k ^ hi)
    return int(_fmix32(k ^ np.uint32(step))[0])


def hash_uniform(seed: int, step: int, tokens: np.ndarray) -> np.ndarray:
    """u = f32((hash(seed, step, t) >> 8) | 1) * 2**-24 for every token id t: float32 in (0, 1)."""
    key = np.uint32(row_key(seed, step))
    h = _fmix32(_fmix32(np.asarray(tokens, np.uint32) ^ key) + key)
    return ((h >> np.uint32(8)) | np.uint32(1)).astype(np.float32) * np.float32(2.0**-24)


def _flog32(x: np.ndarray) -> np.ndarray:
    """Natural log of positive normal float32 values, with f32 operations in a fixed order (each one
    IEEE-rounded, none fused) so the kernel computes the same bits. Accurate to a few ulp."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    e = (bits >> np.uint32(23)).astype(np.int32) - 127
    mb = (bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)
    big = mb > np.uint32(_SQRT2_BITS)
    mb = np.where(big, mb - np.uint32(0x00800000), mb).astype(np.uint32)
    e = e + big.astype(np.int32)
    m = mb.view(np.float32)
    one = np.float32(1.0)
    s = (m - one) / (m + one)
    s2 = s * s
    p = _LOG_C9 * s2
    p = p + _LOG_C7
    p = p * s2
    p = p + _LOG_C5
    p = p * s2
    p = p + _LOG_C3
    p = p * s2
    r = s * p
    r = r + s
    r = r + r
    ef = e.astype(np.float32)
    r = r + ef * _LN2_LO
    return ef * _LN2_HI + r


def gumbel_keys(z: np.ndarray, seed: int, step: int) -> np.ndarray:
    """key_t = z_t - flog(-flog(u_t)) in float32 (z_t + Gumbel noise)."""
    u = hash_uniform(seed, step, np.arange(z.shape[0], dtype=np.uint32))
    return np.asarray(z, np.float32) - _flog32(-_flog32(u))


def _top_k_floor(z: np.ndarray, k: int) -> np.float32:
    if k <= 0 or k >= z.shape[0]:
        return np.float32(-np.inf)
    return np.partition(z, z.shape[0] - k)[z.shape[0] - k]


def _top_p_cut(z: np.ndarray, floor: np.float32, p: float) -> tuple[np.float32, float]:
    """(tau, margin): the top-p threshold among tokens with z >= floor, and how close (relative to
    the kept mass) the cumulative mass at tau or at the next larger value comes to ``p * S``."""
    kept = z[z >= floor]
    if p >= 1.0:
        return np.float32(floor), np.inf
    vals, inv = np.unique(kept, return_inverse=True)  # ascending
    w = np.exp(kept.astype(np.float64) - float(kept.max()))
    mass = np.bincount(inv.ravel(), weights=w, minlength=vals.shape[0])[::-1]  # descending values
    cum = np.cumsum(mass)
    total = cum[-1]
    target = p * total
    j = int(np.searchsorted(cum, target, side="left"))  # first cum >= target
    j = min(j, cum.shape[0] - 1)
    margin = abs(cum[j] - target)
    if j > 0:
        margin = min(margin, abs(cum[j - 1] - target))
    return vals[::-1][j], float(margin / total)


def top_p_margin(logits: np.ndarray, spec: RowSampling) -> float:
    """How far (relative to the kept mass) the top-p cut of one row is from flipping: rows under
    ~1e-5 may legitimately differ between the kernel and :func:`sample_rows` (f32 sums in another
    order); ``inf`` when the row has no top-p cut."""
    if spec.temperature == 0.0 or spec.top_p >= 1.0:
        return np.inf
    z = np.asarray(logits, np.float32) * (np.float32(1.0) / np.float32(spec.temperature))
    return _top_p_cut(z, _top_k_floor(z, spec.top_k), spec.top_p)[1]


def sample_rows(logits: np.ndarray, specs: Sequence[RowSampling]) -> np.ndarray:
    """One token per row of ``logits`` [B, V] (float32; finite or -inf, at least one finite value a
    row) drawn as the device kernel draws it (semantics above). Returns int64 [B]."""
    x = np.asarray(logits)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ShapeError(f"expected logits of shape [B, V] with V >= 1, got shape {x.shape}")
    if len(specs) != x.shape[0]:
        raise ShapeError(f"expected one RowSampling per row: {x.shape[0]} rows, got {len(specs)} specs")
    if x.shape[1] >= 1 << 31:
        raise ShapeError(f"expected a vocabulary below 2**31, got {x.shape[1]}")
    x = x.astype(np.float32, copy=False)
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ModelOutputError("the model's logits contain NaN or +inf")
    if not np.isfinite(x).any(axis=1).all():
        raise InvalidRequestError("every row of logits needs at least one finite value")
    out = np.empty(x.shape[0], dtype=np.int64)
    for i, spec in enumerate(specs):
        if not isinstance(spec, RowSampling):
            raise InvalidRequestError(f"expected RowSampling specs, got {type(spec).__name__} at row {i}")
        row = x[i]
        if spec.temperature == 0.0:
            out[i] = int(np.argmax(row))
            continue
        with np.errstate(over="ignore"):
            z = row * (np.float32(1.0) / np.float32(spec.temperature))
        if np.isposinf(z).any():
            raise InvalidRequestError(f"row {i}: logits / temperature overflow float32 (temperature {spec.temperature})")
        floor = _top_k_floor(z, spec.top_k)
        tau, _ = _top_p_cut(z, floor, spec.top_p)
        key = gumbel_keys(z, spec.seed, spec.step)
        key = np.where(z >= tau, key, np.float32(-np.inf))
        out[i] = int(np.argmax(key))
    return out
