"""The engine facade: loading by path, device choice, chat."""

from __future__ import annotations

import pytest

from realizar import cuda
from realizar.engine import GpuUnavailableError, load_engine
from realizar.errors import InvalidRequestError
from realizar.generation import SamplingParams
from realizar.models.reference import ReferenceModel
from tests.model_factory import hf_to_gguf, make_hf_model


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    hf_dir, _ = make_hf_model("qwen2", tmp, seed=2)
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


def test_auto_falls_back_to_cpu_without_gpu_model(tiny_paths):
    engine = load_engine(tiny_paths[1], device="auto")
    assert engine.device == "cpu"


def test_cuda_raises_a_clear_error(tiny_paths):
    with pytest.raises(GpuUnavailableError) as e:
        load_engine(tiny_paths[1], device="cuda")
    msg = str(e.value)
    if cuda.is_available():
        assert "not available yet" in msg
    else:
        assert "GPU" in msg


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
