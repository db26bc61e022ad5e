"""/metrics under vLLM's names beside ours (what routers that balance vLLM replicas read): names, types, the
``model_name`` label, and values that move with real requests and agree with the ``realizar_*`` figures."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tests.test_server import PROMPT, LiveServer, _metrics, _sample, _tiny_gguf, _wait_idle, throttled_serving  # noqa: E402,E501

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:request_success")
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from realizar.engine import load_engine

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    srv = LiveServer(engine, serving=throttled_serving(engine, max_batch=4)).start()
    yield srv
    srv.stop()


def _count(m: dict, hist: str) -> float:
    return _sample(m, hist, hist + "_count")


def test_vllm_names_types_and_labels(live):
    m = _wait_idle(live)
    name = live.engine.name
    for fam in GAUGES:
        assert m[fam].type == "gauge", fam
        assert [s.labels for s in m[fam].samples] == [{"model_name": name}], fam
    for fam in COUNTERS + HISTOGRAMS:
        assert m[fam].type == ("counter" if fam in COUNTERS else "histogram"), fam
    assert _sample(m, "vllm:num_requests_running") == 0 and _sample(m, "vllm:num_requests_waiting") == 0
    assert _sample(m, "vllm:kv_cache_usage_perc") == 0


def test_vllm_figures_move_with_requests_and_match_ours(live):
    client, name = live.client(), live.engine.name
    block = live.serving.scheduler.block_size
    prompt = list(range(5, 5 + 2 * block + 3))  # two full blocks: the second and third requests find them cached
    before = _wait_idle(live)
    n_tokens = 6
    for stream in (False, True):
        r = client.completions.create(model=name, prompt=prompt, max_tokens=n_tokens, temperature=0, stream=stream)
        if stream:
            assert "".join(c.choices[0].text for c in r if c.choices)
    body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    assert httpx.post(live.url + "/v1/completions", json=body, timeout=30).status_code == 200
    after = _wait_idle(live)

    def moved(fam: str, sample: str | None = None, **labels) -> float:
        return _sample(after, fam, sample, **labels) - _sample(before, fam, sample, **labels)

    assert moved("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 3
    assert moved("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 3
    # token gaps: n - 1 for each request of n tokens
    assert moved("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 2 * (n_tokens - 1)
    assert moved("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") == 2 * n_tokens + 1
    assert moved("vllm:generation_tokens", "vllm:generation_tokens_total") == moved(
        "realizar_generation_tokens", "realizar_generation_tokens_total")
    assert moved("vllm:prompt_tokens", "vllm:prompt_tokens_total") == moved(
        "realizar_prompt_tokens", "realizar_prompt_tokens_total") > 0
    assert moved("vllm:request_generation_tokens", "vllm:request_generation_tokens_sum") == 2 * n_tokens + 1
    assert moved("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == moved(
        "realizar_prefix_cache_query_tokens", "realizar_prefix_cache_query_tokens_total")
    assert moved("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == moved(
        "realizar_prefix_cache_hit_tokens", "realizar_prefix_cache_hit_tokens_total")
    assert moved("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 4 * block  # two blocks, twice
    for fam in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert _sample(after, fam, fam + "_sum") > 0


def test_kv_cache_usage_is_the_fraction_of_blocks_held(live):
    """While a request runs, vllm:kv_cache_usage_perc equals blocks used / blocks total."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    live.backend.delay = 0.02
    try:
        body = {"model": live.engine.name, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: httpx.post(live.url + "/v1/completions", json=body, timeout=60))
            deadline = time.monotonic() + 10
            seen = None
            while time.monotonic() < deadline and not fut.done():
                m = _metrics(live)
                used, total = _sample(m, "realizar_kv_blocks_used"), _sample(m, "realizar_kv_blocks_total")
                if used:
                    seen = (_sample(m, "vllm:kv_cache_usage_perc"), used / total)
                    break
                time.sleep(0.01)
            assert fut.result().status_code == 200
    finally:
        live.backend.delay = 0.0
    assert seen is not None, "never saw the request hold KV blocks"
    assert 0 < seen[0] <= 1 and seen[0] == pytest.approx(seen[1])
