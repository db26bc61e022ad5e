"""tools/write_gguf.py: random-weight benchmark models written as GGUF load back in realizar unchanged (config,
tensor bytes, the stand-in tokenizer) and run to the same logits as the in-memory model."""

from __future__ import annotations

import numpy as np
import pytest

from realizar.engine import load_tokenizer
from realizar.models.loader import load_model
from realizar.models.random import BenchShape, bench_model
from realizar.models.reference import ReferenceModel
from tools import write_gguf as tool

_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
           "intermediate_size", "rope_theta", "rope_type", "context_length", "tied_embeddings", "qkv_bias",
           "qk_norm", "num_experts", "num_experts_used", "expert_ffn_size", "expert_weights_norm")

TINY_MOE = BenchShape(dict(architecture="qwen3moe", rope_type="neox", rms_norm_eps=1e-6, context_length=64,
                           vocab_size=1000, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                           intermediate_size=512, rope_theta=1e6, tied_embeddings=False, qk_norm=True,
                           num_experts=8, num_experts_used=2, expert_ffn_size=256),
                      "Q4_K", "Q8_0", "Q6_K")  # fmt: skip
TINY_LLAMA = BenchShape(dict(architecture="llama", rope_type="normal", rms_norm_eps=1e-5, context_length=64,
                             vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=128, rope_theta=1e4, tied_embeddings=True),
                        "Q4_1", "Q8_0", None)  # fmt: skip


def _round_trip(shape: BenchShape, path):
    config, tensors, _ = bench_model(shape, seed=3)
    size = tool.write_gguf(config, tensors, path)
    assert size == path.stat().st_size
    loaded = load_model(path)
    for f in _FIELDS:
        assert getattr(loaded.config, f) == getattr(config, f), f
    assert loaded.config.rms_norm_eps == pytest.approx(config.rms_norm_eps, rel=1e-6)  # (stored as float32)
    assert set(loaded.tensors) == set(tensors)
    for name, t in tensors.items():
        got = loaded.tensors[name]
        assert (got.ggml_type, got.shape) == (t.ggml_type, t.shape), name
        assert np.array_equal(got.data, t.data), name
    eos = config.vocab_size - 1
    assert (loaded.config.bos_token_id, loaded.config.eos_token_ids) == (eos, (eos,))
    return config, tensors, loaded


@pytest.mark.parametrize("shape,pre", [(TINY_MOE, "qwen2"), (TINY_LLAMA, "llama-bpe")], ids=["qwen3moe", "llama"])
def test_written_model_loads_and_runs_like_the_in_memory_one(tmp_path, shape, pre):
    config, tensors, loaded = _round_trip(shape, tmp_path / "m.gguf")
    md = loaded.metadata
    arch = config.architecture
    assert md["general.architecture"] == arch and md["tokenizer.ggml.pre"] == pre
    assert md[f"{arch}.attention.layer_norm_rms_epsilon"] == pytest.approx(config.rms_norm_eps)
    assert md["general.file_type"] == (14 if config.is_moe else 3)  # MOSTLY_Q4_K_S (no Q6_K layer), MOSTLY_Q4_1
    ids = [5, 17, 256, 3]
    want, got = ReferenceModel(config, tensors, max_len=16), ReferenceModel.from_loaded(loaded, max_len=16)
    np.testing.assert_allclose(got.prefill(ids, all_logits=True), want.prefill(ids, all_logits=True),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.decode(9), want.decode(9), rtol=1e-4, atol=1e-5)

    tok = load_tokenizer(loaded)
    assert tok.encode(" t", add_special_tokens=False) == [256]  # the one merge
    text = "The quick brown fox\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_vocabulary_is_gpt2_byte_level_and_unique():
    tokens, types, merges, eos = tool.vocabulary(300)
    assert len(tokens) == len(set(tokens)) == len(types) == 300
    assert tokens[:256] == tool.byte_symbols() and len(set(tokens[:256])) == 256
    assert tokens[tool.byte_symbols().index("\u0120")] == "\u0120"  # space -> Ġ
    assert tokens[eos] == "<|endoftext|>" and types[eos] == 3 and set(types[:eos]) == {1}
    left, right = merges[0].split(" ")
    assert {left, right, left + right} <= set(tokens)
    with pytest.raises(ValueError, match="vocab_size"):
        tool.vocabulary(200)


def test_cli_rejects_an_unknown_shape(tmp_path, capsys):
    assert tool.main(["no-such-shape", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "llama-3-8b" in err and "qwen3-30b-a3b" in err
    assert not (tmp_path / "x.gguf").exists()
