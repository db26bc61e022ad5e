"""What ``generate`` runs on the GPU, the serving engine serves on the GPU: every architecture and every GGUF
weight type that loads, and gate and up weights of different types, through ``ServingEngine.from_engine``
(the one GPU path, several rows at once). Three requests at once give the greedy tokens each gives alone
on the engine's own GPU model (f32 KV on both sides; a near-tie, where the reference's two best logits are
closer than f32 noise, is the only accepted difference and is reported)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from realizar.engine import load_engine
from realizar.generation import SamplingParams
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from realizar.serving import ServingEngine
from tests.gguf_factory import make_gguf_model, rewrite_gguf

pytestmark = pytest.mark.gpu

DIMS = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
CASES = [("llama", "F32", False), ("llama", "F16", False), ("qwen2", "BF16", False), ("qwen3", "Q4_0", False),
         ("mistral", "Q4_1", False), ("llama", "Q5_0", False), ("qwen2", "Q5_1", False), ("qwen3", "Q8_0", False),
         ("llama", "Q4_K", False), ("mistral", "Q5_K", False), ("qwen2", "Q6_K", False), ("llama", "Q4_K", True)]
PROMPTS = [[5, 17, 42, 7, 99, 3], [9, 3, 11], [250, 1, 64, 64, 8, 13, 21, 34]]


def _near_tie(path, prompt: list[int], got: list[int], want: list[int]) -> bool:
    """At the first differing token, the reference model's two best logits are within 1e-3 of each other
    and the served token is one of them."""
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    ref = ReferenceModel.from_loaded(load_model(path))
    logits = np.asarray(ref.prefill(prompt + want[:i]), np.float64)
    top = np.sort(logits)[-2:]
    return top[1] - top[0] < 1e-3 * np.abs(logits).max() and logits[got[i]] >= top[0]


@pytest.mark.parametrize("arch,qtype,split", CASES, ids=lambda v: str(v))
def test_serving_engine_serves_what_generate_runs(tmp_path, arch, qtype, split):
    path, _, _ = make_gguf_model(arch, tmp_path, qtype, seed=4, **DIMS)
    if split:  # gate Q4_K, up f32: the split FFN
        up = load_model(path).tensors["blk.0.ffn_up.weight"].dequantize().astype(np.float32)
        path = rewrite_gguf(path, tmp_path / "split.gguf", replace_tensors={"blk.0.ffn_up.weight": (up, None)})
    engine = load_engine(path, device="cuda", max_context=64)
    assert engine.device == "cuda"
    p = SamplingParams(max_tokens=6)
    want = [engine.generate(ids, p).token_ids for ids in PROMPTS]
    with ServingEngine.from_engine(engine, kv_dtype="f32", max_batch=4, block_size=16, num_blocks=32) as serving:
        got = [r.token_ids for r in serving.generate_batch(PROMPTS, p)]
    for prompt, g, w in zip(PROMPTS, got, want):
        assert len(g) == len(w) == 6
        if g != w:
            assert _near_tie(path, prompt, g, w), f"{arch} {qtype}: served {g}, generate {w}"
            warnings.warn(f"near-tie accepted for {arch} {qtype}: served {g}, generate {w}")
