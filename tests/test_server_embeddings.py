"""``POST /v1/embeddings`` through the official ``openai`` client against live CPU servers of a tiny random llama:
shapes, unit norms, and equality with the reference model's pooled final-norm hidden state (last-token pooling, and
mean pooling from a GGUF whose ``llama.pooling_type`` is 1); batches, token ids, base64, ``dimensions`` and bad
requests; plus the pieces underneath (the GGUF and sentence-transformers pooling fields, the reference model's
hidden rows against its logits)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from realizar.engine import load_engine  # noqa: E402
from realizar.models.loader import load_model  # noqa: E402
from realizar.models.reference import ReferenceModel  # noqa: E402
from tests.test_server import LiveServer, _tiny_gguf  # noqa: E402

TEXTS = ["The capital of France is", "Paris", "a longer sentence, with punctuation and several more words in it"]


@pytest.fixture(scope="module")
def last_path(tmp_path_factory):
    return _tiny_gguf(tmp_path_factory)


@pytest.fixture(scope="module")
def mean_path(last_path, tmp_path_factory):
    import gguf

    from tests.gguf_factory import rewrite_gguf

    dst = tmp_path_factory.mktemp("embed-mean") / "tiny-mean.gguf"
    return rewrite_gguf(last_path, dst, set_metadata={"llama.pooling_type": (1, gguf.GGUFValueType.UINT32)})


def _serve(path):
    srv = LiveServer(load_engine(str(path), device="cpu"), model_name="tiny").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def live(last_path):
    yield from _serve(last_path)


@pytest.fixture(scope="module")
def live_mean(mean_path):
    yield from _serve(mean_path)


def _expected(path, texts, pooling: str) -> np.ndarray:
    """The pooled, normalised final-norm hidden states, straight from a reference model of ``path``."""
    loaded = load_model(path)
    model = ReferenceModel.from_loaded(loaded)
    tok = load_engine(str(path), device="cpu").tokenizer
    out = []
    for t in texts:
        rows = model.hidden_states(tok.encode(t)).astype(np.float64)
        v = rows[-1] if pooling == "last" else rows.mean(axis=0)
        out.append(v / np.linalg.norm(v))
    return np.stack(out)


def _vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in sorted(resp.data, key=lambda d: d.index)], dtype=np.float64)


# ----------------------------------------------------------------------------------------------
# the pieces underneath
# ----------------------------------------------------------------------------------------------


def test_gguf_pooling_type_parse(last_path, mean_path, tmp_path):
    import gguf

    from realizar.models.gguf_loader import config_from_gguf
    from tests.gguf_factory import rewrite_gguf

    assert load_model(last_path).config.pooling == "last"  # (no pooling_type: a decoder's last token)
    assert load_model(mean_path).config.pooling == "mean"
    shapes = {k: t.shape for k, t in load_model(last_path).tensors.items()}
    md = dict(load_model(last_path).metadata)
    for value, want in ((0, "last"), (1, "mean"), (2, "cls"), (3, "last"), (np.uint32(1), "mean")):
        assert config_from_gguf({**md, "llama.pooling_type": value}, shapes).pooling == want
    cfg = config_from_gguf({**md, "llama.pooling_type": 4}, shapes)  # rank: not an embedding pooling
    assert cfg.pooling == "last" and any("pooling_type" in w for w in cfg.extra["warnings"])
    cls = rewrite_gguf(last_path, tmp_path / "cls.gguf", set_metadata={"llama.pooling_type": (2, gguf.GGUFValueType.UINT32)})
    assert load_model(cls).config.pooling == "cls"


def test_sentence_transformers_pooling(tmp_path):
    from realizar.models.safetensors_loader import pooling_from_sentence_transformers

    warnings: list[str] = []
    assert pooling_from_sentence_transformers(tmp_path, warnings) == "last"
    (tmp_path / "1_Pooling").mkdir()
    cfg = tmp_path / "1_Pooling" / "config.json"
    for flags, want in (({"pooling_mode_mean_tokens": True}, "mean"), ({"pooling_mode_lasttoken": True}, "last"),
                        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls")):
        cfg.write_text(json.dumps({"word_embedding_dimension": 8, **flags}))
        assert pooling_from_sentence_transformers(tmp_path, warnings) == want
    assert not warnings
    cfg.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    assert pooling_from_sentence_transformers(tmp_path, warnings) == "last" and warnings


def test_hidden_states_are_what_the_lm_head_reads(last_path):
    model = ReferenceModel.from_loaded(load_model(last_path))
    ids = [1, 5, 9, 33, 7, 2]
    model.prefill([3, 4])  # something in the cache, which hidden_states neither reads nor changes
    rows = model.hidden_states(ids)
    assert rows.shape == (len(ids), model.config.hidden_size) and model.position == 2
    model.reset()
    np.testing.assert_allclose(rows @ model.lm_head.T, model.prefill(ids, all_logits=True), rtol=1e-4, atol=1e-4)


def test_engine_off_the_cpu_refuses_to_embed(last_path):
    from realizar.errors import UnsupportedError

    engine = load_engine(str(last_path), device="cpu")
    gpu_like = dataclasses.replace(engine, model=object(), device="cuda")
    assert "CPU reference model only" in gpu_like.embedding_unavailable()
    with pytest.raises(UnsupportedError, match="CPU reference model only"):
        gpu_like.embed([[1, 2]])


# ----------------------------------------------------------------------------------------------
# over HTTP, with the official client
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_the_reference_pooled_state(pooling, request, last_path, mean_path):
    srv = request.getfixturevalue("live" if pooling == "last" else "live_mean")
    path = last_path if pooling == "last" else mean_path
    resp = srv.client().embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    hidden = srv.engine.config.hidden_size
    got = _vectors(resp)
    assert resp.object == "list" and resp.model == "tiny" and len(resp.data) == len(TEXTS)
    assert [d.index for d in resp.data] == list(range(len(TEXTS))) and {d.object for d in resp.data} == {"embedding"}
    assert got.shape == (len(TEXTS), hidden)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(got, _expected(path, TEXTS, pooling), atol=1e-5)
    n = sum(len(srv.engine.tokenizer.encode(t)) for t in TEXTS)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == n


def test_batch_ids_base64_and_dimensions(live):
    client, tok = live.client(), live.engine.tokenizer
    batch = _vectors(client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float"))
    one_by_one = np.concatenate([_vectors(client.embeddings.create(model="tiny", input=t, encoding_format="float"))
                                 for t in TEXTS])
    np.testing.assert_allclose(batch, one_by_one, atol=1e-6)
    ids = [tok.encode(t) for t in TEXTS]
    np.testing.assert_allclose(_vectors(client.embeddings.create(model="tiny", input=ids, encoding_format="float")),
                               batch, atol=1e-6)
    single = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    np.testing.assert_allclose(_vectors(single)[0], batch[0], atol=1e-6)
    # the client's default asks for base64 and decodes it; raw base64 is little-endian float32, equal to "float"
    np.testing.assert_allclose(_vectors(client.embeddings.create(model="tiny", input=TEXTS)), batch, atol=0)
    raw = httpx.post(live.url + "/v1/embeddings", json={"model": "tiny", "input": TEXTS, "encoding_format": "base64"},
                     timeout=60).json()
    import base64

    dec = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    np.testing.assert_array_equal(dec, batch.astype(np.float32))
    # dimensions: the first values, renormalised (Matryoshka)
    cut = _vectors(client.embeddings.create(model="tiny", input=TEXTS, dimensions=8, encoding_format="float"))
    assert cut.shape == (len(TEXTS), 8)
    np.testing.assert_allclose(cut, batch[:, :8] / np.linalg.norm(batch[:, :8], axis=1, keepdims=True), atol=1e-6)


def _bad(live, body: dict, status: int = 400) -> dict:
    r = httpx.post(live.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=60)
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_bad_requests(live):
    client = live.client()
    ctx, vocab, hidden = live.app.state.server.context_length, live.app.state.server.vocab_size, \
        live.engine.config.hidden_size
    for kw, words in (
        ({"input": ""}, "empty string"),
        ({"input": []}, "non-empty"),
        ({"input": ["ok", ""]}, "input[1] is an empty string"),
        ({"input": [[1, 2], []]}, "input[1]"),
        ({"input": [vocab]}, "outside the vocabulary"),
        ({"input": [1] * (ctx + 1)}, f"maximum context length is {ctx}"),
        ({"input": ["a"] * 2049}, "at most 2048"),
        ({"input": "hi", "dimensions": hidden + 1}, "dimensions"),
    ):
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.embeddings.create(model="tiny", encoding_format="float", **kw)
    assert "input[0]" in _bad(live, {"input": [1.5]})["message"]
    assert "input[1]" in _bad(live, {"input": ["a", 3]})["message"]
    assert _bad(live, {"input": 7})["param"] == "input"
    assert _bad(live, {"input": "hi", "encoding_format": "int8"})["param"] == "encoding_format"
    assert _bad(live, {"input": [1] * (ctx + 1)})["code"] == "context_length_exceeded"
    assert _bad(live, {"input": "hi", "model": "nope"}, 404)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
