"""Logprobs in the generation loop: each TokenChunk's logprob and top-N are the log-softmax of that
step's raw logits (before penalties and processors), and logits that live on a device are read to
the host only when logprobs are asked for."""

from __future__ import annotations

import numpy as np
import pytest

from realizar.errors import InvalidRequestError
from realizar.generation import Generator, SamplingParams
from realizar.sampling import log_softmax
from tests.test_generation import PIECES, ByteTokenizer


class DeviceLikeLogits:
    """Stands in for the GPU model's DeviceLogits: counts host reads and on-device argmaxes."""

    def __init__(self, host: np.ndarray, counts: dict):
        self.host, self.counts = host, counts

    def greedy_token(self) -> int:
        self.counts["argmax"] += 1
        return int(np.argmax(self.host))

    def __array__(self, dtype=None, copy=None):
        self.counts["host"] += 1
        return self.host if dtype is None else self.host.astype(dtype)


class RandomDeviceModel:
    """Drawn (never constant) logits per step, handed out as device-like objects."""

    def __init__(self, vocab: int, seed: int, context_length: int = 64):
        self.vocab, self.context_length = vocab, context_length
        self.rng = np.random.default_rng(seed)
        self.counts = {"host": 0, "argmax": 0}
        self.given: list[np.ndarray] = []

    def reset(self):
        pass

    def _next(self):
        z = (self.rng.standard_normal(self.vocab) * 2).astype(np.float32)
        z[0] = -30.0  # keep away from EOS so every run has its full length
        self.given.append(z)
        return DeviceLikeLogits(z, self.counts)

    def prefill(self, ids):
        return self._next()

    def decode(self, tok):
        return self._next()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunk_logprobs_are_the_raw_log_softmax(seed):
    model = RandomDeviceModel(len(PIECES), seed)
    gen = Generator(model, ByteTokenizer(PIECES))
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=seed, logprobs=3, presence_penalty=1.5,
                            frequency_penalty=0.5, repetition_penalty=1.3)  # fmt: skip
    chunks = list(gen.stream("prompt text", params))
    assert len(chunks) == 6 and model.counts["argmax"] == 0
    for c, z in zip(chunks, model.given):
        lp = log_softmax(z.astype(np.float64))
        assert c.logprob == pytest.approx(lp[c.token_id], abs=1e-12)
        want = sorted(range(len(z)), key=lambda i: (-lp[i], i))[:3]
        assert [t for t, _ in c.top_logprobs] == want
        np.testing.assert_allclose([v for _, v in c.top_logprobs], lp[want], atol=1e-12)


def test_no_logprobs_keeps_the_on_device_greedy_path():
    model = RandomDeviceModel(len(PIECES), 5)
    chunks = list(Generator(model, ByteTokenizer(PIECES)).stream("p", SamplingParams(max_tokens=4)))
    assert model.counts == {"host": 0, "argmax": 4}
    assert all(c.logprob is None and c.top_logprobs is None for c in chunks)
    model = RandomDeviceModel(len(PIECES), 5)
    chunks = list(Generator(model, ByteTokenizer(PIECES)).stream("p", SamplingParams(max_tokens=4, logprobs=0)))
    assert model.counts == {"host": 4, "argmax": 0}  # one read per step, shared by logprobs and the sampler
    assert all(c.top_logprobs == () for c in chunks)
    assert [c.token_id for c in chunks] == [int(np.argmax(z)) for z in model.given]


def test_processors_do_not_change_reported_logprobs():
    model = RandomDeviceModel(len(PIECES), 9)

    def ban_argmax(generated, logits):
        out = logits.copy()
        out[int(np.argmax(out))] = -np.inf
        return out

    chunks = list(Generator(model, ByteTokenizer(PIECES)).stream(
        "p", SamplingParams(max_tokens=3, logprobs=1, logits_processors=(ban_argmax,))))  # fmt: skip
    for c, z in zip(chunks, model.given):
        lp = log_softmax(z.astype(np.float64))
        assert c.token_id != int(np.argmax(z)) and c.top_logprobs[0][0] == int(np.argmax(z))
        assert c.logprob == pytest.approx(lp[c.token_id], abs=1e-12)


@pytest.mark.parametrize("bad", [{"logprobs": -1}, {"logprobs": 1.5}, {"seed": -5}, {"seed": 2**64}])
def test_invalid_logprobs_and_seed(bad):
    with pytest.raises(InvalidRequestError, match=next(iter(bad))):
        SamplingParams(**bad).validate()
