"""Concurrent serving on the CPU: 32 clients through the official ``openai`` client at once against a
live server on a tiny random model. Every stream equals the same request run alone, and the requests
share decode steps: the server's own metrics count fewer steps than one request at a time takes and
steps of more than 4 sequences. (The wall times, together and one by one, are printed, not asserted:
on a shared 2-core CI machine they swing by 2x from run to run; speed is the benchmarks' job.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tests.test_server import _metrics, _sample, _wait_idle, serve_tiny  # noqa: E402

CLIENTS = 32
MAX_TOKENS = 12
WORDS = "the quick brown fox jumps over a lazy dog while seven red birds sing loudly near old stone walls".split()


def _prompt(i: int) -> str:
    """Prompts of different lengths and words, so that the sequences differ and finish apart."""
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 9))


def _request(i: int) -> dict:
    """Greedy and seeded-sampled requests, streamed and whole, completions and chat."""
    kw: dict = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
    if i % 4 == 1:
        kw = {"max_tokens": MAX_TOKENS, "temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
    return {"chat": i % 3 == 0, "stream": i % 2 == 0, "kw": kw, "text": _prompt(i)}


def _run(client, model: str, spec: dict) -> str:
    kw = dict(model=model, **spec["kw"])
    if spec["chat"]:
        msgs = [{"role": "user", "content": spec["text"]}]
        if spec["stream"]:
            s = client.chat.completions.create(messages=msgs, stream=True, **kw)
            return "".join(c.choices[0].delta.content or "" for c in s if c.choices)
        return client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    if spec["stream"]:
        s = client.completions.create(prompt=spec["text"], stream=True, **kw)
        return "".join(c.choices[0].text for c in s if c.choices)
    return client.completions.create(prompt=spec["text"], **kw).choices[0].text


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory, max_batch=CLIENTS)


def test_32_concurrent_openai_clients_equal_alone_and_share_steps(live):
    specs = [_request(i) for i in range(CLIENTS)]
    client = live.client()
    name = live.engine.name
    _run(client, name, specs[0])  # warm up (first-call costs are not the engine's)

    # alone: one request at a time
    alone: list[str] = []
    t0 = time.perf_counter()
    for spec in specs:
        alone.append(_run(client, name, spec))
    sum_alone = time.perf_counter() - t0

    # together: 32 clients of their own, released at once
    steps0 = _sample(_metrics(live), "realizar_batch_size", "realizar_batch_size_count")
    barrier = threading.Barrier(CLIENTS)
    clients = [live.client() for _ in range(CLIENTS)]

    def one(i: int) -> str:
        barrier.wait()
        return _run(clients[i], name, specs[i])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        together = list(pool.map(one, range(CLIENTS)))
    wall = time.perf_counter() - t0

    for i, (a, b) in enumerate(zip(alone, together)):
        assert b == a, (i, specs[i], a, b)
    assert all(alone), "a request produced no text"

    m = _wait_idle(live)
    # the requests shared decode steps: some step advanced many sequences at once
    hist = {s.labels["le"]: s.value for s in m["realizar_batch_size"].samples if s.name == "realizar_batch_size_bucket"}
    steps = _sample(m, "realizar_batch_size", "realizar_batch_size_count") - steps0
    print(f"32 clients: {wall:.2f} s together, {sum_alone:.2f} s one by one; decode steps {steps:.0f}; batch sizes {hist}")
    assert hist["4.0"] < _sample(m, "realizar_batch_size", "realizar_batch_size_count"), hist  # some batch > 4
    assert steps < CLIENTS * (MAX_TOKENS - 1) * 0.75, steps  # one at a time takes 32 x 11 decode steps
    assert _sample(m, "realizar_kv_blocks_used") == 0


def test_metrics_report_the_prefix_cache(live):
    """A second request sharing a long prompt prefix takes its full blocks from the cache: the hit
    counters and prefilled-vs-cached prompt tokens of /metrics move by the expected amounts."""
    name = live.engine.name
    block = live.serving.scheduler.block_size
    text = " ".join(WORDS * 3)
    ids = live.engine.tokenizer.encode(text)
    assert 2 * block < len(ids) < live.engine.context_length - 2
    before = _wait_idle(live)

    def counter(m: dict, family: str) -> float:
        return _sample(m, family, family + "_total")

    body = {"model": name, "prompt": ids, "max_tokens": 2, "temperature": 0}
    assert httpx.post(live.url + "/v1/completions", json=body, timeout=30).status_code == 200
    mid = _wait_idle(live)
    assert httpx.post(live.url + "/v1/completions", json=body, timeout=30).status_code == 200
    after = _wait_idle(live)
    cached = counter(after, "realizar_prompt_tokens_cached") - counter(mid, "realizar_prompt_tokens_cached")
    prefilled = counter(after, "realizar_prompt_tokens_prefilled") - counter(mid, "realizar_prompt_tokens_prefilled")
    full = (len(ids) - 1) // block * block  # full blocks, never the prompt's last token
    assert cached == full, (cached, full, len(ids))
    assert prefilled == len(ids) - full
    assert counter(after, "realizar_prefix_cache_hits") >= counter(before, "realizar_prefix_cache_hits") + 1
    assert 0 < _sample(after, "realizar_prefix_cache_hit_rate") <= 1
    assert _sample(after, "realizar_kv_blocks_free") + _sample(after, "realizar_kv_blocks_used") == _sample(
        after, "realizar_kv_blocks_total")
