"""ServingEngine and Scheduler on the NumPy backend, against Generator running each request alone on
the ReferenceModel (tiny llama / qwen2 / qwen3 models).

* Batched equals alone: requests of different prompt lengths join and leave at different steps;
  every sequence's tokens equal Generator's, and the logprobs (log-softmax of the logits) of the
  requests that ask for them agree within 1e-4 (float32 rounding of differently shaped products).
* Host-sampled seeded requests (penalties) equal Generator with the same seed; device-sampled seeded
  requests give the same tokens alone and in a batch.
* Pool exhaustion (new work waits, then runs), preemption by recompute (same tokens), cancel
  mid-stream (blocks freed at once), requests that can never fit, prefix hits over a 1,000-token
  shared prefix (prefilled tokens counted exactly), block accounting back to all-free.
"""

from __future__ import annotations

import dataclasses

import sys
import threading

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.engine import load_engine
from realizar.errors import InvalidRequestError, UnsupportedError
from realizar.generation import SamplingParams
from realizar.serving import ServingEngine
from realizar.serving.cpu_backend import ReferenceBatchBackend
from tests.model_factory import make_hf_model
from tests.helpers import examples

ARCHS = ("llama", "qwen2", "qwen3")
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serving-engine")
    out = {}
    for i, arch in enumerate(ARCHS):
        hf_dir, _ = make_hf_model(arch, tmp, seed=20 + i, max_position_embeddings=1536)
        out[arch] = load_engine(hf_dir, device="cpu")
    return out


def _serving(engine, num_blocks=64, block_size=16, max_batch=8, **kw) -> ServingEngine:
    backend = ReferenceBatchBackend(engine.model, num_blocks, block_size, max_batch=max_batch)
    return ServingEngine(backend, engine.tokenizer, engine.generator.eos_token_ids, **kw)


def _prompt(seed: int, n: int) -> list[int]:
    # ids 3.. so that no prompt token is a special token
    return np.random.default_rng(seed).integers(3, 320, n).tolist()


def _alone(engine, ids, params):
    chunks = []
    res = engine.generator.generate(ids, params, chunks.append)
    return res, chunks


def _drive(serving: ServingEngine, schedule: dict[int, list], max_steps: int = 10_000):
    """Submit ``schedule[step]`` (lists of (ids, params)) before the given steps; step until all done."""
    handles = []
    step = 0
    while step < max_steps:
        for ids, params in schedule.get(step, []):
            handles.append(serving.submit(ids, params))
        if step > max(schedule) and all(h.done for h in handles):
            break
        serving.step()
        step += 1
    assert all(h.done for h in handles), "requests did not finish"
    return handles


def _check_same(engine, handle, ids, params, what=""):
    want, want_chunks = _alone(engine, ids, params)
    got = handle.wait(0)
    chunks = list(handle)
    assert got.token_ids == want.token_ids, f"{what}: tokens differ"
    assert (got.text, got.finish_reason, got.prompt_tokens) == (want.text, want.finish_reason, want.prompt_tokens)
    assert [c.text for c in chunks] == [c.text for c in want_chunks]
    for c, w in zip(chunks, want_chunks):
        if w.logprob is not None:
            assert abs(c.logprob - w.logprob) <= LOGPROB_ATOL, what
            assert [t for t, _ in c.top_logprobs] == [t for t, _ in w.top_logprobs], what
            np.testing.assert_allclose([p for _, p in c.top_logprobs], [p for _, p in w.top_logprobs],
                                       atol=LOGPROB_ATOL, rtol=0, err_msg=what)  # fmt: skip


def _all_free(serving: ServingEngine):
    s = serving.stats()
    assert (s.running, s.waiting, s.blocks_used, s.blocks_free) == (0, 0, 0, s.blocks_total)
    serving.scheduler.pool.check_consistency()


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_equals_alone(engines, arch):
    """Prompts of 3..70 tokens (chunked prefill: budget 24 tokens), joining at steps 0, 0, 2, 5, 11
    and finishing at different steps; half of them ask for logprobs (host sampling)."""
    engine = engines[arch]
    reqs = [(3, 12, None), (40, 5, 3), (17, 9, None), (70, 16, 2), (9, 3, None), (33, 20, 4)]
    at = [0, 0, 2, 5, 11, 11]
    schedule: dict[int, list] = {}
    items = []
    for i, ((n, m, lp), s) in enumerate(zip(reqs, at)):
        item = (_prompt(100 + i, n), SamplingParams(max_tokens=m, logprobs=lp))
        items.append(item)
        schedule.setdefault(s, []).append(item)
    batches = []
    serving = _serving(engine, max_batched_tokens=24, background=False, on_step=lambda st: batches.append(st))
    handles = _drive(serving, schedule)
    for h, (ids, p) in zip(handles, items):
        _check_same(engine, h, ids, p, f"{arch} prompt {len(ids)}")
    assert max(b.decode_batch for b in batches) >= 3  # sequences really shared decode steps
    assert all(b.prefill_tokens + b.decode_batch <= 24 for b in batches)  # the token budget
    assert any(b.prefill_tokens and b.decode_batch for b in batches)  # prefill chunks between decodes
    _all_free(serving)


def test_host_sampled_seeded_requests_equal_generator(engines):
    """Penalties need the host: the request's own seeded Sampler, exactly Generator's draws."""
    engine = engines["qwen2"]
    ps = [SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=s, repetition_penalty=1.2)
          for s in (1, 2, 3)] + [SamplingParams(max_tokens=8, temperature=0.7, seed=4, presence_penalty=0.5)]
    items = [(_prompt(200 + i, 5 + 7 * i), p) for i, p in enumerate(ps)]
    serving = _serving(engine, background=False)
    handles = _drive(serving, {0: items[:2], 3: items[2:]})
    for h, (ids, p) in zip(handles, items):
        _check_same(engine, h, ids, p, "seeded host")
    _all_free(serving)


def test_device_sampled_seeded_requests_same_alone_and_batched(engines):
    engine = engines["llama"]
    ps = [SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=p, seed=s)
          for t, k, p, s in ((0.8, 0, 1.0, 1), (1.2, 20, 0.9, 2), (0.5, 5, 1.0, 3), (1.0, 0, 0.7, 4))]
    items = [(_prompt(300 + i, 4 + 9 * i), p) for i, p in enumerate(ps)]
    serving = _serving(engine, background=False)
    batched = _drive(serving, {0: items[:3], 2: items[3:]})
    for h, (ids, p) in zip(batched, items):
        alone = _drive(serving, {0: [(ids, p)]})[0]
        assert h.wait(0).token_ids == alone.wait(0).token_ids
    _all_free(serving)


def test_pool_exhaustion_waits_then_progresses(engines):
    """7 usable blocks of 16: each request needs 2..3 blocks, so at most 3 are admitted at once; the
    others wait and run later, each with the tokens it gets alone."""
    engine = engines["qwen3"]
    items = [(_prompt(400 + i, 20 + i), SamplingParams(max_tokens=6)) for i in range(6)]
    serving = _serving(engine, num_blocks=8, background=False)
    waits = []
    serving.on_step = lambda st: waits.append(st.waiting)
    handles = _drive(serving, {0: items})
    assert max(waits) >= 3 and waits[-1] == 0
    for h, (ids, p) in zip(handles, items):
        _check_same(engine, h, ids, p, "exhaustion")
    _all_free(serving)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_recomputes_to_the_same_tokens(engines, prefix_cache):
    """8 usable blocks of 4 positions; three requests each growing to 6 + 14 = 20 positions (5 blocks):
    decoding runs out of blocks, the youngest is preempted and recomputed later; tokens equal alone."""
    engine = engines["llama"]
    items = [(_prompt(500 + i, 6), SamplingParams(max_tokens=14, stop_token_ids=())) for i in range(3)]
    serving = _serving(engine, num_blocks=9, block_size=4, background=False, prefix_cache=prefix_cache)
    handles = _drive(serving, {0: items})
    assert serving.scheduler.preemptions >= 1
    for h, (ids, p) in zip(handles, items):
        _check_same(engine, h, ids, p, "preemption")
    s = serving.stats()
    if not prefix_cache:
        assert s.cached_tokens == 0 and s.blocks_cached == 0
    _all_free(serving)


def test_cancel_mid_stream_frees_blocks_at_once(engines):
    engine = engines["qwen2"]
    # ignore EOS so the stream would run to max_tokens
    p = SamplingParams(max_tokens=500, logits_processors=(lambda g, z: np.where(np.arange(z.size) == 2, -np.inf, z),))
    with _serving(engine) as serving:
        h = serving.submit(_prompt(600, 30), p)
        other = serving.submit(_prompt(601, 10), SamplingParams(max_tokens=4))
        got = []
        for chunk in h:
            got.append(chunk)
            if len(got) == 3:
                h.cancel()
                assert h.done and h.finish_reason == "cancelled"  # the stream ends now
        assert h.finish_reason == "cancelled" and 3 <= len(h.result.token_ids) < 500
        assert other.wait(30).finish_reason in ("stop", "length")
        # its blocks are freed before the loop's next step (at once, if no step was running): the loop
        # is idle within moments, and then nothing holds a block
        deadline = time.monotonic() + 10
        while serving.stats().running and time.monotonic() < deadline:
            time.sleep(0.001)
        _all_free(serving)
        h.cancel()  # a second cancel is a no-op


def test_requests_that_can_never_fit_are_refused(engines):
    engine = engines["qwen2"]
    serving = _serving(engine, num_blocks=5, block_size=16, background=False)  # 64 positions
    with pytest.raises(InvalidRequestError, match=r"= 65 exceeds the KV pool \(4 blocks of 16 = 64 positions\)"):
        serving.submit(_prompt(1, 60), SamplingParams(max_tokens=5))
    big = _serving(engine, num_blocks=200, background=False)
    with pytest.raises(InvalidRequestError, match="exceeds the context length of 1536"):
        big.submit(_prompt(1, 1530), SamplingParams(max_tokens=7))
    with pytest.raises(InvalidRequestError, match="empty"):
        big.submit([], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        big.submit([5, 320], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="finite reciprocal"):  # the device sampler's limit
        big.submit([5, 6], SamplingParams(max_tokens=2, temperature=1e-45))
    assert serving.submit(_prompt(1, 59), SamplingParams(max_tokens=5)).done is False  # 64 fits
    _drive(serving, {0: []})


def test_a_shared_1000_token_prefix_is_prefilled_once(engines):
    """The second request shares 1,000 prompt tokens: its 62 full blocks of 16 (992 tokens) come from
    the prefix cache and only the remaining 8 + 12 tokens are prefilled; same tokens as alone."""
    engine = engines["qwen3"]
    prefix = _prompt(700, 1000)
    a = prefix + _prompt(701, 9)
    b = prefix + _prompt(702, 12)
    p = SamplingParams(max_tokens=5)
    serving = _serving(engine, num_blocks=160, background=False)
    ha = _drive(serving, {0: [(a, p)]})[0]
    sch = serving.scheduler
    assert (sch.prefilled_tokens, sch.cached_tokens) == (len(a), 0)
    hb = _drive(serving, {0: [(b, p)]})[0]
    assert sch.cached_tokens == 992 and sch.prefilled_tokens == len(a) + len(b) - 992
    s = serving.stats()
    assert (s.prefix_queries, s.prefix_hits, s.prefix_hit_tokens) == (2, 1, 992)
    _check_same(engine, ha, a, p, "first")
    _check_same(engine, hb, b, p, "prefix hit")
    _all_free(serving)


def test_a_failing_logits_processor_fails_only_its_request(engines):
    engine = engines["llama"]

    def boom(generated, z):
        raise RuntimeError("processor exploded")

    with _serving(engine) as serving:
        bad = serving.submit(_prompt(800, 5), SamplingParams(max_tokens=4, logits_processors=(boom,)))
        good = serving.submit(_prompt(801, 5), SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="processor exploded"):
            bad.wait(30)
        assert good.wait(30).completion_tokens >= 1
        _all_free(serving)


def test_generate_batch_threads_and_stats(engines):
    engine = engines["qwen2"]
    prompts = [_prompt(900 + i, 5 + 3 * i) for i in range(6)]
    p = SamplingParams(max_tokens=7)
    with _serving(engine) as serving:
        results = serving.generate_batch(prompts, p)
        for ids, r in zip(prompts, results):
            assert r.token_ids == engine.generate(ids, p).token_ids
        # concurrent submitters on several threads
        out: dict[int, list[int]] = {}
        def client(i):
            out[i] = serving.submit(prompts[i], p).wait(30).token_ids

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [out[i] for i in range(6)] == [r.token_ids for r in results]
        assert serving.submit("the and of", SamplingParams(max_tokens=0)).wait(1).completion_tokens == 0
        s = serving.stats()
        assert s.steps > 0 and s.decoded_tokens > 0 and s.prefilled_tokens > 0
        with pytest.raises(InvalidRequestError):
            serving.generate_batch(prompts[:2], [p])
    with pytest.raises(Exception, match="closed"):
        serving.submit(prompts[0], p)


def test_from_engine(engines, monkeypatch):
    engine = engines["llama"]
    serving = ServingEngine.from_engine(engine, num_blocks=40, block_size=16, max_batch=4, background=False)
    assert isinstance(serving.backend, ReferenceBatchBackend) and serving.backend.num_blocks == 40
    per_block = serving.backend.kv_bytes_per_block
    sized = ServingEngine.from_engine(engine, kv_memory=10 * per_block, block_size=16, background=False)
    assert sized.backend.num_blocks == 11
    h = _drive(serving, {0: [(_prompt(5, 8), SamplingParams(max_tokens=3))]})[0]
    assert h.wait(0).token_ids == engine.generate(_prompt(5, 8), SamplingParams(max_tokens=3)).token_ids

    fake_gpu = dataclasses.replace(engine, device="cuda")  # the engine picks the backend by device
    monkeypatch.setitem(sys.modules, "realizar.gpu.batch", None)  # an import of it fails
    with pytest.raises(UnsupportedError, match="needs realizar.gpu.batch.GpuBatchBackend"):
        ServingEngine.from_engine(fake_gpu)


def test_preempted_sampled_requests_keep_their_random_stream(engines):
    """Device-sampled seeded requests preempted and recomputed draw the same tokens as alone (the RNG
    counts generated tokens, not steps)."""
    engine = engines["qwen3"]
    items = [(_prompt(1000 + i, 6), SamplingParams(max_tokens=14, temperature=1.0, top_k=50, seed=7 + i))
             for i in range(3)]  # fmt: skip
    tight = _serving(engine, num_blocks=9, block_size=4, background=False)
    handles = _drive(tight, {0: items})
    assert tight.scheduler.preemptions >= 1
    roomy = _serving(engine, background=False)
    for h, item in zip(handles, items):
        assert h.wait(0).token_ids == _drive(roomy, {0: [item]})[0].wait(0).token_ids
    _all_free(tight)


@settings(max_examples=examples(30))
@given(data=st.data())
def test_random_loads_equal_alone_and_free_every_block(engines, data):
    """Random pools (tight ones preempt), budgets, arrivals, lengths and cancellations: every request
    that is not cancelled gets Generator's tokens; at the end every block is free."""
    engine = engines["qwen2"]
    bs = data.draw(st.sampled_from([2, 4, 8]))
    n_req = data.draw(st.integers(1, 6))
    reqs = [(data.draw(st.integers(1, 20)), data.draw(st.integers(1, 10))) for _ in range(n_req)]
    worst = max(-(-(n + m) // bs) for n, m in reqs)
    num_blocks = data.draw(st.integers(worst, 3 * worst)) + 1
    serving = _serving(engine, num_blocks=num_blocks, block_size=bs, background=False,
                       max_batched_tokens=data.draw(st.integers(4, 32)),
                       prefix_cache=data.draw(st.booleans()))  # fmt: skip
    prompts = [_prompt(data.draw(st.integers(0, 3)), n) for n, _ in reqs]  # few seeds: shared prefixes
    schedule: dict[int, list] = {}
    items = []
    for ids, (_, m) in zip(prompts, reqs):
        item = (ids, SamplingParams(max_tokens=m))
        items.append(item)
        schedule.setdefault(data.draw(st.integers(0, 8)), []).append(item)
    n_cancel = data.draw(st.integers(0, 2))
    cancel_at = {data.draw(st.integers(0, 30)): data.draw(st.integers(0, n_req - 1)) for _ in range(n_cancel)}
    handles: list = []
    order: list = []
    step = 0
    while step < 2000:
        for item in schedule.get(step, []):
            handles.append(serving.submit(*item))
            order.append(item)
        if step in cancel_at and cancel_at[step] < len(handles):
            handles[cancel_at[step]].cancel()
            serving.scheduler.pool.check_consistency()
        if step > max(schedule) and all(h.done for h in handles):
            break
        serving.step()
        step += 1
    for h, (ids, p) in zip(handles, order):
        got = h.wait(0)
        want = engine.generate(ids, p)
        if got.finish_reason == "cancelled":
            assert got.token_ids == want.token_ids[: len(got.token_ids)]
        else:
            assert got.token_ids == want.token_ids
    _all_free(serving)


def test_generate_batch_drives_the_steps_without_a_background_thread(engines):
    """background=False: generate_batch runs the scheduler in the calling thread until every request is
    done (it used to wait for a thread that does not exist)."""
    engine = engines["llama"]
    p = SamplingParams(max_tokens=4)
    prompts = [_prompt(11, 6), _prompt(12, 9)]
    serving = _serving(engine, background=False)
    got = serving.generate_batch(prompts, p)
    assert [r.token_ids for r in got] == [engine.generate(ids, p).token_ids for ids in prompts]
    serving.close()
