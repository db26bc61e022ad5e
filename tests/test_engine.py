"""The engine facade: loading by path, device choice, chat."""

from __future__ import annotations

import pytest

from realizar import cuda
from realizar.engine import GpuUnavailableError, load_engine
from realizar.errors import InvalidRequestError
from realizar.generation import SamplingParams
from realizar.models.reference import ReferenceModel
from tests.gguf_factory import hf_to_gguf
from tests.model_factory import make_hf_model
from tests.helpers import tiered


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    hf_dir, _ = make_hf_model("qwen2", tmp, seed=2, num_heads=2, num_kv_heads=1)  # head_dim 32: the paged cache takes it
    return hf_dir, hf_to_gguf(hf_dir, tmp / "tiny.gguf", "Q8_0"), hf_to_gguf(hf_dir, tmp / "tiny-f32.gguf", "F32")


@pytest.mark.parametrize("which", [0, 1], ids=["safetensors", "gguf"])
def test_load_engine_cpu(tiny_paths, which):
    engine = load_engine(tiny_paths[which], device="cpu")
    assert engine.device == "cpu" and isinstance(engine.model, ReferenceModel)
    assert engine.config.architecture == "qwen2" and engine.context_length == 256
    assert 2 in engine.generator.eos_token_ids  # <|im_end|>
    res = engine.generate("the and of", SamplingParams(max_tokens=5))
    assert res.prompt_tokens == len(engine.tokenizer.encode("the and of"))
    assert 1 <= res.completion_tokens <= 5


def test_same_model_same_tokens_from_both_formats(tiny_paths):
    p = SamplingParams(max_tokens=12, temperature=0.7, seed=5)
    a = load_engine(tiny_paths[0], device="cpu").generate("the and of", p)
    b = load_engine(tiny_paths[2], device="cpu").generate("the and of", p)
    assert (a.prompt_tokens, a.token_ids, a.text) == (b.prompt_tokens, b.token_ids, b.text)


def _no_gpu(monkeypatch):
    monkeypatch.setattr(cuda, "unavailable_reason", lambda: "no NVIDIA driver (stubbed)")


def test_auto_falls_back_to_cpu_without_a_gpu(tiny_paths, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    monkeypatch.delenv("REALIZAR_VERBOSE", raising=False)
    engine = load_engine(tiny_paths[1], device="auto")
    assert engine.device == "cpu" and isinstance(engine.model, ReferenceModel)
    assert capsys.readouterr().err == ""  # (no GPU here: the CPU is the plain choice, said nothing of)


def test_cuda_without_a_gpu_says_why(tiny_paths, monkeypatch):
    _no_gpu(monkeypatch)
    with pytest.raises(GpuUnavailableError, match=r"no usable GPU: no NVIDIA driver \(stubbed\)"):
        load_engine(tiny_paths[1], device="cuda")


def test_a_model_the_gpu_cannot_run(tiny_paths, monkeypatch, capsys):
    """A GPU is present but the GPU model refuses the model: cuda says why, auto runs on the CPU and says why."""
    import realizar.gpu.model
    from realizar.errors import UnsupportedError

    def refuse(loaded, max_len=None, **kw):
        raise UnsupportedError("tensor type XYZ (stubbed)")

    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(realizar.gpu.model.GpuModel, "from_loaded", staticmethod(refuse))
    with pytest.raises(GpuUnavailableError, match=r"cannot run on the GPU: tensor type XYZ \(stubbed\)"):
        load_engine(tiny_paths[1], device="cuda")
    capsys.readouterr()
    assert load_engine(tiny_paths[1], device="auto").device == "cpu"
    said = capsys.readouterr().err
    assert said == "realizar: running on the CPU (this model cannot run on the GPU: tensor type XYZ (stubbed))\n"


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_the_gpu_model_is_taken_when_it_loads(tiny_paths, monkeypatch, device):
    """With a GPU model available, auto and cuda both run on it, with the cap on the context passed
    through; the stand-in is the CPU model, so the tokens must match a CPU engine's."""
    import realizar.gpu.model

    made = []

    def stand_in(loaded, max_len=None, **kw):
        made.append(max_len)
        return ReferenceModel.from_loaded(loaded, max_len=max_len or loaded.config.context_length)

    monkeypatch.setattr(cuda, "unavailable_reason", lambda: None)
    monkeypatch.setattr(realizar.gpu.model.GpuModel, "from_loaded", staticmethod(stand_in))
    engine = load_engine(tiny_paths[1], device=device, max_context=32)
    assert engine.device == "cuda" and made == [32] and engine.context_length == 32
    p = SamplingParams(max_tokens=4)
    assert engine.generate("the and of", p).token_ids == load_engine(tiny_paths[1], device="cpu").generate(
        "the and of", p).token_ids


def test_bad_arguments(tiny_paths):
    with pytest.raises(InvalidRequestError):
        load_engine(tiny_paths[1], device="tpu")
    with pytest.raises(InvalidRequestError):
        load_engine(tiny_paths[1], device="cpu", max_context=0)
    with pytest.raises(FileNotFoundError):
        load_engine(tiny_paths[1].parent / "missing.gguf", device="cpu")


def test_max_context_caps_the_cache(tiny_paths):
    engine = load_engine(tiny_paths[1], device="cpu", max_context=16)
    assert engine.context_length == 16
    from realizar.errors import ContextOverflowError

    with pytest.raises(ContextOverflowError):
        engine.generate([5] * 10, SamplingParams(max_tokens=7))


def test_chat_renders_the_template(tiny_paths):
    engine = load_engine(tiny_paths[1], device="cpu")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the and of"}]
    ids = engine.chat_prompt(messages)
    text = engine.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    res = engine.chat(messages, SamplingParams(max_tokens=4))
    assert res.prompt_tokens == len(ids)
    streamed = "".join(c.text for c in engine.chat_stream(messages, SamplingParams(max_tokens=4)))
    assert streamed == res.text
    with pytest.raises(InvalidRequestError):
        engine.chat([])


def test_emulate_runs_the_gpu_model_on_the_emulator(tiny_paths, monkeypatch):
    """device="emulate" takes the GPU model on an EmulatedDevice, GPU or not, and its greedy text
    equals the CPU reference model's."""
    from realizar.gpu.model import GpuModel

    _no_gpu(monkeypatch)
    p = SamplingParams(max_tokens=6)
    emu = load_engine(tiny_paths[1], device="emulate", max_context=32)
    assert emu.device == "emulate" and isinstance(emu.model, GpuModel)
    assert isinstance(emu.model.device, cuda.EmulatedDevice)
    ref = load_engine(tiny_paths[1], device="cpu", max_context=32)
    a, b = emu.generate("the and of", p), ref.generate("the and of", p)
    assert a.token_ids == b.token_ids and a.text == b.text


SERVE_CASES = [("llama", "Q8_0", False), ("qwen2", "Q4_0", False), ("qwen3", "Q4_1", False), ("mistral", "F16", False),
               ("llama", "Q8_0", True)]


@pytest.mark.parametrize("arch,qtype,split", tiered(SERVE_CASES, {0, 4}, ids=lambda c: "-".join(map(str, c)), unpack=True))
def test_serving_runs_every_model_generate_runs_on_the_emulator(tmp_path, monkeypatch, arch, qtype, split):
    """What the GPU model generates, the serving engine over the same weights (the one GPU path, many
    rows) serves too: every architecture, and gate and up weights of different types (``split``); two
    requests at once give the greedy tokens of the engine alone."""
    import numpy as np

    from realizar.models.loader import load_model
    from realizar.serving import ServingEngine
    from tests.gguf_factory import make_gguf_model, rewrite_gguf

    _no_gpu(monkeypatch)
    path, _, _ = make_gguf_model(arch, tmp_path, qtype, seed=4, num_layers=1, vocab_size=320, hidden_size=64,
                                 intermediate_size=128, num_heads=2, num_kv_heads=1)
    if split:
        up = load_model(path).tensors["blk.0.ffn_up.weight"].dequantize().astype(np.float32)
        path = rewrite_gguf(path, tmp_path / "split.gguf", replace_tensors={"blk.0.ffn_up.weight": (up, None)})
    emu = load_engine(path, device="emulate", max_context=32)
    p = SamplingParams(max_tokens=3)
    prompts = [[5, 17, 42, 7], [9, 3, 11]]
    want = [emu.generate(ids, p).token_ids for ids in prompts]
    with ServingEngine.from_engine(emu, max_batch=4, block_size=16, num_blocks=8) as serving:
        assert serving.backend.max_batch == 4
        got = [r.token_ids for r in serving.generate_batch(prompts, p)]
    assert got == want
