"""The OpenAI-compatible server, driven by the official ``openai`` client over loopback.

A tiny random llama GGUF (tests/gguf_factory.py) runs on the CPU; a live uvicorn server listens on a
free port of 127.0.0.1 in a background thread. Its serving engine's batch backend is wrapped so that a
test can slow the steps down (to disconnect mid-stream) and count what reached the model; expected
texts come from a second, independent engine.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from realizar.engine import load_engine  # noqa: E402
from realizar.generation import SamplingParams  # noqa: E402
from realizar.server import DRAIN_SECONDS, bind_socket, create_app, graceful_server, serve, uvicorn_config  # noqa: E402

PROMPT = "The capital of France is"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a city in France."},
]


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------


def _tiny_gguf(tmp_path_factory) -> Path:
    from tests.gguf_factory import shared_tiny_gguf

    return shared_tiny_gguf(tmp_path_factory)


class ThrottledBackend:
    """Wraps a batch backend (realizar.serving): sleeps ``delay`` seconds before each forward call and
    counts them, so tests can slow generation down and see what reached the model."""

    def __init__(self, inner):
        self.inner = inner
        self.delay = 0.0
        self.prefills = 0  # prefill calls (chunks)
        self.decodes = 0  # decode calls (steps)
        self.decode_rows = 0

    def __getattr__(self, name):  # config, block_size, num_blocks, max_batch, context_length
        return getattr(self.inner, name)

    def prefill(self, tokens, start, block_table):
        if self.delay:
            time.sleep(self.delay)
        self.prefills += 1
        return self.inner.prefill(tokens, start, block_table)

    def decode(self, tokens, positions, block_tables):
        if self.delay:
            time.sleep(self.delay)
        self.decodes += 1
        self.decode_rows += len(tokens)
        return self.inner.decode(tokens, positions, block_tables)


def throttled_serving(engine, max_batch: int = 64):
    """A ServingEngine for ``engine`` (CPU) whose backend is a :class:`ThrottledBackend`."""
    from realizar.serving import ServingEngine
    from realizar.serving.cpu_backend import ReferenceBatchBackend

    blocks = min(max_batch, 8) * (-(-engine.context_length // 32)) + 1
    backend = ThrottledBackend(ReferenceBatchBackend(engine.model, blocks, 32, kv_dtype="f32", max_batch=max_batch))
    return ServingEngine(backend, engine.tokenizer, engine.generator.eos_token_ids)


class LiveServer:
    def __init__(self, engine, limits=None, drain_seconds=DRAIN_SECONDS, **app_kwargs):
        self.engine = engine
        self.app = create_app(engine, **app_kwargs)
        self.serving = self.app.state.server.scheduler.serving
        self.backend = getattr(self.serving, "backend", None)  # (none for an engine in another process)
        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = graceful_server(uvicorn_config(self.app, limits, log_level="warning", timeout_graceful_shutdown=5),
                                      self.app, drain_seconds)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def serve_tiny(tmp_path_factory, **app_kwargs):
    """Body of a module fixture (``yield from serve_tiny(...)``): a LiveServer with ``app_kwargs`` over an
    engine of its own on the tiny model on the CPU, stopped at teardown."""
    srv = LiveServer(load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu"), **app_kwargs).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return _tiny_gguf(tmp_path_factory)


@pytest.fixture(scope="module")
def oracle(gguf_path):
    """An engine of its own to compute the expected texts (never shared with the server)."""
    return load_engine(str(gguf_path), device="cpu")


@pytest.fixture(scope="module")
def live(gguf_path):
    engine = load_engine(str(gguf_path), device="cpu")
    srv = LiveServer(engine, serving=throttled_serving(engine)).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(live):
    live.backend.delay = 0.0
    yield live.client()
    live.backend.delay = 0.0


def _metrics(live) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(live.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def _sample(families: dict, family: str, sample: str | None = None, **labels) -> float:
    total = 0.0
    for s in families[family].samples:
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


def _wait_idle(live, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(live)
        if _sample(m, "realizar_requests_running") == 0 and _sample(m, "realizar_queue_depth") == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError("the server did not become idle")
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------
# the OpenAI client
# ----------------------------------------------------------------------------------------------


def test_models_list(client, live):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [live.engine.name]
    assert models.data[0].owned_by == "realizar"
    assert client.models.retrieve(live.engine.name).id == live.engine.name


def test_completion_greedy_matches_the_engine(client, live, oracle):
    expected = oracle.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    r = client.completions.create(model=live.engine.name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == expected.prompt_tokens
    assert r.usage.completion_tokens == expected.completion_tokens
    assert r.usage.total_tokens == expected.prompt_tokens + expected.completion_tokens


def test_completion_stream_assembles_to_the_greedy_text(client, live):
    kw = dict(model=live.engine.name, prompt=PROMPT, max_tokens=20, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completion_prompt_as_token_ids_and_echo(client, live, oracle):
    ids = oracle.tokenizer.encode(PROMPT)
    expected = oracle.generate(ids, SamplingParams(max_tokens=6, temperature=0.0))
    r = client.completions.create(model=live.engine.name, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert r.choices[0].text == oracle.tokenizer.decode(ids) + expected.text


def test_completion_stop_string(client, live, oracle):
    full = oracle.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0)).text
    stop = next((full[i : i + 2] for i in range(4, len(full) - 2) if full[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip("no usable stop string in the greedy text")
    r = client.completions.create(model=live.engine.name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client, live):
    kw = dict(model=live.engine.name, prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_chat_matches_the_engine(client, live, oracle):
    expected = oracle.chat(MESSAGES, SamplingParams(max_tokens=10, temperature=0.0))
    r = client.chat.completions.create(model=live.engine.name, messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.usage.prompt_tokens == expected.prompt_tokens


def test_chat_stream_assembles_to_the_greedy_text(client, live):
    kw = dict(model=live.engine.name, messages=MESSAGES, max_completion_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_chat_text_parts_are_joined(client, live):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a city "}, {"type": "text", "text": "in France."}]}]
    plain = [{"role": "user", "content": "Name a city in France."}]
    a = client.chat.completions.create(model=live.engine.name, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=live.engine.name, messages=plain, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_sse_wire_format(live):
    body = {"model": live.engine.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[len("data: "):])


def test_sixteen_concurrent_clients(live, oracle):
    expected = oracle.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0)).text
    live.backend.delay = 0.001

    def one(i: int) -> str:
        c = live.client()
        if i % 2:
            s = c.completions.create(model=live.engine.name, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
            return "".join(ch.choices[0].text for ch in s if ch.choices)
        return c.completions.create(model=live.engine.name, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text

    try:
        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(one, range(16)))
    finally:
        live.backend.delay = 0.0
    assert texts == [expected] * 16
    m = _wait_idle(live)
    assert _sample(m, "realizar_queue_depth") == 0


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def _long_prompt(oracle) -> str:
    text = "the quick brown fox jumps over the lazy dog "
    while len(oracle.tokenizer.encode(text)) <= oracle.context_length:
        text += text
    return text


def _bad_requests(name: str, oracle) -> list[tuple[str, str, object, int, str | None]]:
    """(id, path, body, status, param) — body is a dict or raw bytes."""
    vocab = oracle.tokenizer.vocab_size
    ctx = oracle.context_length
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok_msgs = [{"role": "user", "content": "hi"}]
    return [
        ("bad-json", c, b'{"model": "x", "prompt": ', 400, None),
        ("not-an-object", c, b"[1, 2, 3]", 400, None),
        ("missing-model", c, {"prompt": "hi"}, 400, "model"),
        ("missing-prompt", c, {"model": name}, 400, "prompt"),
        ("unknown-model", c, {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("unknown-model-chat", ch, {"model": "gpt-4", "messages": ok_msgs}, 404, "model"),
        ("negative-max-tokens", c, {"model": name, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ("oversized-max-tokens", c, {"model": name, "prompt": "hi", "max_tokens": ctx * 10}, 400, "max_tokens"),
        ("oversized-chat", ch, {"model": name, "messages": ok_msgs, "max_tokens": ctx * 10}, 400, "max_tokens"),
        ("prompt-past-context", c, {"model": name, "prompt": _long_prompt(oracle), "max_tokens": 1}, 400, "prompt"),
        ("string-max-tokens", c, {"model": name, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("temperature-negative", c, {"model": name, "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
        ("top-p-zero", c, {"model": name, "prompt": "hi", "top_p": 0}, 400, "top_p"),
        ("n-too-many", c, {"model": name, "prompt": "hi", "n": 17}, 400, "n"),
        ("best-of-below-n", c, {"model": name, "prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
        ("best-of-streamed", c, {"model": name, "prompt": "hi", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
        ("too-many-prompts", c, {"model": name, "prompt": ["hi"] * 33}, 400, "prompt"),
        ("too-many-generations", c, {"model": name, "prompt": ["hi"] * 8, "n": 9}, 400, "n"),
        ("seed-too-big", c, {"model": name, "prompt": "hi", "seed": 2**64}, 400, "seed"),
        ("echo-logprobs", c, {"model": name, "prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
        ("penalty-out-of-range", c, {"model": name, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("five-stops", c, {"model": name, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("empty-prompt", c, {"model": name, "prompt": ""}, 400, "prompt"),
        ("token-out-of-vocab", c, {"model": name, "prompt": [1, vocab + 5]}, 400, "prompt"),
        ("logprobs-too-many", c, {"model": name, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("top-logprobs-alone", ch, {"model": name, "messages": ok_msgs, "top_logprobs": 2}, 400, "top_logprobs"),
        ("no-messages", ch, {"model": name, "messages": []}, 400, "messages"),
        ("bad-role", ch, {"model": name, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        ("image-part", ch, {"model": name, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
        ("tools", ch, {"model": name, "messages": ok_msgs, "tools": [{"type": "function"}]}, 400, "tools"),
        ("chat-max-tokens-zero", ch, {"model": name, "messages": ok_msgs, "max_tokens": 0}, 400, "max_tokens"),
    ]


def test_malformed_requests_get_openai_style_4xx(live, oracle):
    for rid, path, body, status, param in _bad_requests(live.engine.name, oracle):
        if isinstance(body, bytes):
            r = httpx.post(live.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        else:
            r = httpx.post(live.url + path, json=body, timeout=30)
        assert r.status_code == status, (rid, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, rid
        assert isinstance(err["message"], str) and err["message"], rid
        assert err["type"] == "invalid_request_error", rid
        if param is not None:
            assert err["param"] == param, (rid, err)
    # still healthy
    assert httpx.get(live.url + "/health", timeout=10).json()["status"] == "ok"


def test_context_errors_say_so(live, oracle):
    r = httpx.post(live.url + "/v1/completions", json={
        "model": live.engine.name, "prompt": _long_prompt(oracle), "max_tokens": 1}, timeout=30)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(live.url + "/v1/completions", json={
        "model": live.engine.name, "prompt": "hi", "max_tokens": oracle.context_length}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_openai_client_raises_typed_errors(client, live):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=live.engine.name, prompt="hi", max_tokens=-5)


def test_unknown_path_and_method(live):
    r = httpx.get(live.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(live.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


# ----------------------------------------------------------------------------------------------
# disconnects, health, metrics
# ----------------------------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_slot(live, oracle):
    backend = live.backend
    before = _wait_idle(live)
    cancelled0 = _sample(before, "realizar_requests_cancelled")
    backend.delay = 0.05
    try:
        max_tokens = oracle.context_length - 20
        body = {"model": live.engine.name, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        decodes0 = backend.decodes
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", live.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                got = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got += 1
                    if got >= 3:
                        break
        # the connection is closed: the generation must stop soon, long before max_tokens
        m = _wait_idle(live, timeout=10)
        assert _sample(m, "realizar_requests_cancelled") == cancelled0 + 1
        assert backend.decodes - decodes0 < max_tokens // 2
        assert _sample(m, "realizar_kv_blocks_used") == 0  # its KV blocks are back in the pool
    finally:
        backend.delay = 0.0
    # healthy, and the next request is served at once
    assert httpx.get(live.url + "/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(live.url + "/v1/completions", json={
        "model": live.engine.name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_disconnect_while_waiting_leaves_the_queue(gguf_path):
    """With one sequence per batch, a second request waits; its client gives up, and it is dropped
    without ever reaching the model."""
    engine = load_engine(str(gguf_path), device="cpu")
    srv = LiveServer(engine, serving=throttled_serving(engine, max_batch=1)).start()
    backend = srv.backend
    backend.delay = 0.02
    body = {"model": engine.name, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "stream": True}
    result: dict = {}

    def long_request() -> None:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            result["text"] = r.read().decode()

    try:
        first = threading.Thread(target=long_request)
        first.start()
        deadline = time.monotonic() + 10
        while _sample(_metrics(srv), "realizar_requests_running") == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert backend.prefills == 1
        # a second request waits behind the first; its client gives up after 0.3 s
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json={**body, "stream": False},
                       timeout=httpx.Timeout(10, read=0.3))
        first.join(timeout=60)
        backend.delay = 0.0
        m = _wait_idle(srv)
        assert result["text"].rstrip().endswith("data: [DONE]")
        assert _sample(m, "realizar_requests_cancelled") == 1
        assert backend.prefills == 1  # the abandoned request never reached the model
    finally:
        srv.stop()


def test_event_loop_stays_responsive_while_generating(live):
    backend = live.backend
    backend.delay = 0.05
    body = {"model": live.engine.name, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    try:
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: httpx.post(live.url + "/v1/completions", json=body, timeout=60))
            deadline = time.monotonic() + 10
            while _sample(_metrics(live), "realizar_requests_running") == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            for _ in range(5):
                t0 = time.perf_counter()
                h = httpx.get(live.url + "/health", timeout=5).json()
                assert time.perf_counter() - t0 < 0.5
                assert h["busy"] is True
            assert fut.result().status_code == 200
    finally:
        backend.delay = 0.0


def test_health(live):
    h = httpx.get(live.url + "/health", timeout=10).json()
    assert h["status"] == "ok"
    assert h["model"] == live.engine.name and h["device"] == "cpu"
    assert h["context_length"] == live.engine.context_length


def test_metrics_parse_with_prometheus_client(client, live):
    client.completions.create(model=live.engine.name, prompt=PROMPT, max_tokens=3, temperature=0)
    m = _wait_idle(live)
    assert m["realizar_requests"].type == "counter"
    assert _sample(m, "realizar_requests", "realizar_requests_total", endpoint="/v1/completions", status="200") >= 1
    assert m["realizar_generation_tokens"].type == "counter"
    assert _sample(m, "realizar_generation_tokens") >= 3
    assert _sample(m, "realizar_prompt_tokens") > 0
    for hist in ("realizar_request_duration_seconds", "realizar_time_to_first_token_seconds",
                 "realizar_time_per_output_token_seconds", "realizar_batch_size", "realizar_prefill_chunk_tokens"):
        assert m[hist].type == "histogram"
        assert _sample(m, hist, hist + "_count") >= 1
        inf = [s for s in m[hist].samples if s.name == hist + "_bucket" and s.labels.get("le") == "+Inf"]
        assert inf and all(s.value >= 1 for s in inf)
    assert m["realizar_queue_depth"].type == "gauge"
    assert _sample(m, "realizar_model_info", model=live.engine.name, device="cpu") == 1


def test_each_app_has_its_own_metrics():
    from realizar.server.metrics import ServerMetrics

    a, b = ServerMetrics("a", "cpu"), ServerMetrics("b", "cpu")
    a.generation_tokens.inc(5)
    assert b"realizar_generation_tokens_total 5.0" in a.render()
    assert b"realizar_generation_tokens_total 0.0" in b.render()


def test_binds_loopback_by_default():
    import inspect

    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    s = bind_socket(port=0)
    try:
        assert s.getsockname()[0] == "127.0.0.1"
    finally:
        s.close()


def test_queue_full_answers_429(gguf_path):
    """One sequence runs, one may wait (max_queue=1): of four concurrent requests some get a 429."""
    engine = load_engine(str(gguf_path), device="cpu")
    srv = LiveServer(engine, serving=throttled_serving(engine, max_batch=1), max_queue=1).start()
    srv.backend.delay = 0.02
    try:
        body = {"model": engine.name, "prompt": PROMPT, "max_tokens": 30, "temperature": 0}
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(lambda _: httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code,
                                  range(4)))
        assert 200 in codes and 429 in codes
        assert set(codes) <= {200, 429}
    finally:
        srv.stop()


# ----------------------------------------------------------------------------------------------
# the real default model
# ----------------------------------------------------------------------------------------------


def _smollm2() -> Path:
    from realizar.default_model import default_model_path

    return Path(default_model_path())


@pytest.mark.full
def test_smollm2_over_http():
    engine = load_engine(str(_smollm2()), device="cpu")
    srv = LiveServer(engine).start()
    try:
        c = srv.client()
        r = c.completions.create(model=engine.name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert r.choices[0].text.startswith(" Paris")
        s = c.chat.completions.create(model=engine.name, messages=[{"role": "user", "content": "Hi"}],
                                      max_tokens=3, temperature=0, stream=True)
        text = "".join(ch.choices[0].delta.content or "" for ch in s)
        assert text.strip()
    finally:
        srv.stop()
