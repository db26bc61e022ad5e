"""Mixture-of-experts models (Qwen3-MoE, and Mixtral in ``llama`` GGUF files): loading (config, metadata checks,
``realizar info``), the NumPy reference's router and expert FFN against per-token float64 loops, generation and
serving on the CPU, clear refusals where experts are not supported yet (GPU, tensor parallelism, other routers);
and, marked ``oracle``, the reference's logits against transformers' at every position."""

from __future__ import annotations

import json

import numpy as np
import pytest

from realizar.errors import ModelFormatError, ShapeError, UnsupportedError
from realizar.models.config import ModelConfig
from realizar.models.loader import load_model
from realizar.models.reference import ReferenceModel, moe_feed_forward, route, silu
from tests.gguf_factory import make_gguf_model, rewrite_gguf
from tests.helpers import greedy_walk
from tests.model_factory import MOE_ARCHS, hf_logits, load_hf_model, read_hf_tensors

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    return {arch: make_gguf_model(arch, d, qtype="F32", seed=i, init_std=0.3)[:2] for i, arch in enumerate(MOE_ARCHS)}


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 320, n)]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_config_from_gguf(arch, moe_files):
    path, hf_dir = moe_files[arch]
    c = load_model(path).config
    hf = json.loads((hf_dir / "config.json").read_text())
    assert c.architecture == GGUF_ARCH[arch] and c.is_moe
    assert (c.num_experts, c.num_experts_used) == (hf["num_local_experts"], hf["num_experts_per_tok"])
    assert c.expert_ffn_size == hf.get("moe_intermediate_size", hf["intermediate_size"])
    assert c.expert_weights_norm and c.qk_norm == (arch == "qwen3_moe")
    total, active = c.parameter_counts()
    assert total == sum(int(np.prod(x.shape)) for x in read_hf_tensors(hf_dir).values())
    expert = 3 * c.hidden_size * c.expert_ffn_size
    assert total - active == c.num_layers * (c.num_experts - c.num_experts_used) * expert


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_info_shows_the_experts(arch, moe_files, capsys):
    from realizar.cli import main

    path = moe_files[arch][0]
    assert main(["info", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["experts"] == {"count": 4, "used": 2, "ffn_size": 32, "weights_norm": True}
    assert info["active_parameters"] < info["parameters"]
    assert main(["info", str(path)]) == 0
    text = capsys.readouterr().out
    assert "4 experts of 32 (SwiGLU), 2 a token" in text and "active a token" in text


def test_route_picks_the_largest_probabilities():
    c = ModelConfig("qwen3moe", 16, 8, 1, 2, 1, 4, 0, num_experts=4, num_experts_used=2, expert_ffn_size=4)
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [1.0, 1.0, 1.0, 0.0], [5.0, -1.0, 4.0, 4.0]], np.float32)
    ids, w = route(logits, c)
    assert ids.tolist() == [[1, 3], [0, 1], [0, 2]]  # (equal probabilities: the lower expert first)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    top = np.take_along_axis(p, ids, 1)
    np.testing.assert_allclose(w, top / top.sum(1, keepdims=True), rtol=1e-6)
    ids2, w2 = route(logits, c.__class__(**{**c.__dict__, "expert_weights_norm": False}))
    assert (ids2 == ids).all()
    np.testing.assert_allclose(w2, top, rtol=1e-6)


def test_moe_ffn_equals_a_per_token_loop():
    rng = np.random.default_rng(3)
    e, k, h, f, s = 6, 2, 16, 8, 9
    c = ModelConfig("qwen3moe", 32, h, 1, 2, 1, 8, 0, num_experts=e, num_experts_used=k, expert_ffn_size=f)

    class L:
        router = rng.standard_normal((e, h)).astype(np.float32)
        w_gate_up_exps = rng.standard_normal((e, 2 * f, h)).astype(np.float32) * 0.5
        w_down_exps = rng.standard_normal((e, h, f)).astype(np.float32) * 0.5

    x = rng.standard_normal((s, h)).astype(np.float32)
    got = moe_feed_forward(L, x, c)
    want = np.zeros((s, h))
    for t in range(s):  # float64, token by token, every expert's weight from the softmax
        z = L.router.astype(np.float64) @ x[t]
        p = np.exp(z - z.max())
        p /= p.sum()
        chosen = sorted(range(e), key=lambda i: (-p[i], i))[:k]
        for i in chosen:
            gu = L.w_gate_up_exps[i].astype(np.float64) @ x[t]
            y = L.w_down_exps[i].astype(np.float64) @ (silu(gu[:f]) * gu[f:])
            want[t] += p[i] / sum(p[j] for j in chosen) * y
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert len({tuple(sorted(r)) for r in route(x @ L.router.T, c)[0]}) > 1  # (tokens chose different experts)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_generation_and_serving_on_the_cpu(arch, moe_files, capsys):
    from realizar.engine import load_engine
    from realizar.generation import SamplingParams
    from realizar.serving import ServingEngine

    path = moe_files[arch][0]
    engine = load_engine(str(path), device="cpu")
    want = [engine.generator.generate(_ids(s, 6), SamplingParams(max_tokens=8, temperature=0)).token_ids
            for s in range(3)]
    serving = ServingEngine.from_engine(engine, max_batch=4)
    try:
        handles = [serving.submit(_ids(s, 6), SamplingParams(max_tokens=8, temperature=0)) for s in range(3)]
        got = [h.wait(timeout=60).token_ids for h in handles]
    finally:
        serving.close()
    assert got == want


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", "F32"), ("mixtral", "Q8_0"), ("qwen3_moe", "Q4_0")])
@pytest.mark.parametrize("mode", ["eager", "capture"])
def test_the_emulated_gpu_matches_the_reference(arch, qtype, mode, tmp_path):
    """GpuModel on the emulated device (one row a step: the router's top-k on the device, the expert GEMVs
    reading the experts their ids name, the weighted sum) against the reference, prefill and greedy decode, eager
    and through the captured decode graph (the same graph whatever the router picks)."""
    from realizar import cuda
    from realizar.gpu.model import GpuModel

    path = make_gguf_model(arch, tmp_path, qtype=qtype, seed=4, init_std=0.3, num_layers=1, hidden_size=64,
                           num_heads=2, num_kv_heads=1)[0]
    loaded = load_model(path)
    ref = ReferenceModel.from_loaded(loaded, max_len=16)
    model = GpuModel.from_loaded(loaded, max_len=16, device=cuda.EmulatedDevice(sm_count=4),
                                 use_graph=mode != "eager")
    want, got = greedy_walk(ref, model, [5, 17, 42], 4)
    for step, (g, w) in enumerate(zip(got, want)):
        assert np.abs(g - w).max() <= 2e-4 * np.abs(w).max(), f"step {step}"
    assert [int(np.argmax(g)) for g in got] == [int(np.argmax(w)) for w in want]


def test_batches_of_a_moe_model_with_few_experts_run_one_row_at_a_time_on_the_gpu(moe_files):
    from realizar.gpu.linear import rows_unsupported
    from realizar.models.loader import load_model as lm
    from realizar import cuda

    reason = rows_unsupported(cuda.EmulatedDevice(target="sm_90"), lm(moe_files["qwen3_moe"][0]).config)  # 4 experts
    assert reason == ("mixture-of-experts layers with a number of experts not a multiple of 8 run one row at a time "
                      "on the GPU")


@pytest.mark.parametrize("arch,qtype,grouped_min", [("qwen3_moe", "Q4_0", 8), ("mixtral", "Q8_0", 8),
                                                    ("qwen3_moe", "Q4_K", 1), ("mixtral", "Q8_0", 10**6),
                                                    ("qwen3_moe", "BF16", 1), ("mixtral", "F32", 1)])
def test_batched_moe_rows_on_the_emulated_gpu_match_the_reference(arch, qtype, grouped_min, tmp_path, monkeypatch):
    from realizar import cuda

    hidden = 256 if qtype in ("Q4_K", "Q5_K", "Q6_K") else 64
    batched_moe_matches_the_reference(cuda.EmulatedDevice(sm_count=4), arch, qtype, tmp_path, monkeypatch,
                                      grouped_min=grouped_min, hidden=hidden, expert_ffn=hidden // 2 if hidden == 64 else hidden)


def batched_moe_matches_the_reference(dev, arch: str, qtype: str, tmp_path, monkeypatch, *, grouped_min: int,
                                      hidden: int = 64, expert_ffn: int = 32) -> None:
    """A model of 8 experts on ``dev``'s batched path: prompts prefilled in chunks of 8 rows and decode steps of
    three sequences, each row through the experts its own router picked, against the reference model run one
    sequence at a time: logits within f16 rounding, greedy tokens equal (also tests/gpu/test_moe_gpu.py). Batches
    of ``grouped_min`` rows or more take the grouped GEMM (1: every one; a large value: none), fewer the expert
    GEMV; the launches counted show that each path ran where it should."""
    import realizar.gpu.decoder as decoder
    from realizar.gpu.moe import MoeOps
    from realizar.gpu.batch import GpuBatchBackend
    from realizar.gpu.linear import rows_unsupported
    from realizar.gpu.model import GpuModel
    from realizar.sampling import RowSampling
    from tests.helpers import rel_err

    path = make_gguf_model(arch, tmp_path, qtype=qtype, seed=6, init_std=0.3, num_layers=1, hidden_size=hidden,
                           num_heads=hidden // 32, num_kv_heads=1, head_dim=32, num_experts=8, experts_used=2,
                           expert_ffn=expert_ffn)[0]
    loaded = load_model(path)
    assert rows_unsupported(dev, loaded.config) is None
    monkeypatch.setattr(decoder, "MOE_GROUPED_MIN_ROWS", grouped_min)
    runs = {"gemm_experts": [], "gemv_expert": []}
    for name, seen in runs.items():
        real = getattr(MoeOps, name)

        def counted(self, ew, x, out, ids_or_groups, *a, _real=real, _seen=seen, _grouped=name == "gemm_experts", **kw):
            _seen.append(ids_or_groups.pairs if _grouped else a[0])
            return _real(self, ew, x, out, ids_or_groups, *a, **kw)

        monkeypatch.setattr(MoeOps, name, counted)
    model = GpuModel.from_loaded(loaded, max_len=48, device=dev, kv_cache=False)
    be = GpuBatchBackend(model, num_blocks=16, block_size=16, kv_dtype="f32", max_batch=4, max_context=48,
                         prefill_chunk=8)
    prompts = [_ids(11 + i, n) for i, n in enumerate((17, 5, 24))]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    refs, tokens = [], []
    for prompt, table in zip(prompts, tables):
        ref = ReferenceModel.from_loaded(loaded, max_len=48)
        want = ref.prefill(prompt)
        got = be.prefill(prompt, 0, table).logits(0)
        assert rel_err(got, want) < 1e-2, len(prompt)
        assert int(np.argmax(got)) == int(np.argmax(want))
        refs.append(ref)
        tokens.append(int(np.argmax(want)))
    positions = [len(p) for p in prompts]
    for step in range(3):
        out = be.decode(tokens, positions, tables)
        sampled = out.sample([RowSampling()] * 3)
        for r, ref in enumerate(refs):
            want = ref.decode(tokens[r])
            assert rel_err(out.logits(r), want) < 1e-2, (step, r)
            assert int(sampled[r]) == int(np.argmax(want)), (step, r)
            tokens[r] = int(sampled[r])
            positions[r] += 1
    used = loaded.config.num_experts_used
    grouped = sorted({p // used for p in runs["gemm_experts"]})
    per_pair = sorted({p // used for p in runs["gemv_expert"]} - {1})  # (batch-1 decode graphs aside)
    assert all(r >= grouped_min for r in grouped) and all(r < grouped_min for r in per_pair), (grouped, per_pair)
    # (prefill chunks of 8 rows, decode steps of 3 rows in the backend's bucket of 4)
    assert bool(grouped) == (grouped_min <= 8) and bool(per_pair) == (grouped_min > 4), (grouped, per_pair)


def test_tensor_parallelism_refuses_experts(moe_files):
    from realizar.parallel.sharding import check_world_size

    with pytest.raises(ShapeError, match="mixture-of-experts"):
        check_world_size(load_model(moe_files["mixtral"][0]).config, 2)


@pytest.mark.parametrize("edit,error,match", [
    ({"drop_metadata": ("qwen3moe.expert_used_count",)}, ModelFormatError, "expert_used_count"),
    ({"set_metadata": {"qwen3moe.expert_used_count": 9}}, ModelFormatError, "exceeds"),
    ({"set_metadata": {"qwen3moe.expert_gating_func": 2}}, UnsupportedError, "sigmoid"),
    ({"set_metadata": {"qwen3moe.expert_shared_count": 1}}, UnsupportedError, "shared experts"),
    ({"drop_tensors": ("blk.1.ffn_down_exps.weight",)}, ModelFormatError, "ffn_down_exps"),
    ({"drop_metadata": ("qwen3moe.expert_count",), "drop_tensors": tuple(
        f"blk.{i}.ffn_{n}.weight" for i in range(2) for n in ("gate_inp", "gate_exps", "up_exps", "down_exps"))},
     ModelFormatError, "expert_count"),
])
def test_bad_expert_metadata_is_refused(moe_files, tmp_path, edit, error, match):
    bad = rewrite_gguf(moe_files["qwen3_moe"][0], tmp_path / "bad.gguf", **edit)
    with pytest.raises(error, match=match):
        load_model(bad)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_safetensors_directory_loads_like_the_gguf(arch, moe_files):
    path, hf_dir = moe_files[arch]
    g, h = load_model(path), load_model(hf_dir)
    for f in ("num_experts", "num_experts_used", "expert_ffn_size", "expert_weights_norm", "qk_norm", "num_layers"):
        assert getattr(g.config, f) == getattr(h.config, f), f
    assert h.config.architecture == {"qwen3_moe": "qwen3moe", "mixtral": "mixtral"}[arch]
    assert h.tensors["blk.1.ffn_down_exps.weight"].shape == g.tensors["blk.1.ffn_down_exps.weight"].shape
    ids = _ids(5, 12)
    a = ReferenceModel.from_loaded(g).prefill(ids, all_logits=True)
    b = ReferenceModel.from_loaded(h).prefill(ids, all_logits=True)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(a).max())


def test_qwen3_moe_dense_layers_are_refused(tmp_path):
    from tests.model_factory import make_hf_model

    hf_dir = make_hf_model("qwen3_moe", tmp_path)[0]
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "mlp_only_layers": [1]}))
    with pytest.raises(UnsupportedError, match="mlp_only_layers"):
        load_model(hf_dir)


@pytest.mark.oracle
@pytest.mark.parametrize("arch,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_logits_match_transformers(arch, norm, seed, fmt, tmp_path):
    path, hf_dir = make_gguf_model(arch, tmp_path, qtype="F32", seed=seed, init_std=0.3, norm_topk_prob=norm)[:2]
    ids = _ids(seed + 10, 40)
    theirs = hf_logits(load_hf_model(hf_dir), ids)
    loaded = load_model(path if fmt == "gguf" else hf_dir)
    assert loaded.config.expert_weights_norm == norm
    ours = ReferenceModel.from_loaded(loaded).prefill(ids, all_logits=True)
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= 1e-4 * scale, np.abs(ours - theirs).max() / scale
    # the comparison sees the router: with the other renormalisation of the chosen experts' weights it fails
    c = loaded.config
    flipped = ReferenceModel(c.__class__(**{**c.__dict__, "expert_weights_norm": not norm}), loaded.tensors)
    assert np.abs(flipped.prefill(ids, all_logits=True) - theirs).max() > 1e-2 * scale


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_stacked_experts_in_every_type(qtype, tmp_path):
    """3-D expert tensors of each type dequantize as gguf's own reader does, expert by expert, and the model
    runs (rows of 256 values, as K-quants need)."""
    import gguf

    path = make_gguf_model("qwen3_moe", tmp_path, qtype=qtype, seed=2, hidden_size=256, num_heads=4, num_kv_heads=2,
                           expert_ffn=256, intermediate_size=256, num_layers=1)[0]
    loaded = load_model(path)
    reader = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for kind in ("gate", "up", "down"):
        name = f"blk.0.ffn_{kind}_exps.weight"
        t = loaded.tensors[name]
        assert t.shape == (4, 256, 256)
        want = gguf.quants.dequantize(np.asarray(reader[name].data), reader[name].tensor_type).reshape(t.shape)
        np.testing.assert_array_equal(t.dequantize(), want.astype(np.float32))
    logits = ReferenceModel.from_loaded(loaded).prefill(_ids(1, 8), all_logits=True)
    assert np.isfinite(logits).all()


def test_chat_tools_and_structured_output_unchanged(tmp_path):
    """The HTTP server on a Qwen3-MoE model: chat (streamed and not), a JSON-schema answer that validates, and
    a named tool call, through the official client (issue 37, item 5; the server does not know it is MoE)."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    jsonschema = pytest.importorskip("jsonschema")
    from realizar.engine import load_engine
    from tests.test_server import LiveServer
    from tests.test_server_structured import RECORD, TOOLS_TEMPLATE, WEATHER

    path = make_gguf_model("qwen3_moe", tmp_path, qtype="Q8_0", seed=3, init_std=0.3, max_position_embeddings=1024)[0]
    engine = load_engine(str(path), device="cpu")
    engine.tokenizer.chat_template = TOOLS_TEMPLATE
    srv = LiveServer(engine).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Tell me about a film."}]
        r = client.chat.completions.create(model=engine.name, messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=engine.name, messages=msgs, max_tokens=8, temperature=0, stream=True) if c.choices)
        assert text == r.choices[0].message.content
        fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": RECORD, "strict": True}}
        r = client.chat.completions.create(model=engine.name, messages=msgs, response_format=fmt, seed=1,
                                           max_tokens=200)
        jsonschema.validate(json.loads(r.choices[0].message.content), RECORD)
        r = client.chat.completions.create(model=engine.name, messages=msgs, tools=[WEATHER], seed=2, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    finally:
        srv.stop()
