"""RoPE frequencies (realizar.models.rope): plain, per-dimension factors, linear and llama3 scaling,
the two formats' scaling settings, and transformers' llama3 computation as an oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest

from realizar.errors import ModelFormatError, UnsupportedError
from realizar.models.config import ModelConfig, RopeScaling
from realizar.models.rope import inv_freq, rope_inv_freq, rope_scaling_from_gguf, rope_scaling_from_hf

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}  # fmt: skip


def _config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=16, hidden_size=512, num_layers=1, num_heads=4,
                num_kv_heads=4, head_dim=128, intermediate_size=64, rope_theta=500000.0)  # fmt: skip
    return ModelConfig(**{**base, **kw})


def test_plain_and_factors():
    cfg = _config(head_dim=16, rope_theta=10000.0)
    base = rope_inv_freq(cfg)
    assert base.dtype == np.float64 and base.shape == (8,)
    np.testing.assert_allclose(base, 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16))
    ff = np.linspace(1, 8, 8)
    np.testing.assert_allclose(rope_inv_freq(cfg, ff), base / ff)
    with pytest.raises(ModelFormatError, match="rope_freqs has 3 entries"):
        rope_inv_freq(cfg, np.ones(3))


def test_linear_and_unsupported():
    base = rope_inv_freq(_config())
    np.testing.assert_allclose(rope_inv_freq(_config(rope_scaling=RopeScaling("linear", 4.0))), base / 4)
    with pytest.raises(UnsupportedError, match="yarn"):
        rope_inv_freq(_config(rope_scaling=RopeScaling("yarn", 4.0)))


def test_llama3_bands():
    """High frequencies unchanged, low ones divided by the factor, a monotone blend in between."""
    s = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    base = inv_freq(128, 500000.0)
    got = inv_freq(128, 500000.0, s)
    wavelen = 2 * math.pi / base
    high = wavelen < 8192 / 4
    low = wavelen > 8192 / 1
    np.testing.assert_array_equal(got[high], base[high])
    np.testing.assert_allclose(got[low], base[low] / 8)
    ratio = got / base
    assert np.all(np.diff(ratio) <= 1e-12) and high.any() and low.any() and (~high & ~low).any()


def test_scaling_from_hf():
    assert rope_scaling_from_hf(LLAMA3) == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert rope_scaling_from_hf({"type": "linear", "factor": 2}) == RopeScaling("linear", 2.0)
    assert rope_scaling_from_hf({"rope_type": "default", "rope_theta": 1e6}) is None
    assert rope_scaling_from_hf(None) is None
    assert rope_scaling_from_hf({"rope_type": "yarn", "factor": 4.0, "beta_fast": 32}).kind == "yarn"
    with pytest.raises(ModelFormatError, match="positive factor"):
        rope_scaling_from_hf({"type": "linear"})
    with pytest.raises(ModelFormatError, match="finite"):
        rope_scaling_from_hf({"type": "linear", "factor": "x"})


def test_scaling_from_gguf():
    md = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
          "llama.rope.scaling.original_context_length": 4096, "llama.rope.freq_base": 1e4}  # fmt: skip
    assert rope_scaling_from_gguf(md, "llama") == RopeScaling("linear", 2.0, original_context=4096)
    assert rope_scaling_from_gguf({"llama.rope.scaling.type": "none"}, "llama") is None
    assert rope_scaling_from_gguf({}, "qwen2") is None


@pytest.mark.oracle
def test_llama3_matches_transformers():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = transformers.LlamaConfig(hidden_size=128 * 4, num_attention_heads=4, head_dim=128,
                                      rope_theta=500000.0, rope_scaling=dict(LLAMA3))  # fmt: skip
    hf_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = _config(rope_scaling=rope_scaling_from_hf(LLAMA3))
    np.testing.assert_allclose(rope_inv_freq(cfg), hf_inv.double().numpy(), rtol=1e-6)
