"""Overlapped decode steps on the GPU: ``feed_tokens`` against its definition, and the serving engine giving
the same tokens and finish reasons with ``async_scheduling`` on and off (greedy and seeded sampled requests,
stop tokens met mid-stream, arrivals over time, a pool that preempts), before and after ``warm_up``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ptx_gen.kernels.sampling.feed import NO_SOURCE
from realizar.engine import load_engine
from realizar.generation import SamplingParams
from realizar.serving import ServingEngine
from tests.gguf_factory import make_gguf_model
from tests.helpers import examples

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops(device):
    from realizar.gpu.sampling import SampleOps

    return SampleOps(device)


@settings(max_examples=examples(20), deadline=None)
@given(n=st.integers(1, 256), n_tok=st.integers(1, 256), share=st.floats(0, 1), seed=st.integers(0, 2**31))
def test_feed_tokens_on_the_gpu(ops, n, n_tok, share, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 2**31, n_tok, dtype=np.uint32)
    src = np.where(rng.random(n) < share, rng.integers(0, n_tok, n), NO_SOURCE).astype(np.uint32)
    staged = rng.integers(1, 2**31, n + 5, dtype=np.uint32)
    ids, s, t = ops.buffer(n + 5, np.uint32), ops.buffer(n, np.uint32), ops.buffer(n_tok, np.uint32)
    ids.copy_from_host(staged)
    s.copy_from_host(src)
    t.copy_from_host(tokens)
    ops.feed_tokens(ids, s, t, n, n_tok)
    want = staged.copy()
    want[:n] = np.where(src != NO_SOURCE, tokens[np.minimum(src, n_tok - 1)], staged[:n])
    np.testing.assert_array_equal(ids.to_numpy(), want)
    for buf in (ids, s, t):
        buf.free()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp("overlap-gpu"), "Q4_K", seed=8, vocab_size=320,
                                 hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
    return load_engine(path, device="cuda", max_context=128)


def _serve(engine, requests, overlap: bool, num_blocks: int, warm: bool = False):
    serving = ServingEngine.from_engine(engine, kv_dtype="f32", max_batch=16, block_size=16, num_blocks=num_blocks,
                                        background=False, async_scheduling=overlap)
    try:
        if warm:
            assert serving.warm_up() > 0
        handles, step = [], 0
        while len(handles) < len(requests) or not all(h.done for h in handles):
            handles += [serving.submit(ids, p) for ids, p, at in requests if at == step]
            serving.step()
            step += 1
        assert serving.scheduler.pool.num_used == 0
        return [(h.result.token_ids, h.result.finish_reason) for h in handles]
    finally:
        serving.close()


@pytest.mark.parametrize("num_blocks", [200, 14])  # 14 blocks of 16: preemption
def test_overlapped_serving_equals_synchronous(engine, num_blocks):
    rng = np.random.default_rng(2)
    requests = []
    for i in range(20):
        ids = rng.integers(3, 320, int(rng.integers(2, 40))).tolist()
        sampled = dict(temperature=0.9, top_k=30, seed=i) if i % 3 == 0 else {}
        requests.append((ids, SamplingParams(max_tokens=int(rng.integers(1, 30)), **sampled), int(rng.integers(0, 12))))
    want = _serve(engine, requests, False, num_blocks)
    # a stop token each for a few: the step in flight already holds their next row
    for i in (1, 4, 7):
        toks = want[i][0]
        if len(toks) > 3:
            ids, p, at = requests[i]
            requests[i] = (ids, SamplingParams(max_tokens=p.max_tokens, stop_token_ids=(toks[2],)), at)
    want = _serve(engine, requests, False, num_blocks)
    assert _serve(engine, requests, True, num_blocks) == want
    assert _serve(engine, requests, True, num_blocks, warm=True) == want
