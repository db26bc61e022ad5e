"""The NumPy reference model against an independent oracle: HF transformers + torch on the CPU
(those tests are marked ``oracle``; the incremental-decoding ones need neither).

* Tiny random llama / qwen2 / qwen3 / mistral models (tests/model_factory.py, tests/gguf_factory.py),
  loaded from safetensors and from GGUF F32: logits at every position within float32 noise of
  transformers' (max abs diff ≤ 1e-5 × max|logit|).
* Quantized GGUF (every block type we read): against transformers loading the *same* GGUF with
  ``gguf_file=`` (it dequantizes to float32), same tolerance.
* Incremental decoding (prefill then decode, chunked prefill, truncate, reset) equals a full prefill.
* SmolLM2-135M-Instruct Q4_1 against transformers loading the same GGUF: top-1 agreement at every
  position of a set of prompts, and max abs logit difference ≤ 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

from realizar.errors import ContextOverflowError, InvalidRequestError, ModelFormatError
from realizar.models.loader import load_model
from realizar.models.reference import KVCache, ReferenceModel
from tests.helpers import assert_close
from tests.gguf_factory import hf_to_gguf
from tests.model_factory import KQUANT_DIMS, hf_logits, load_hf_model, make_hf_model

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
RTOL = 1e-5  # relative to max |logit|: float32 noise for these depths


def _ids(seed: int, n: int, vocab: int = 320) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _ref(path, **kw) -> ReferenceModel:
    return ReferenceModel.from_loaded(load_model(path), **kw)


# ----------------------------------------------------------------------------------------------
# F32 weights: safetensors and GGUF


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", ["safetensors", "gguf-f32", "safetensors-f16"])
def test_logits_match_transformers(arch, fmt, tmp_path):
    dtype = "float16" if fmt == "safetensors-f16" else "float32"
    hf_dir, _ = make_hf_model(arch, tmp_path, seed=1, dtype=dtype)
    path = hf_to_gguf(hf_dir, tmp_path / "m.gguf", "F32") if fmt == "gguf-f32" else hf_dir
    model = _ref(path)
    if fmt == "gguf-f32" and arch in ("llama", "mistral"):
        assert model.config.rope_type == "normal"  # permuted Q/K, interleaved RoPE
    hf_model = load_hf_model(hf_dir)  # transformers reading the saved checkpoint in float32
    ids = _ids(2, 40)
    ours = model.prefill(ids, all_logits=True)
    assert ours.dtype == np.float32 and ours.shape == (40, 320)
    assert_close(ours, hf_logits(hf_model, ids), RTOL, f"{arch} {fmt}")


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tied_embeddings_and_long_positions(arch, tmp_path):
    hf_dir, _ = make_hf_model(arch, tmp_path, seed=3, tie_word_embeddings=True, max_position_embeddings=512)
    ids = _ids(4, 300)
    ref = hf_logits(load_hf_model(hf_dir), ids)
    for path in (hf_dir, hf_to_gguf(hf_dir, tmp_path / "m.gguf", "F32")):
        loaded = load_model(path)
        assert "output.weight" not in loaded.tensors
        model = ReferenceModel.from_loaded(loaded)
        assert model.lm_head is model.embedding
        assert_close(model.prefill(ids, all_logits=True), ref, RTOL, f"{arch} tied {path}")


@pytest.mark.oracle
def test_qwen3_head_dim_differs_from_hidden_over_heads(tmp_path):
    hf_dir, _ = make_hf_model("qwen3", tmp_path, seed=5, hidden_size=64, num_heads=4, head_dim=48)
    model = _ref(hf_dir)
    assert model.config.head_dim == 48 and model.config.qk_norm
    ids = _ids(6, 25)
    ref = hf_logits(load_hf_model(hf_dir), ids)
    assert_close(model.prefill(ids, all_logits=True), ref, RTOL, "qwen3 head_dim 48")


# ----------------------------------------------------------------------------------------------
# Quantized GGUF vs transformers reading the same file

QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")


def _hf_from_gguf(path):
    return load_hf_model(path.parent, gguf_file=path.name)


@pytest.mark.oracle
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_quantized_gguf_matches_transformers_gguf(arch, qtype, tmp_path):
    dims = dict(KQUANT_DIMS) if qtype.endswith("_K") else {}
    if arch == "qwen3":
        # transformers' GGUF reader ignores qwen3.attention.key_length and builds Qwen3Config's
        # default head_dim (128), so the file must use that head_dim for it to load.
        dims["head_dim"] = 128
    hf_dir, _ = make_hf_model(arch, tmp_path, seed=7, **dims)
    path = hf_to_gguf(hf_dir, tmp_path / f"{arch}-{qtype}.gguf", qtype)
    ids = _ids(8, 33)
    ref = hf_logits(_hf_from_gguf(path), ids)
    ours = _ref(path).prefill(ids, all_logits=True)
    assert_close(ours, ref, RTOL, f"{arch} {qtype}")


# ----------------------------------------------------------------------------------------------
# Incremental decoding


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        hf_dir, _ = make_hf_model(arch, tmp, seed=11)
        out[arch] = hf_to_gguf(hf_dir, tmp / f"{arch}-q8.gguf", "Q8_0")
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_equals_full_prefill(arch, tiny_models):
    ids = _ids(12, 30)
    model = _ref(tiny_models[arch])
    full = model.prefill(ids, all_logits=True)
    assert model.position == 30

    model.reset()
    steps = [model.prefill(ids[:9])]
    steps += [model.decode(t) for t in ids[9:]]
    assert_close(np.stack(steps), full[8:], 1e-5, f"{arch} decode")

    model.reset()  # chunked prefill continues after the cache
    a = model.prefill(ids[:13], all_logits=True)
    b = model.prefill(ids[13:], all_logits=True)
    assert_close(np.concatenate([a, b]), full, 1e-5, f"{arch} chunked")

    model.reset()  # last-position logits are the last row
    assert_close(model.prefill(ids), full[-1], 1e-6, f"{arch} last")


def test_truncate_rewinds_the_cache(tiny_models):
    model = _ref(tiny_models["qwen2"])
    a, b, c = _ids(1, 10), _ids(2, 5), _ids(3, 7)
    expect = model.prefill(a + c, all_logits=True)[10:]
    model.reset()
    model.prefill(a + b)
    model.truncate(10)
    assert model.position == 10
    assert_close(model.prefill(c, all_logits=True), expect, 1e-5, "after truncate")
    with pytest.raises(Exception):
        model.truncate(100)


def test_context_overflow(tiny_models):
    model = _ref(tiny_models["llama"], max_len=16)
    assert model.context_length == 16
    with pytest.raises(ContextOverflowError, match="17"):
        model.prefill(_ids(1, 17))
    assert model.position == 0  # nothing was written
    model.prefill(_ids(1, 15))
    model.decode(5)
    with pytest.raises(ContextOverflowError, match="16"):
        model.decode(5)
    assert model.position == 16
    model.reset()
    model.prefill(_ids(1, 16))


def test_bad_token_ids(tiny_models):
    model = _ref(tiny_models["llama"])
    with pytest.raises(InvalidRequestError, match="320"):
        model.prefill([1, 2, 320])
    with pytest.raises(InvalidRequestError):
        model.decode(-1)
    with pytest.raises(InvalidRequestError):
        model.prefill([])
    assert model.position == 0


def test_missing_and_misshapen_tensors(tiny_models):
    loaded = load_model(tiny_models["qwen3"])
    tensors = dict(loaded.tensors)
    del tensors["blk.1.ffn_down.weight"]
    with pytest.raises(ModelFormatError, match="blk.1.ffn_down.weight"):
        ReferenceModel(loaded.config, tensors)
    tensors = dict(loaded.tensors)
    tensors["blk.0.attn_k.weight"] = tensors["blk.0.attn_q.weight"]
    with pytest.raises(ModelFormatError, match="blk.0.attn_k.weight"):
        ReferenceModel(loaded.config, tensors)
    tensors = dict(loaded.tensors)
    del tensors["blk.0.attn_q_norm.weight"]
    with pytest.raises(ModelFormatError, match="attn_q_norm"):
        ReferenceModel(loaded.config, tensors)


def test_kv_cache_layout():
    cache = KVCache(num_layers=2, num_kv_heads=3, max_len=8, head_dim=4)
    assert cache.k[0].shape == (3, 8, 4) and cache.k[0].dtype == np.float32
    k = np.ones((3, 5, 4), np.float32)
    cache.write(1, k, 2 * k)
    cache.advance(5)
    kv, vv = cache.view(1)
    assert kv.shape == (3, 5, 4) and (vv == 2).all()
    with pytest.raises(ContextOverflowError):
        cache.write(0, np.ones((3, 4, 4), np.float32), np.ones((3, 4, 4), np.float32))
    cache.truncate(2)
    assert cache.length == 2 and cache.remaining == 6
    cache.reset()
    assert cache.length == 0


# ----------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct Q4_1 (the default model)

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Les pommes de terre sont",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def smol():
    from realizar.default_model import default_model_path

    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_model = _hf_from_gguf(path)
    model = _ref(path, max_len=512)
    return path, hf_tok, hf_model, model


@pytest.mark.oracle
@pytest.mark.full
def test_smollm2_matches_transformers_gguf(smol):
    _, hf_tok, hf_model, model = smol
    worst = 0.0
    for prompt in SMOL_PROMPTS:
        ids = hf_tok(prompt)["input_ids"]
        ref = hf_logits(hf_model, ids)
        model.reset()
        ours = model.prefill(ids, all_logits=True)
        np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1), err_msg=prompt)
        worst = max(worst, float(np.abs(ours - ref).max()))
    assert worst <= 1e-3, worst


@pytest.mark.oracle
@pytest.mark.full
def test_smollm2_greedy_paris_and_decode_consistency(smol):
    _, hf_tok, _, model = smol
    ids = hf_tok("The capital of France is")["input_ids"]
    model.reset()
    logits = model.prefill(ids)
    out = []
    for _ in range(6):
        t = int(np.argmax(logits))
        out.append(t)
        logits = model.decode(t)
    assert "Paris" in hf_tok.decode(out)
    model.reset()
    full = model.prefill(ids + out, all_logits=True)
    np.testing.assert_array_equal(full[len(ids) - 1 : -1].argmax(-1), out)
    assert_close(full[-1], logits, 1e-5, "decode vs prefill")
