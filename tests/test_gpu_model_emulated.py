"""The GPU model on the CPU: :class:`realizar.gpu.model.GpuModel` on an ``EmulatedDevice`` against the
NumPy :class:`~realizar.models.reference.ReferenceModel`, for tiny models of each architecture and a
spread of weight types, issued eagerly and through a decode graph built by stream capture or node by
node. Each model is built and run once per module (fixtures); the tests then compare what was kept."""

from __future__ import annotations

import numpy as np
import pytest

from realizar import cuda
from realizar.gpu.model import GpuModel
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel
from tests.gguf_factory import make_gguf_model
from tests.helpers import tiered
from tests.model_factory import KQUANT_DIMS

PROMPT = [5, 17, 42]
K_PROMPT = [5]  # K-quant models are 4x wider: one prompt token keeps the file fast
DECODE_STEPS = 4
MAX_LEN = 16
RTOL = 2e-4  # max |gpu - ref| / max |ref| per step
MODES = ("eager", "capture", "manual")

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_heads=2, num_kv_heads=1)  # head_dim 32
# (architecture, weight type, layers, dims, prompt): every architecture, every non-K block type, and
# K-quants (tensor-core GEMVs at these shapes) at the smallest dimensions whose rows they can hold
KDIMS = dict(KQUANT_DIMS, vocab_size=320)
CASES = [
    ("llama", "F32", 2, TINY, PROMPT),
    ("llama", "Q8_0", 1, TINY, PROMPT),
    ("qwen2", "F16", 1, TINY, PROMPT),
    ("qwen2", "Q4_0", 2, TINY, PROMPT),
    ("qwen3", "Q4_1", 1, TINY, PROMPT),
    ("mistral", "Q5_0", 1, TINY, PROMPT),
    ("mistral", "Q5_1", 1, TINY, PROMPT),
    ("llama", "Q4_K", 1, KDIMS, K_PROMPT),
    ("qwen3", "Q6_K", 1, KDIMS, K_PROMPT),
]


def _case_id(case) -> str:
    arch, qtype, layers, _, _ = case
    return f"{arch}-{qtype}-{layers}l"


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _launch_key(name, grid, block, shared, params) -> tuple:
    return (name, tuple(grid), tuple(block), int(shared), tuple(sorted(params.items())))


def _run_gpu(loaded, mode: str, prompt: list[int], feed: list[int]) -> dict:
    """Prefill ``prompt`` then decode ``feed`` (the reference's greedy tokens) on a fresh device."""
    dev = cuda.EmulatedDevice(sm_count=4)
    model = GpuModel.from_loaded(loaded, max_len=MAX_LEN, device=dev, use_graph=mode != "eager",
                                 graph="manual" if mode == "manual" else "capture")
    logits, tokens = [], []
    out = model.prefill(prompt)
    for tok in [None, *feed]:
        if tok is not None:
            out = model.decode(tok)
        tokens.append(out.greedy_token())
        logits.append(np.asarray(out).copy())
    graph = model.sequence.graphs.graph((1, True, False))
    records = [] if graph is None else [
        _launch_key(r.kernel.name, r.grid, r.block, r.shared_bytes, {p.name: r.args.get(p.name) for p in r.args.params})
        for r in graph.graph.records]
    return dict(tokens=tokens, logits=logits, launches=[_launch_key(*ln) for ln in dev.launches], records=records,
                steps=model.steps, prompt=prompt)


@pytest.fixture(scope="module", params=tiered(CASES, {1, 3, 4, 6}, ids=_case_id))
def runs(request, tmp_path_factory):
    arch, qtype, layers, dims, prompt = request.param
    path, _, _ = make_gguf_model(arch, tmp_path_factory.mktemp(f"{arch}-{qtype}"), qtype, seed=7,
                                 num_layers=layers, **dims)
    loaded = load_model(path)
    ref = ReferenceModel.from_loaded(loaded, max_len=MAX_LEN)
    ref_logits = [ref.prefill(prompt)]
    for _ in range(DECODE_STEPS):
        ref_logits.append(ref.decode(int(np.argmax(ref_logits[-1]))))
    feed = [int(np.argmax(x)) for x in ref_logits[:-1]]
    result = {"ref": dict(logits=ref_logits, tokens=[int(np.argmax(x)) for x in ref_logits])}
    for mode in MODES:
        result[mode] = _run_gpu(loaded, mode, prompt, feed)
    return result


@pytest.mark.parametrize("mode", MODES)
def test_gpu_model_matches_reference(runs, mode):
    ref, got = runs["ref"], runs[mode]
    assert got["tokens"] == ref["tokens"]
    for step, (g, r) in enumerate(zip(got["logits"], ref["logits"])):
        assert _rel_err(g, r) < RTOL, f"step {step}: relative error {_rel_err(g, r):.2e}"


def test_captured_and_manual_graphs_replay_bit_identically(runs):
    cap, man = runs["capture"], runs["manual"]
    assert [x.tobytes() for x in cap["logits"]] == [x.tobytes() for x in man["logits"]]
    # the same kernels ran eagerly, so graph replays also match the eager model bit for bit
    assert [x.tobytes() for x in cap["logits"]] == [x.tobytes() for x in runs["eager"]["logits"]]


def test_graph_records_are_the_eager_launches(runs):
    eager = runs["eager"]["launches"]
    steps = runs["eager"]["steps"]
    assert steps == len(runs["eager"]["prompt"]) + DECODE_STEPS and len(eager) % steps == 0
    per_step = len(eager) // steps
    one_step = eager[:per_step]
    assert eager == one_step * steps  # step values live on the device: every step launches the same
    for mode in ("capture", "manual"):
        assert runs[mode]["records"] == one_step, mode  # same kernels, shapes and arguments, same order
        assert runs[mode]["launches"] == eager, mode  # what replays ran is what eager steps ran


def test_capture_holds_only_the_captured_stream():
    """Work on another stream inside a capture runs at once and is not part of the graph (as a driver's
    capture): replaying the graph must not run it again."""
    dev = cuda.EmulatedDevice(sm_count=4)
    k = cuda.module_cache(dev).get("vector_add", vec=1)
    n = 256
    a = cuda.GpuBuffer.from_numpy(np.arange(n, dtype=np.float32), device=dev)
    b = cuda.GpuBuffer.from_numpy(np.ones(n, np.float32), device=dev)
    x, y = cuda.GpuBuffer(n, device=dev), cuda.GpuBuffer(n, device=dev)
    s, other = cuda.Stream(dev), cuda.Stream(dev)
    with cuda.capture(s) as cap:
        cuda.launch(k, 1, 256, k.args(a, b, x, n), stream=s)
        cuda.launch(k, 1, 256, k.args(a, a, y, n), stream=other)
    assert np.array_equal(y.to_numpy(), 2 * np.arange(n, dtype=np.float32))  # ran during the capture
    assert cap.graph.num_kernels == 1 and cap.graph.records[0].stream is s
    y.fill_bytes(0)
    cap.graph.instantiate().launch(s)
    assert np.array_equal(x.to_numpy(), np.arange(n, dtype=np.float32) + 1)
    assert not y.to_numpy().any()


def test_heads_the_paged_cache_cannot_hold_are_refused_before_any_upload(tmp_path):
    """head_dim 16 (the paged attention takes 32 .. 256): a typed UnsupportedError naming the limit,
    and the engine on device="emulate" says the model cannot run on the GPU."""
    from realizar.engine import GpuUnavailableError, load_engine
    from realizar.errors import UnsupportedError

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=1, num_layers=1, vocab_size=320, hidden_size=64,
                                 intermediate_size=128, num_heads=4, num_kv_heads=2)
    with pytest.raises(UnsupportedError, match="head_dim must be one of"):
        GpuModel.from_loaded(load_model(path), max_len=MAX_LEN, device=cuda.EmulatedDevice(sm_count=4))
    with pytest.raises(GpuUnavailableError, match="cannot run on the GPU.*head_dim"):
        load_engine(path, device="emulate")


def test_prompt_ids_are_checked_before_any_launch(tmp_path):
    """Bad prompts raise InvalidRequestError naming what came, before anything is launched; numpy arrays and
    lists of ints are the same prompt."""
    from realizar.errors import InvalidRequestError
    from realizar.gpu.batch import token_ids

    path, _, _ = make_gguf_model("llama", tmp_path, "Q8_0", seed=1, num_layers=1, **TINY)
    dev = cuda.EmulatedDevice(sm_count=4)
    model = GpuModel.from_loaded(load_model(path), max_len=MAX_LEN, device=dev)
    launches = len(dev.launches)
    for bad, match in (([], "at least one token"), ([[1, 2]], "shape"), ([1.5, 2.0], "integers, got float64"),
                       (["a"], "integers"), ([True], "integers, got bool"), ([5, -1], "token id -1 outside"),
                       ([319, 320], "token id 320 outside the vocabulary of 320")):
        with pytest.raises(InvalidRequestError, match=match):
            model.prefill(bad)
    assert len(dev.launches) == launches and model.position == 0
    assert token_ids(np.array([3, 4], np.uint16), 320).tolist() == token_ids([3, 4], 320).tolist() == [3, 4]
