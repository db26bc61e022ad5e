"""The OpenAI-compatible server on the GPU model: the official client over loopback, greedy text equal
to the CPU engine's, streaming equal to non-streaming, concurrent clients served one at a time."""

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
    live = LiveServer(engine).start()
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
