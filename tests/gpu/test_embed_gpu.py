"""Embeddings on the GPU: :meth:`GpuBatchBackend.hidden_rows` (prefill chunks, the final RMSNorm of every row read
back) against the reference model's final-norm rows, over several chunks and a one-row last chunk, in several
weight types; :meth:`ServingEngine.embed` on the GPU against the CPU engine's embeddings, the pool's blocks given
back, a greedy generation running beside it unchanged; ``POST /v1/embeddings`` of a GPU server."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.config import ServingConfig
from realizar.engine import load_engine
from realizar.generation import SamplingParams
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from realizar.serving import ServingEngine
from tests.gguf_factory import make_gguf_model

pytestmark = pytest.mark.gpu

DIMS = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2,
            max_position_embeddings=512)
IDS = [[5, 17, 42], [7], list(range(3, 68)), [int(t) for t in np.random.default_rng(1).integers(3, 320, 200)]]
# activations enter the prefill GEMMs as f16: the rows agree with the f64-accumulated reference to f16 rounding
RTOL = 2e-2


@pytest.fixture(scope="module", autouse=True)
def gpu():
    if not cuda.is_available():
        pytest.skip(f"no GPU: {cuda.unavailable_reason()}")


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all()
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("qwen3", "Q4_K"), ("qwen2", "F16")])
def test_hidden_rows_equal_the_reference_rows(tmp_path, arch, qtype):
    path, _, _ = make_gguf_model(arch, tmp_path, qtype, seed=6, **DIMS)
    ref = ReferenceModel.from_loaded(load_model(path))
    engine = load_engine(path, device="cuda")
    backend = engine.batch_backend(ServingConfig(prefill_chunk=32, block_size=16, max_batch=4, kv_dtype="f32",
                                                       num_blocks=64))
    try:
        table = list(range(1, backend.num_blocks))
        for ids in IDS:  # 3, 1, 65 (chunks 32 + 32 + 1) and 200 rows
            got = backend.hidden_rows(ids, table[: -(-len(ids) // 16)])
            want = ref.hidden_states(ids)
            assert got.shape == want.shape == (len(ids), DIMS["hidden_size"])
            assert _rel(got, want) < RTOL, f"{arch} {qtype} {len(ids)} rows: {_rel(got, want):.2e}"
    finally:
        backend.close()


def test_serving_embed_on_the_gpu_beside_a_generation(tmp_path):
    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=6, **DIMS)
    want = load_engine(path, device="cpu").embed(IDS)
    engine = load_engine(path, device="cuda")
    params = SamplingParams(max_tokens=32, temperature=0.0)
    with ServingEngine.from_engine(engine, max_batch=4, block_size=16, num_blocks=64) as serving:
        alone = serving.generate_batch([[5, 6, 7, 8]], params)[0].token_ids
        free = serving.scheduler.pool.num_available
        handle = serving.submit([5, 6, 7, 8], params)
        got = serving.embed(IDS)
        while not handle.done:
            serving.embed(IDS[:1])
        assert handle.wait().token_ids == alone
        assert serving.scheduler.pool.num_available == free
    assert got.shape == want.shape
    cos = np.sum(got.astype(np.float64) * want, axis=1)
    assert cos.min() > 0.9995, cos
    assert _rel(got, want) < RTOL


def test_http_embeddings_of_a_gpu_server(tmp_path):
    import httpx

    from tests.test_server import LiveServer

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=6, **DIMS)
    want = load_engine(path, device="cpu").embed(IDS[:2])
    engine = load_engine(path, device="cuda")
    serving = ServingEngine.from_engine(engine, max_batch=4, block_size=16, num_blocks=64)
    srv = LiveServer(engine, model_name="tiny", serving=serving).start()
    try:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "tiny", "input": IDS[:2], "encoding_format": "float"},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], np.float64)
        assert np.sum(got * want, axis=1).min() > 0.9995
    finally:
        srv.stop()
