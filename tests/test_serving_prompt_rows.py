"""Prompt chunks as rows of the decode step (:mod:`realizar.serving.scheduler`), on the CPU: while a stream
decodes, new prompts are prefilled as extra rows of its decode steps (the backend's ``prefill`` is not called,
no step holds more rows than the backend takes), and every request's tokens are those it gets alone (greedy,
seeded sampling, a stop token); a request whose tokens are chosen on the host (logprobs) still goes through
``prefill``, with its logprobs unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.engine import load_engine
from realizar.generation import SamplingParams
from realizar.serving import ServingEngine
from realizar.serving.cpu_backend import ReferenceBatchBackend
from realizar.serving.scheduler import MIN_PREFILL_ROWS
from tests.helpers import examples
from tests.model_factory import make_hf_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf_dir, _ = make_hf_model("llama", tmp_path_factory.mktemp("rows"), seed=7, max_position_embeddings=1024)
    return load_engine(hf_dir, device="cpu")


class _Counting(ReferenceBatchBackend):
    """The reference backend, counting its prefill calls and the rows of its decode steps."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.prefill_calls, self.step_rows = 0, []

    def prefill(self, tokens, start, block_table):
        self.prefill_calls += 1
        return super().prefill(tokens, start, block_table)

    def decode(self, tokens, positions, block_tables):
        self.step_rows.append(len(tokens))
        return super().decode(tokens, positions, block_tables)


def _serving(engine, max_batch: int, budget: int = 2048) -> tuple[ServingEngine, _Counting]:
    backend = _Counting(engine.model, 200, 16, max_batch=max_batch)
    return ServingEngine(backend, engine.tokenizer, (), max_batched_tokens=budget, background=False), backend


def _alone(engine, prompt: list[int], params: SamplingParams) -> list[int]:
    serving, _ = _serving(engine, 8)
    h = serving.submit(prompt, params)
    while not h.done:
        serving.step()
    return list(h.result.token_ids)


def _params(kind: int, seed: int) -> SamplingParams:
    if kind == 0:
        return SamplingParams(max_tokens=6, temperature=0)
    if kind == 1:
        return SamplingParams(max_tokens=5, temperature=0.9, top_k=40, seed=seed)
    return SamplingParams(max_tokens=7, temperature=0, stop_token_ids=(11, 12, 13))


@settings(max_examples=examples(5), deadline=None)
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(2, 90), min_size=1, max_size=4),
       kinds=st.lists(st.integers(0, 2), min_size=4, max_size=4))
def test_prompts_ride_in_the_decode_step_while_a_stream_runs(engine, seed, lengths, kinds):
    serving, backend = _serving(engine, max_batch=64)
    rng = np.random.default_rng(seed)
    stream = serving.submit(rng.integers(3, 300, 10).tolist(), SamplingParams(max_tokens=60, temperature=0))
    while stream._seq is None or stream._seq.generated < 2:
        serving.step()
    calls = backend.prefill_calls
    prompts = [rng.integers(3, 300, n).tolist() for n in lengths]
    params = [_params(k, seed + i) for i, k in enumerate(kinds[: len(prompts)])]
    handles = [serving.submit(p, q) for p, q in zip(prompts, params)]
    rows_seen = False
    while not all(h.done for h in handles):
        out = serving.step()
        rows_seen |= out.decode_batch > 0 and any(n for _, _, n in out.prefills)
    assert backend.prefill_calls == calls, "a prompt went through prefill while the stream decoded"
    assert rows_seen and max(backend.step_rows) <= backend.max_batch
    for p, q, h in zip(prompts, params, handles):
        assert list(h.result.token_ids) == _alone(engine, p, q)
    while not stream.done:
        serving.step()
    assert stream.result.completion_tokens == 60


def test_few_free_rows_or_host_chosen_tokens_take_the_prefill_path(engine):
    """A prompt longer than the rows left (fewer than MIN_PREFILL_ROWS) and a logprobs request go through
    ``prefill``; their results are as alone."""
    serving, backend = _serving(engine, max_batch=4)
    rng = np.random.default_rng(3)
    streams = [serving.submit(rng.integers(3, 300, 6).tolist(), SamplingParams(max_tokens=30, temperature=0))
               for _ in range(3)]
    while any(s._seq is None or s._seq.generated < 1 for s in streams):
        serving.step()
    assert backend.max_batch - 3 < MIN_PREFILL_ROWS
    long_prompt = rng.integers(3, 300, 40).tolist()
    calls = backend.prefill_calls
    h = serving.submit(long_prompt, SamplingParams(max_tokens=4, temperature=0))
    while not h.done:
        serving.step()
    assert backend.prefill_calls > calls
    assert list(h.result.token_ids) == _alone(engine, long_prompt, SamplingParams(max_tokens=4, temperature=0))

    serving, backend = _serving(engine, max_batch=64)
    stream = serving.submit(rng.integers(3, 300, 6).tolist(), SamplingParams(max_tokens=30, temperature=0))
    while stream._seq is None or stream._seq.generated < 1:
        serving.step()
    calls = backend.prefill_calls
    lp = SamplingParams(max_tokens=3, temperature=0, logprobs=2)
    prompt = rng.integers(3, 300, 25).tolist()
    got, want = [], []
    h = serving.submit(prompt, lp, sink=lambda _h, c: got.append(c) if c is not None else None)
    while not h.done:
        serving.step()
    assert backend.prefill_calls > calls
    alone, _ = _serving(engine, 8)
    a = alone.submit(prompt, lp, sink=lambda _h, c: want.append(c) if c is not None else None)
    while not a.done:
        alone.step()
    assert [c.token_id for c in got] == [c.token_id for c in want] == list(a.result.token_ids)
    assert np.allclose([c.logprob for c in got], [c.logprob for c in want], rtol=1e-5, atol=1e-6)
    assert [[t for t, _ in c.top_logprobs] for c in got] == [[t for t, _ in c.top_logprobs] for c in want]
