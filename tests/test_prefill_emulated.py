"""Batched prefill on the CPU: :class:`~realizar.gpu.model.GpuModel` on an ``EmulatedDevice`` running the
real PTX of the chunked path (f16 weight expansion, tensor-core GEMMs, batched RoPE + append, causal
attention over the cache), against the NumPy reference model: logits of the prompt's last position
within f16 rounding, and the same greedy continuation, for every architecture, prompts shorter than,
equal to and across chunk boundaries, and prompts continuing after tokens already in the cache."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.errors import ContextOverflowError, InvalidRequestError, ShapeError
from realizar.gpu.model import GpuModel
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from tests.gguf_factory import make_gguf_model
from tests.model_factory import KQUANT_DIMS
from tests.helpers import rel_err as _rel_err, tiered

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1)  # head_dim 32
CASES = [("llama", "Q8_0", 2, TINY), ("qwen2", "Q4_0", 1, TINY), ("qwen3", "Q4_1", 1, TINY),
         ("mistral", "F16", 1, TINY), ("llama", "Q4_K", 1, dict(KQUANT_DIMS, vocab_size=320))]
CHUNK = 8
MAX_LEN = 48
RTOL = 1e-2  # f16 activations and weights in the GEMMs: max |gpu - ref| / max |ref|
CONTINUE = 4  # greedy tokens after the prompt


@pytest.fixture(scope="module", params=tiered(CASES, {0, 1}, ids=lambda c: f"{c[0]}-{c[1]}"))
def loaded(request, tmp_path_factory):
    arch, qtype, layers, dims = request.param
    path, _, _ = make_gguf_model(arch, tmp_path_factory.mktemp(f"p-{arch}-{qtype}"), qtype, seed=3,
                                 num_layers=layers, **dims)
    return load_model(path)


def _model(loaded, **kw) -> GpuModel:
    kw = {"prefill_chunk": CHUNK, "prefill_min_batch": 1, **kw}
    return GpuModel.from_loaded(loaded, max_len=MAX_LEN, device=cuda.EmulatedDevice(sm_count=4), **kw)


def _greedy(model, logits, n: int) -> list[int]:
    toks = []
    for _ in range(n):
        toks.append(logits.greedy_token() if hasattr(logits, "greedy_token") else int(np.argmax(logits)))
        logits = model.decode(toks[-1])
    return toks


@pytest.mark.parametrize("length", [1, 7, CHUNK, 2 * CHUNK + 3])
def test_batched_prefill_matches_reference(loaded, length):
    rng = np.random.default_rng(length)
    prompt = [int(t) for t in rng.integers(3, 320, size=length)]
    ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
    gpu = _model(loaded)
    assert gpu.batched_prefill_off is None
    ref_logits, gpu_logits = ref.prefill(prompt), gpu.prefill(prompt)
    assert _rel_err(gpu_logits, ref_logits) < RTOL
    assert gpu.position == length
    assert _greedy(gpu, gpu_logits, CONTINUE) == _greedy(ref, ref_logits, CONTINUE)


def test_prefill_continues_after_cached_tokens(loaded):
    """A second prompt after a first (and a decode step) attends over everything cached before it."""
    rng = np.random.default_rng(11)
    first, second = [int(t) for t in rng.integers(3, 320, size=5)], [int(t) for t in rng.integers(3, 320, size=11)]
    ref, gpu = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN), _model(loaded)
    t_ref = int(np.argmax(ref.prefill(first)))
    assert gpu.prefill(first).greedy_token() == t_ref
    ref.decode(t_ref)
    gpu.decode(t_ref)
    ref_logits, gpu_logits = ref.prefill(second), gpu.prefill(second)
    assert _rel_err(gpu_logits, ref_logits) < RTOL
    assert _greedy(gpu, gpu_logits, CONTINUE) == _greedy(ref, ref_logits, CONTINUE)


def test_short_prompts_take_the_decode_graph_and_agree(loaded):
    prompt = [5, 17, 42]
    batched, stepped = _model(loaded), _model(loaded, prefill_min_batch=16)
    a, b = np.asarray(batched.prefill(prompt)), np.asarray(stepped.prefill(prompt))
    assert stepped.steps == len(prompt) and batched.steps == 1
    assert _rel_err(a, b) < RTOL


def test_prefill_refuses_bad_input(loaded):
    gpu = _model(loaded)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        gpu.prefill([1, 2, 10**6])
    assert gpu.position == 0
    with pytest.raises(ContextOverflowError):
        gpu.prefill([3] * (MAX_LEN + 1))
    with pytest.raises(ShapeError, match="prefill_chunk"):
        _model(loaded, prefill_chunk=0)
    off = _model(loaded, prefill_chunk=None)
    assert off.batched_prefill_off and off.prefill([3, 4]).greedy_token() >= 0


def test_chunk_graphs_replay_what_eager_chunks_compute(loaded):
    """The second chunk of a (rows, position) is captured and later ones replay it: the same logits as
    the eager first run, for the same prompt and for another prompt of a length sharing the rows."""
    rng = np.random.default_rng(5)
    a, b = [int(t) for t in rng.integers(3, 320, size=13)], [int(t) for t in rng.integers(3, 320, size=12)]
    gpu = _model(loaded, prefill_chunk=16)
    runs = []
    for prompt in (a, a, a, b):
        gpu.reset()
        runs.append(np.asarray(gpu.prefill(prompt)).copy())
    assert len(gpu.sequence._prefill.graphs) == 1  # rows 16 at position 0: captured once, replayed after
    assert runs[0].tobytes() == runs[1].tobytes() == runs[2].tobytes()
    ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
    assert _rel_err(runs[3], ref.prefill(b)) < RTOL
    fresh = _model(loaded, prefill_chunk=16, use_graph=False)
    assert np.asarray(fresh.prefill(b)).tobytes() == runs[3].tobytes()


@pytest.mark.parametrize("length", [1, CHUNK + 1, 2 * CHUNK + 1])
def test_one_token_chunks_take_the_decode_step(loaded, length):
    """A chunk of one token (eager chunks of a length one past a multiple of the chunk, or a one-token
    prompt) runs the one-row decode step: the same logits as the reference, no f16/f32 mix-up."""
    rng = np.random.default_rng(length)
    prompt = [int(t) for t in rng.integers(3, 320, size=length)]
    ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
    gpu = _model(loaded, use_graph=False)
    assert _rel_err(gpu.prefill(prompt), ref.prefill(prompt)) < RTOL
    assert gpu.position == length


def test_released_cache_outdates_logits_and_the_bound_sequence_is_checked(loaded):
    gpu = _model(loaded)
    logits = gpu.prefill([5, 6, 7])
    gpu.release_kv()
    with pytest.raises(InvalidRequestError, match="overwritten"):
        np.asarray(logits)
    seq = gpu.sequence
    seq.decode([3], [0], [[2]])  # a step with its own table replaces the bound one
    with pytest.raises(ShapeError, match="bind_sequence"):
        seq.step_one(3, 1)


@pytest.mark.full
def test_prefill_chunk_on_gemm_ws_with_the_k_split(tmp_path, monkeypatch):
    """A prefill chunk of more than WS_OVER_WG_ROWS rows on the emulated sm_90 device with the warpgroup GEMMs allowed
    (on a GPU they are) and the policy splitting K over two CTAs (WS_SPLIT_K on): the Linear sizes its SplitSpace
    before the chunk, every layer GEMM runs on gemm_ws (the split ones through it), and the logits and greedy
    continuation are the reference model's."""
    import realizar.gpu.gemm_wg as host
    from realizar.gpu.policy.gemm import WS_OVER_WG_ROWS

    monkeypatch.setattr(host, "wg_applies", lambda *a: True)
    monkeypatch.setattr(host, "WS_SPLIT_K", 0.01)
    monkeypatch.setattr(host, "WS_SPLIT_MIN_CHUNKS", 1)
    monkeypatch.setattr(host, "WS_SPLIT_K_TILES", (128, 256))
    launched = []
    ws = host.GemmWgOps.gemm_ws
    monkeypatch.setattr(host.GemmWgOps, "gemm_ws", lambda self, *a, **kw: (launched.append(kw.get("split")),
                                                                           ws(self, *a, **kw))[1])
    dims = dict(vocab_size=320, hidden_size=512, intermediate_size=512, num_heads=4, num_kv_heads=2)  # 2 chunks of K
    path, _, _ = make_gguf_model("llama", tmp_path, "Q4_K", seed=4, num_layers=1, **dims)
    loaded = load_model(path)
    n = max(WS_OVER_WG_ROWS, 128) + 8  # (a 128-token tile, which the K split needs, then a ragged one)
    # (8 SMs: o and down take one consumer warpgroup a CTA, so the policy splits their K)
    gpu = GpuModel.from_loaded(loaded, max_len=n + 4, device=cuda.EmulatedDevice(target="sm_90", sm_count=8),
                               prefill_chunk=n, prefill_min_batch=1)
    ref = ReferenceModel.from_loaded(loaded, max_len=n + 4)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 320, size=n)]
    ref_logits, gpu_logits = ref.prefill(prompt), gpu.prefill(prompt)
    assert _rel_err(gpu_logits, ref_logits) < RTOL
    assert len(launched) >= 4 and any(s is not None for s in launched), launched  # (qkv, o, gate/up, down)
    assert _greedy(gpu, gpu_logits, 2) == _greedy(ref, ref_logits, 2)
