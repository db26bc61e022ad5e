"""GPU tests of the mixture-of-experts kernels (``LayerOps.moe_route``, ``moe_combine``): drawn expert counts,
experts a token, rows and logits (ties included), NaN-poisoned outputs, every element against the NumPy
reference's router (float64) and a float64 weighted sum; Qwen3-MoE's and Mixtral's shapes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.gpu.ops import LayerOps
from realizar.models.config import ModelConfig
from realizar.models.reference import route
from tests.helpers import examples, greedy_walk

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ops(device):
    return LayerOps(device)


@settings(max_examples=examples(30), deadline=None)
@given(experts=st.sampled_from([1, 8, 33, 60, 128, 256, 512]), data=st.data(), rows=st.integers(1, 300),
       norm=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_moe_route_gpu(ops, experts, data, rows, norm, seed):
    used = data.draw(st.integers(1, min(experts, 32)))
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, experts)).astype(np.float32) * 3
    if data.draw(st.booleans()):
        logits = np.round(logits).astype(np.float32) + 0.5
    lb = ops.to_device(logits.reshape(-1))
    ids = ops.to_device(np.full(rows * used, 0xFFFFFFFF, np.uint32))
    w = ops.to_device(np.full(rows * used, np.nan, np.float32))
    ops.moe_route(lb, ids, w, rows, experts=experts, used=used, norm=norm)
    c = ModelConfig("qwen3moe", 16, 8, 1, 2, 1, 4, 0, num_experts=experts, num_experts_used=used,
                    expert_ffn_size=4, expert_weights_norm=norm)
    want_ids, want_w = route(logits, c)
    np.testing.assert_array_equal(ids.to_numpy().reshape(rows, used), want_ids)
    np.testing.assert_allclose(w.to_numpy().reshape(rows, used), want_w, rtol=2e-5, atol=1e-7)
    for b in (lb, ids, w):
        b.free()


@pytest.mark.parametrize("rows,used,hidden", [(1, 8, 2048), (64, 8, 2048), (3, 2, 4096), (5, 1, 1000)])
def test_moe_combine_gpu(ops, rows, used, hidden):
    rng = np.random.default_rng(rows + used)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    y = rng.standard_normal((rows, used, hidden)).astype(np.float32)
    w = (rng.random((rows, used)) + 0.01).astype(np.float32)
    xb, yb, wb = ops.to_device(x.reshape(-1)), ops.to_device(y.reshape(-1)), ops.to_device(w.reshape(-1))
    ops.moe_combine(xb, yb, wb, rows, hidden, used=used)
    want = x + np.einsum("rs,rsh->rh", w.astype(np.float64), y.astype(np.float64))
    np.testing.assert_allclose(xb.to_numpy().reshape(rows, hidden), want, rtol=1e-5, atol=1e-5)
    for b in (xb, yb, wb):
        b.free()


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", "Q4_K"), ("mixtral", "Q8_0"), ("qwen3_moe", "F16"),
                                        ("mixtral", "Q4_0"), ("qwen3_moe", "Q4_1"), ("mixtral", "Q5_0"),
                                        ("qwen3_moe", "Q5_1"), ("mixtral", "Q5_K"), ("qwen3_moe", "Q6_K")])
def test_moe_model_decode_gpu(device, arch, qtype, tmp_path):
    """GpuModel of a small random MoE model (8 experts, 2 a token, rows of 256) in every weight type on the GPU
    against the reference: the prompt's prefill and 32 greedy decode steps through the decode graph (both fed the
    reference's tokens): logits within 2e-3 of the largest at every step, the same greedy token but at a near-tie
    (the reference's two best closer than twice the difference)."""
    from realizar.gpu.model import GpuModel
    from realizar.models.loader import load_model
    from realizar.models.reference import ReferenceModel
    from tests.gguf_factory import make_gguf_model

    path = make_gguf_model(arch, tmp_path, qtype=qtype, seed=5, init_std=0.2, num_layers=2, hidden_size=256,
                           num_heads=4, num_kv_heads=2, intermediate_size=256, expert_ffn=256, num_experts=8,
                           experts_used=2)[0]
    loaded = load_model(path)
    ref = ReferenceModel.from_loaded(loaded, max_len=64)
    model = GpuModel.from_loaded(loaded, max_len=64, device=device)
    want, got = greedy_walk(ref, model, [5, 17, 42, 99, 7], 32)
    for step, (g, w) in enumerate(zip(got, want)):
        err = np.abs(g - w).max()
        assert err <= 2e-3 * np.abs(w).max(), f"step {step}"
        top2 = np.sort(w)[-2:]
        assert int(np.argmax(g)) == int(np.argmax(w)) or top2[1] - top2[0] <= 2 * err, f"step {step}: not a near-tie"


@pytest.mark.parametrize("arch,qtype,grouped_min", [("qwen3_moe", "Q4_K", 8), ("mixtral", "Q8_0", 8), ("qwen3_moe", "F16", 8),
                                                    ("qwen3_moe", "Q6_K", 1), ("mixtral", "Q4_0", 1),
                                                    ("qwen3_moe", "Q5_K", 10**6), ("mixtral", "Q4_1", 1),
                                                    ("qwen3_moe", "Q5_1", 8), ("mixtral", "Q5_0", 1)])
def test_batched_moe_rows_gpu(device, arch, qtype, grouped_min, tmp_path, monkeypatch):
    """The batched path of a model of 8 experts (prefill chunks, decode steps of three sequences) against the
    reference, one sequence at a time (tests.test_moe.batched_moe_matches_the_reference): batches from
    ``grouped_min`` rows on through the grouped expert GEMM, fewer through the expert GEMV."""
    from tests.test_moe import batched_moe_matches_the_reference

    batched_moe_matches_the_reference(device, arch, qtype, tmp_path, monkeypatch, grouped_min=grouped_min, hidden=256,
                                      expert_ffn=256)
