"""realizar.models.random: random GGUF tensors and models are valid, finite and reproducible."""

from __future__ import annotations

import numpy as np
import pytest

from realizar.models import names
from realizar.models.config import ModelConfig
from realizar.models.random import dequant, random_model, random_tensor, random_weight
from realizar.models.reference import ReferenceModel

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("wtype", TYPES)
def test_random_weight_is_finite_and_reproducible(wtype):
    raw = random_weight(np.random.default_rng(3), wtype, 4, 512, scale=0.5)
    assert raw.dtype == np.uint8
    w = dequant(raw, wtype, 4, 512)
    assert w.shape == (4, 512) and np.isfinite(w).all() and np.abs(w).max() > 0
    assert np.array_equal(raw, random_weight(np.random.default_rng(3), wtype, 4, 512, scale=0.5))


@pytest.mark.parametrize("wtype", TYPES)
def test_random_tensor_is_bounded(wtype):
    t = random_tensor(np.random.default_rng(0), "w", wtype, (2, 256))
    w = t.dequantize()
    assert w.shape == (2, 256) and np.isfinite(w).all() and np.abs(w).max() < 10.0  # 0.002 * largest sub-scale * largest code


def test_random_tensor_rejects_partial_blocks():
    with pytest.raises(ValueError, match="Q4_K blocks"):
        random_tensor(np.random.default_rng(0), "w", "Q4_K", (2, 100))
    with pytest.raises(ValueError, match="unknown GGML type"):
        random_tensor(np.random.default_rng(0), "w", "Q9", (2, 256))


@pytest.mark.parametrize("tied,bias,qk_norm", [(True, False, False), (False, True, True)])
def test_random_model_runs(tied, bias, qk_norm):
    cfg = ModelConfig(architecture="qwen3", vocab_size=64, hidden_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, intermediate_size=512, context_length=32,
                      tied_embeddings=tied, qkv_bias=bias, qk_norm=qk_norm)  # fmt: skip
    tensors = random_model(cfg, "Q4_K", embedding_type="Q8_0", output_type="Q6_K", seed=1)
    names.validate_tensor_shapes(cfg, {k: t.shape for k, t in tensors.items()})
    assert set(tensors) == set(names.expected_shapes(cfg))
    logits = ReferenceModel(cfg, tensors).prefill([1, 2, 3])
    assert logits.shape == (64,) and np.isfinite(logits).all()
    again = random_model(cfg, "Q4_K", embedding_type="Q8_0", output_type="Q6_K", seed=1)
    assert all(np.array_equal(tensors[k].data, again[k].data) for k in tensors)


def test_random_moe_model_runs_and_counts_the_chosen_experts():
    """A random mixture-of-experts model (the benchmark's Qwen3-30B-A3B shape, made small) runs in the reference;
    the bytes a token reads count the chosen experts' share of the stacked matrices."""
    from realizar.models.config import ModelConfig
    from realizar.models.random import MOE_SHAPES, random_model, token_read_bytes
    from realizar.models.reference import ReferenceModel

    c = ModelConfig(**{**MOE_SHAPES["qwen3-30b-a3b"].config, "num_layers": 1, "vocab_size": 512, "num_experts": 8,
                       "num_experts_used": 2})
    t = random_model(c, "Q4_K", "Q4_K", "Q6_K")
    assert t["blk.0.ffn_gate_exps.weight"].shape == (8, 768, 2048) and t["blk.0.ffn_gate_inp.weight"].shape == (8, 2048)
    experts = sum(x.nbytes for n, x in t.items() if n.endswith("_exps.weight"))
    rest = sum(x.nbytes for n, x in t.items() if not n.endswith("_exps.weight") and n != "token_embd.weight")
    assert token_read_bytes(c, t) == int(rest + experts * 2 / 8)
    assert np.isfinite(ReferenceModel(c, t, max_len=8).prefill([1, 2, 3])).all()
