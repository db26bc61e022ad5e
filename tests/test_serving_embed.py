"""Embeddings through the serving engine (:meth:`ServingEngine.embed`, what GPU servers and engine processes run):
each input prefilled on the batch backend between steps through KV blocks of its own (``hidden_rows``), pooled and
normalised: equal to the reference model's pooled final-norm state; the blocks go back to the pool; generations
running at the same time give the tokens they give alone (the step in flight and its fed rows untouched); a pool
too full is a 503; in an engine process; over HTTP for a server whose engine has no reference model."""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import pytest

from realizar.engine import load_engine
from realizar.errors import KVPoolExhaustedError
from realizar.generation import SamplingParams
from realizar.serving import ServingEngine
from realizar.serving.cpu_backend import ReferenceBatchBackend
from realizar.serving.remote import EngineProcess, build_serving
from tests.test_server import LiveServer, _tiny_gguf

IDS = [[5, 17, 42], [7], list(range(3, 60)), [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(_tiny_gguf(tmp_path_factory))


@pytest.fixture(scope="module")
def engine(path):
    return load_engine(path, device="cpu")


def _serving(engine, num_blocks=64, block_size=16, **kw) -> ServingEngine:
    backend = ReferenceBatchBackend(engine.model, num_blocks, block_size, max_batch=4)
    return ServingEngine(backend, engine.tokenizer, engine.generator.eos_token_ids, **kw)


def test_backend_hidden_rows_are_the_reference_models(engine):
    backend = ReferenceBatchBackend(engine.model, 16, 16, max_batch=4)
    for ids in IDS:
        want = engine.model.hidden_states(ids)
        got = backend.hidden_rows(ids, list(range(1, backend.num_blocks))[: -(-len(ids) // 16)])  # (0: the null block)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dimensions", [None, 8])
def test_serving_embed_equals_the_engines_and_gives_the_blocks_back(engine, dimensions):
    serving = _serving(engine, background=False)
    free = serving.scheduler.pool.num_available
    got = serving.embed(IDS, dimensions)
    assert got.shape == (len(IDS), dimensions or engine.config.hidden_size)
    np.testing.assert_allclose(got, engine.embed(IDS, dimensions), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert serving.scheduler.pool.num_available == free
    serving.scheduler.pool.check_consistency()


def test_generations_between_embeddings_keep_their_tokens(engine):
    """Embeddings taken while greedy and seeded generations run (overlapped steps: one in flight, its rows fed
    from the last step's tokens) leave those generations' tokens as they are alone."""
    params = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.9, seed=3)]
    prompts = [[5, 6, 7, 8], [11, 12, 13]]
    alone = _serving(engine).generate_batch(prompts, params)
    serving = _serving(engine, async_scheduling=True)
    try:
        handles = [serving.submit(p, sp) for p, sp in zip(prompts, params)]
        embedded = []
        while not all(h.done for h in handles):
            embedded.append(serving.embed(IDS[:2]))
        got = [h.wait() for h in handles]
    finally:
        serving.close()
    assert embedded and all(np.allclose(e, embedded[0], atol=1e-6) for e in embedded)
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


def test_a_full_pool_refuses_the_embedding_and_takes_nothing(engine):
    serving = _serving(engine, num_blocks=3, block_size=4, background=False)  # 2 usable blocks: 8 positions
    free = serving.scheduler.pool.num_available
    with pytest.raises(KVPoolExhaustedError, match="available"):
        serving.embed([list(range(3, 20))])
    assert serving.scheduler.pool.num_available == free == 2
    assert serving.embed([[5, 6, 7]]).shape == (1, engine.config.hidden_size)


def test_embed_in_an_engine_process(path, engine):
    proc = EngineProcess(functools.partial(build_serving, path, "cpu", None, {"max_batch": 4, "num_blocks": 8,
                                                                               "block_size": 16}))
    try:
        want = engine.embed(IDS)
        out: list = [None] * 3
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, proc.embed(IDS, None))) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for got in out:  # (three calls at once, each answered with its own result)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        with pytest.raises(KVPoolExhaustedError):
            proc.embed([[5] * 200], None)  # (13 blocks of 16; the pool has 8)
    finally:
        proc.close()


def test_http_embeddings_of_an_engine_without_a_reference_model(path, engine):
    """A server whose engine cannot embed by itself (a GPU model, here one posing as it) answers through its serving
    engine; one whose serving backend has no hidden rows answers 501."""
    import httpx

    posing = dataclasses.replace(engine, model=object(), device="cuda")
    assert posing.embedding_unavailable() is not None
    srv = LiveServer(posing, model_name="tiny", serving=_serving(engine)).start()
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "tiny", "input": IDS, "encoding_format": "float"},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
        np.testing.assert_allclose(got, engine.embed(IDS), rtol=1e-5, atol=1e-6)
        serving = srv.app.state.server.scheduler.serving
        backend, serving.backend = serving.backend, object()  # (a backend without hidden rows, for one request)
        try:
            r = httpx.post(srv.url + "/v1/embeddings", json={"model": "tiny", "input": "hi"}, timeout=60)
            assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported"
        finally:
            serving.backend = backend
    finally:
        srv.stop()


def test_gpu_backend_hidden_rows_on_the_emulator(tmp_path):
    """The GPU backend's hidden rows (prefill chunks of 4: a 5-token input runs 4 + 1 rows, then the final RMSNorm of
    each chunk read back) on the PTX emulator, against the reference model's; and its serving engine's embeddings."""
    from realizar.config import ServingConfig
    from realizar.models.loader import load_model
    from realizar.models.reference import ReferenceModel
    from tests.gguf_factory import make_gguf_model

    dims = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=1,
                max_position_embeddings=256)
    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=6, **dims)
    ref = ReferenceModel.from_loaded(load_model(path))
    emulated = load_engine(path, device="emulate")
    backend = emulated.batch_backend(ServingConfig(prefill_chunk=4, block_size=16, max_batch=2, kv_dtype="f32",
                                                          num_blocks=8))
    for ids in ([5, 17, 42], [7], [3, 4, 5, 6, 7]):
        got, want = backend.hidden_rows(ids, [1]), ref.hidden_states(ids)
        assert got.shape == want.shape and np.isfinite(got).all()
        assert np.abs(got - want).max() < 5e-3 * np.abs(want).max()  # (f16 activations in the prefill GEMMs)
    serving = ServingEngine(backend, emulated.tokenizer, background=False)
    want = load_engine(path, device="cpu").embed([[5, 17, 42], [7]])
    assert np.sum(serving.embed([[5, 17, 42], [7]]) * want, axis=1).min() > 0.9999
