"""The OpenAI-compatible server on the GPU model: the official client over loopback, greedy text equal
to the CPU engine's, streaming equal to non-streaming, concurrent clients batched; the KV cache in f32 so
that logprobs match the CPU engine's within float32 noise."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="the device image lacks openai unless its wheel is carried")
pytest.importorskip("fastapi", reason="the device image lacks fastapi unless its wheel is carried")
pytest.importorskip("uvicorn", reason="the device image lacks uvicorn unless its wheel is carried")

from realizar.engine import load_engine  # noqa: E402
from realizar.generation import SamplingParams  # noqa: E402
from tests.gguf_factory import make_gguf_model  # noqa: E402
from tests.test_server import LiveServer  # noqa: E402

pytestmark = pytest.mark.gpu
DIMS = dict(vocab_size=320, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, num_layers=2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp("gpu-srv"), "Q8_0", seed=9, **DIMS)
    engine = load_engine(path, device="cuda")
    assert engine.device == "cuda"
    live = LiveServer(engine, kv_dtype="f32").start()  # (the f16 default is compared in test_batch_gpu.py)
    yield live, load_engine(path, device="cpu")
    live.stop()


def test_completions_on_the_gpu_match_the_cpu_engine(served):
    live, cpu = served
    client = live.client()
    expected = cpu.generate("hello there", SamplingParams(max_tokens=24, temperature=0.0)).text
    got = client.completions.create(model=live.engine.name, prompt="hello there", max_tokens=24, temperature=0)
    assert got.choices[0].text == expected
    pieces = client.completions.create(model=live.engine.name, prompt="hello there", max_tokens=24, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in pieces) == expected


def test_chat_and_concurrency_on_the_gpu(served):
    live, cpu = served
    messages = [{"role": "user", "content": "Say something."}]
    expected = cpu.chat(messages, SamplingParams(max_tokens=16, temperature=0.0)).text

    def one(_: int) -> str:
        r = live.client().chat.completions.create(model=live.engine.name, messages=messages, max_tokens=16,
                                                  temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    assert answers == [expected] * 8


def test_logprobs_n_and_json_schema_on_the_gpu(served):
    """The API features through the GPU model: logprobs of the GPU logits equal the CPU engine's within
    float32 noise (same greedy tokens), n seeded choices, and a JSON-schema answer that parses."""
    import json

    live, cpu = served
    client = live.client()
    got = client.completions.create(model=live.engine.name, prompt="hello there", max_tokens=12, temperature=0,
                                    logprobs=3)
    chunks = list(cpu.generator.stream("hello there", SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)))
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == len(chunks)
    assert max(abs(a - c.logprob) for a, c in zip(lp.token_logprobs, chunks)) < 1e-3
    assert got.choices[0].text == "".join(c.text for c in chunks)
    three = client.completions.create(model=live.engine.name, prompt="hello", max_tokens=8, temperature=1.0, n=3,
                                      seed=5)
    assert [c.index for c in three.choices] == [0, 1, 2] and len({c.text for c in three.choices}) > 1
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(model=live.engine.name, messages=[{"role": "user", "content": "a person"}],
                                       max_tokens=64, temperature=0.7, seed=1,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": schema}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int) and len(data["name"]) <= 6
