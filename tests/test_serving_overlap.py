"""Overlapped decode steps (``async_scheduling``): step N + 1 is launched before step N's tokens are read,
its continuing rows fed the tokens where they were sampled.

* ``feed_tokens`` on the PTX emulator against its definition (hypothesis: rows, sources, staged ids).
* The scheduler with overlap gives exactly the tokens and finish reasons it gives without: greedy and
  seeded sampled requests, a stop token met mid-stream (the row already given to the next step is
  dropped), requests with logprobs (their steps run synchronously), a pool tight enough to preempt;
  fed entries are really used, and every block is free at the end. On the NumPy backend and on
  ``GpuBatchBackend`` running the real PTX on the emulator.
* A fed entry without a sampled decode step before it is refused by both backends.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen import catalog
from ptx_gen.emulator import Memory, run as simt_run
from ptx_gen.kernels.sampling.feed import NO_SOURCE
from realizar import cuda
from realizar.engine import load_engine
from realizar.errors import InvalidRequestError
from realizar.generation import SamplingParams
from realizar.serving import ServingEngine
from realizar.serving.backend import fed
from realizar.serving.cpu_backend import ReferenceBatchBackend
from realizar.sampling import RowSampling
from tests.helpers import examples
from tests.model_factory import make_hf_model


@settings(max_examples=examples(20), deadline=None)
@given(data=st.data())
def test_feed_tokens_kernel(data):
    n = data.draw(st.integers(1, 300))
    n_tok = data.draw(st.integers(1, 300))
    block = data.draw(st.sampled_from([64, 256]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(1, 2**31, n_tok, dtype=np.uint32)
    src = np.where(rng.random(n) < data.draw(st.floats(0, 1)), rng.integers(0, n_tok, n), NO_SOURCE).astype(np.uint32)
    staged = rng.integers(1, 2**31, n + 7, dtype=np.uint32)  # (7 more rows past n: never written)
    mem = Memory()
    ids, s, t = mem.alloc_array(staged), mem.alloc_array(src), mem.alloc_array(tokens)
    kern = catalog.emit("feed_tokens", block=block)
    simt_run(kern.ptx, grid=(-(-n // block),), block=(block,), params=dict(ids=ids, src=s, tokens=t, n=n),
             memory=mem)
    want = staged.copy()
    want[:n] = np.where(src != NO_SOURCE, tokens[np.minimum(src, n_tok - 1)], staged[:n])
    np.testing.assert_array_equal(mem.read(ids, np.uint32, n + 7), want)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf_dir, _ = make_hf_model("qwen2", tmp_path_factory.mktemp("overlap"), seed=31, max_position_embeddings=512)
    return load_engine(hf_dir, device="cpu")


def _requests(engine) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(4)
    ids = [rng.integers(3, 320, n).tolist() for n in (5, 17, 9, 30, 12, 3)]
    return [(ids[0], SamplingParams(max_tokens=12)),
            (ids[1], SamplingParams(max_tokens=20, temperature=0.9, top_k=40, seed=7)),
            (ids[2], SamplingParams(max_tokens=1)),
            (ids[3], SamplingParams(max_tokens=16, temperature=1.1, top_p=0.9, seed=11)),
            (ids[4], SamplingParams(max_tokens=9, logprobs=2)),  # chosen on the host: those steps run in sync
            (ids[5], SamplingParams(max_tokens=25))]


class _Recording:
    """A backend wrapper that counts decode calls with fed entries."""

    def __init__(self, backend):
        self._backend, self.fed_calls, self.decode_calls = backend, 0, 0

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def decode(self, tokens, positions, tables):
        self.decode_calls += 1
        self.fed_calls += min(tokens) < 0
        return self._backend.decode(tokens, positions, tables)


def _run(backend, engine, requests, overlap: bool, arrivals=(0, 0, 1, 3, 3, 6)):
    rec = _Recording(backend)
    serving = ServingEngine(rec, engine.tokenizer, engine.generator.eos_token_ids, background=False,
                            max_batched_tokens=24, async_scheduling=overlap)
    assert serving.scheduler.overlapped == overlap
    handles, step = [], 0
    while step < 500:
        for (ids, p), at in zip(requests, arrivals):
            if at == step:
                handles.append(serving.submit(ids, p))
        if len(handles) == len(requests) and all(h.done for h in handles):
            break
        serving.step()
        step += 1
    results = [h.wait(0) for h in handles]
    pool = serving.scheduler.pool
    pool.check_consistency()
    assert pool.num_used == 0 and not serving.scheduler.has_work
    return [(r.token_ids, r.finish_reason) for r in results], rec


@pytest.mark.parametrize("num_blocks", [64, 9])  # 9 blocks of 8: preemption
def test_overlapped_steps_give_the_synchronous_tokens(engine, num_blocks):
    reqs = _requests(engine)
    make = lambda: ReferenceBatchBackend(engine.model, num_blocks, 8, max_batch=4)  # noqa: E731
    want, _ = _run(make(), engine, reqs, overlap=False)
    # a stop token met mid-stream: the step in flight already holds that sequence's next row
    stop = want[0][0][4]
    reqs[0] = (reqs[0][0], SamplingParams(max_tokens=12, stop_token_ids=(stop,)))
    want, _ = _run(make(), engine, reqs, overlap=False)
    assert want[0][1] == "stop" and len(want[0][0]) <= 5
    got, rec = _run(make(), engine, reqs, overlap=True)
    assert got == want
    assert rec.fed_calls > 0


def test_fed_tokens_need_a_sampled_decode_step(engine):
    be = ReferenceBatchBackend(engine.model, 16, 8, max_batch=2)
    with pytest.raises(InvalidRequestError, match="fed token"):
        be.decode([fed(0)], [3], [[1]])
    be.prefill([5, 6, 7], 0, [1])
    with pytest.raises(InvalidRequestError, match="fed token"):
        be.decode([fed(0)], [3], [[1]])
    be.decode([9], [3], [[1]]).sample([RowSampling()])
    with pytest.raises(InvalidRequestError, match="fed token"):
        be.decode([fed(1)], [4], [[1]])  # (the step had one row)


@pytest.fixture(scope="module")
def gpu_backend(tmp_path_factory):
    from realizar.gpu.batch import GpuBatchBackend
    from realizar.gpu.model import GpuModel
    from realizar.models.loader import load_model
    from tests.gguf_factory import make_gguf_model

    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp("overlap-gpu"), "Q8_0", seed=5, num_layers=1,
                                 vocab_size=320, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)
    loaded = load_model(path)
    dev = cuda.EmulatedDevice(sm_count=4)

    def make():
        model = GpuModel.from_loaded(loaded, max_len=64, device=dev, kv_cache=False)
        return GpuBatchBackend(model, num_blocks=24, block_size=16, kv_dtype="f32", max_batch=4, max_context=64,
                               prefill_chunk=8)

    return make, load_engine(str(path), device="cpu"), dev


def test_overlapped_steps_on_the_emulated_gpu_backend(gpu_backend):
    make, engine, dev = gpu_backend
    rng = np.random.default_rng(9)
    reqs = [(rng.integers(3, 320, n).tolist(), SamplingParams(max_tokens=m)) for n, m in ((5, 6), (19, 4), (3, 7))]
    reqs[1] = (reqs[1][0], SamplingParams(max_tokens=4, temperature=0.8, seed=3))
    want, _ = _run(make(), engine, reqs, overlap=False, arrivals=(0, 0, 2))
    launches = len(dev.launches)
    got, rec = _run(make(), engine, reqs, overlap=True, arrivals=(0, 0, 2))
    assert got == want and rec.fed_calls > 0
    assert any(name.startswith("feed_tokens") for name, *_ in dev.launches[launches:])
    be = make()
    with pytest.raises(InvalidRequestError, match="fed token"):
        be.decode([fed(0)], [0], [[1]])


def test_warm_up_captures_every_step_and_changes_no_result(gpu_backend):
    make, engine, dev = gpu_backend
    rng = np.random.default_rng(10)
    reqs = [(rng.integers(3, 320, n).tolist(), SamplingParams(max_tokens=m)) for n, m in ((9, 5), (20, 3))]
    want, _ = _run(make(), engine, reqs, overlap=True, arrivals=(0, 1))
    be = make()
    serving = ServingEngine(be, engine.tokenizer, engine.generator.eos_token_ids, background=False)
    assert serving.warm_up() > 0
    assert {(b, False, f) for b in (1, 2, 4) for f in (False, True)} | {(1, True, False), (1, True, True)} \
        <= set(be.graphs.keys())
    assert (8, 0) in be._prefill.graphs  # the chunk's one length class, captured
    got, _ = _run(be, engine, reqs, overlap=True, arrivals=(0, 1))
    assert got == want
    serving.submit(reqs[0][0], reqs[0][1])
    with pytest.raises(InvalidRequestError, match="before the first request"):
        serving.warm_up()
