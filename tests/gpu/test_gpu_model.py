"""The GPU model against the NumPy reference model: same logits (float32 noise), same greedy tokens,
for every architecture and a spread of GGUF weight types, eager, through the captured graph and through
the manually built one."""

from __future__ import annotations

import numpy as np
import pytest

from realizar.engine import load_engine
from realizar.generation import SamplingParams
from realizar.gpu.model import GpuModel
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from tests.gguf_factory import make_gguf_model
from tests.model_factory import KQUANT_DIMS

pytestmark = pytest.mark.gpu

DIMS = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)
CASES = [
    ("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_1"), ("qwen2", "Q4_0"), ("qwen3", "F16"),
    ("mistral", "Q5_0"), ("llama", "Q5_1"), ("llama", "Q4_K"), ("qwen2", "Q6_K"), ("llama", "Q5_K"),
]


def _logits_close(gpu: np.ndarray, ref: np.ndarray, what: str) -> None:
    gpu, ref = np.asarray(gpu, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(gpu).all(), what
    err = np.abs(gpu - ref).max() / np.abs(ref).max()
    assert err < 2e-4, f"{what}: max |gpu - ref| / max |ref| = {err:.2e}"


@pytest.mark.parametrize("use_graph", [False, True])
@pytest.mark.parametrize("arch,qtype", CASES)
def test_gpu_model_matches_reference(tmp_path, arch, qtype, use_graph):
    dims = {**DIMS, **(KQUANT_DIMS if qtype.endswith("_K") else {})}
    path, _, _ = make_gguf_model(arch, tmp_path, qtype, seed=11, **dims)
    loaded = load_model(path)
    ref = ReferenceModel.from_loaded(loaded, max_len=64)
    gpu = GpuModel.from_loaded(loaded, max_len=64, use_graph=use_graph)
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, 320, size=7)]
    ref_logits = ref.prefill(prompt)
    dev_logits = gpu.prefill(prompt)
    for step in range(12):  # greedy continuation: the tokens must agree, the logits stay close
        ref_tok = int(np.argmax(ref_logits))
        assert dev_logits.greedy_token() == ref_tok, f"{arch}/{qtype}: step {step} token differs"
        _logits_close(np.asarray(dev_logits), ref_logits, f"{arch}/{qtype} step {step}")
        ref_logits, dev_logits = ref.decode(ref_tok), gpu.decode(ref_tok)


# large enough that the tensor-core GEMV takes every matrix on a 132-SM GPU, so LayerOps.upload stores
# them tile-major (QKV, O with 16-row warps, the fused gate/up, down, the untied LM head)
TILE_DIMS = dict(vocab_size=8448, hidden_size=2048, intermediate_size=8192, num_heads=16, num_kv_heads=8, num_layers=1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_gpu_model_with_tile_major_weights_matches_reference(tmp_path, qtype):
    path, _, _ = make_gguf_model("llama", tmp_path, qtype, seed=13, **TILE_DIMS)
    loaded = load_model(path)
    ref = ReferenceModel.from_loaded(loaded, max_len=32)
    gpu = GpuModel.from_loaded(loaded, max_len=32, use_graph=True)
    lay = gpu.layers[0]
    layouts = {w.name or "w": w.layout for w in (*lay.qkv, lay.attn_out, lay.gate_up, lay.down, gpu.lm_head)}
    assert gpu.embed.layout == "rows"  # the embedding reads GGUF rows
    if gpu.ops.sm_count >= 120:  # (the dispatcher's thresholds are per SM count)
        assert lay.gate_up.layout == "glu-tiles" and "tiles" in layouts.values(), layouts
    rng = np.random.default_rng(9)
    prompt = [int(t) for t in rng.integers(3, 8000, size=5)]
    ref_logits, dev_logits = ref.prefill(prompt), gpu.prefill(prompt)
    for step in range(6):
        ref_tok = int(np.argmax(ref_logits))
        assert dev_logits.greedy_token() == ref_tok, f"{qtype}: step {step} token differs ({layouts})"
        _logits_close(np.asarray(dev_logits), ref_logits, f"{qtype} step {step} ({layouts})")
        ref_logits, dev_logits = ref.decode(ref_tok), gpu.decode(ref_tok)


def test_engine_on_cuda_generates_what_the_cpu_engine_generates(tmp_path):
    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=3, **DIMS)
    params = SamplingParams(max_tokens=20, temperature=0.0)
    cpu = load_engine(path, device="cpu").generate("hello world", params)
    gpu_engine = load_engine(path, device="cuda")
    assert gpu_engine.device == "cuda"
    gpu = gpu_engine.generate("hello world", params)
    assert gpu.token_ids == cpu.token_ids and gpu.text == cpu.text


def test_forward_gpu_resident_to_token_id_and_overflow(tmp_path):
    from realizar.errors import ContextOverflowError, InvalidRequestError

    path, _, _ = make_gguf_model("qwen2", tmp_path, "Q8_0", seed=4, **DIMS)
    loaded = load_model(path)
    ref = ReferenceModel.from_loaded(loaded, max_len=16)
    gpu = GpuModel.from_loaded(loaded, max_len=16)
    tok = 17
    for pos in range(16):
        expected = int(np.argmax(ref.decode(tok)))
        tok_gpu = gpu.forward_gpu_resident_to_token_id(tok, pos)
        assert tok_gpu == expected, f"position {pos}"
        tok = expected
    with pytest.raises(ContextOverflowError, match="max_len"):
        gpu.forward_gpu_resident_to_token_id(tok, 16)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        gpu.forward_gpu_resident_to_token_id(10_000, 0)


def test_programmatic_dependent_launch_changes_nothing_but_speed(tmp_path):
    path, _, _ = make_gguf_model("qwen3", tmp_path, "Q4_0", seed=8, **DIMS)
    loaded = load_model(path)
    models = [GpuModel.from_loaded(loaded, max_len=32, pdl=flag) for flag in (True, False)]
    prompt = [5, 77, 300, 12, 9]
    a, b = (np.asarray(m.prefill(prompt)) for m in models)
    assert a.tobytes() == b.tobytes()
    for tok in (3, 4, 5):
        a, b = (np.asarray(m.decode(tok)) for m in models)
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("arch,qtype", [("llama", "Q8_0"), ("qwen3", "Q4_K")])
def test_captured_and_manual_decode_graphs_replay_bit_identically(tmp_path, arch, qtype):
    """The decode graph built by stream capture and the one built node by node (``graph="manual"``)
    replay the same kernels with the same arguments: the same logits bytes and tokens as each other
    and as eager launches, and the reference model's greedy tokens."""
    dims = {**DIMS, **(KQUANT_DIMS if qtype.endswith("_K") else {})}
    path, _, _ = make_gguf_model(arch, tmp_path, qtype, seed=17, **dims)
    loaded = load_model(path)
    ref = ReferenceModel.from_loaded(loaded, max_len=32)
    models = {"eager": GpuModel.from_loaded(loaded, max_len=32, use_graph=False),
              "capture": GpuModel.from_loaded(loaded, max_len=32, graph="capture"),
              "manual": GpuModel.from_loaded(loaded, max_len=32, graph="manual")}
    prompt = [7, 250, 31, 99, 4, 180]
    ref_logits = ref.prefill(prompt)
    logits = {name: m.prefill(prompt) for name, m in models.items()}
    graphs = {name: models[name].sequence.graphs.graph((1, True, False)).graph for name in ("capture", "manual")}
    assert graphs["capture"].kind == "captured"
    assert graphs["manual"].kind == "manual"
    assert graphs["manual"].num_kernels == graphs["capture"].num_kernels
    for step in range(8):
        ref_tok = int(np.argmax(ref_logits))
        host = {name: np.asarray(lg) for name, lg in logits.items()}
        tokens = {name: lg.greedy_token() for name, lg in logits.items()}
        assert set(tokens.values()) == {ref_tok}, f"step {step}: tokens {tokens}, reference {ref_tok}"
        for name in ("capture", "manual"):
            assert host[name].tobytes() == host["eager"].tobytes(), f"step {step}: {name} logits differ from eager"
        _logits_close(host["manual"], ref_logits, f"{arch}/{qtype} step {step}")
        ref_logits = ref.decode(ref_tok)
        logits = {name: m.decode(ref_tok) for name, m in models.items()}


def test_unknown_graph_mode_is_refused(tmp_path):
    from realizar.errors import ShapeError

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=2, **DIMS)
    with pytest.raises(ShapeError, match="graph must be one of"):
        GpuModel.from_loaded(load_model(path), max_len=16, graph="replay")
