"""Scheduling of the serving engine on the CPU: the per-step token budget (a burst of long prompts never
puts more than the budget of prefill work between two tokens of a running stream, and the stream gets a
token every step), request priority (admission order, preemption order, results unchanged), and the
settings' plumbing from the command line and the server to the engine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realizar.engine import load_engine
from realizar.errors import InvalidRequestError
from realizar.generation import SamplingParams
from realizar.serving import ServingEngine
from realizar.serving.cpu_backend import ReferenceBatchBackend
from tests.helpers import examples
from tests.model_factory import make_hf_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    hf_dir, _ = make_hf_model("llama", tmp_path_factory.mktemp("schedule"), seed=31, max_position_embeddings=1536)
    return load_engine(hf_dir, device="cpu")


def _serving(engine, budget: int, num_blocks=160, block_size=16, max_batch=8) -> ServingEngine:
    backend = ReferenceBatchBackend(engine.model, num_blocks, block_size, max_batch=max_batch)
    # (no end-of-sequence token: a random model may draw one, and the streams here must run their length; the test
    # drives the steps)
    return ServingEngine(backend, engine.tokenizer, (), max_batched_tokens=budget, background=False)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 320, n).tolist()


@settings(max_examples=examples(6), deadline=None)
@given(budget=st.integers(8, 200), burst=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_a_burst_of_long_prompts_never_stalls_a_running_stream(engine, budget, burst, seed):
    serving = _serving(engine, budget)
    rng = np.random.default_rng(seed)
    stream = serving.submit(_prompt(seed, 12), SamplingParams(max_tokens=40, temperature=0))
    for _ in range(4):  # the stream's prompt, then a few tokens: it is decoding
        serving.step()
    assert stream._seq.generated >= 2
    seq_id = stream._seq.seq_id
    handles = [serving.submit(_prompt(seed + 1 + i, int(rng.integers(150, 400))), SamplingParams(max_tokens=2))
               for i in range(burst)]
    prefilled_since_token = 0
    steps = 0
    while not stream.done:
        out = serving.step()
        steps += 1
        prefill = sum(n for _, _, n in out.prefills)
        prefilled_since_token += prefill
        got_token = any(s == seq_id for s, _ in out.tokens)
        assert got_token, f"step {steps}: the running stream got no token ({prefill} prompt tokens prefilled)"
        assert prefilled_since_token <= budget, (prefilled_since_token, budget)
        prefilled_since_token = 0
    for h in handles:
        while not h.done:
            serving.step()
    assert stream.result.completion_tokens == 40


def test_priority_orders_admission(engine):
    """With one sequence at a time, queued requests run by priority (lower first), then by arrival."""
    serving = _serving(engine, 2048, max_batch=1)
    order = []
    prios = [0, 5, -3, 5, 0, -3]
    handles = [serving.submit(_prompt(i, 8), SamplingParams(max_tokens=2, priority=p)) for i, p in enumerate(prios)]
    seen = set()
    while not all(h.done for h in handles):
        out = serving.step()
        for sid in out.admitted:
            if sid not in seen:
                seen.add(sid)
                order.append(sid)
    ids = [h._seq.seq_id for h in handles]
    want = [ids[i] for i in sorted(range(len(prios)), key=lambda i: (prios[i], i))]
    assert order == want


def test_priority_preempts_the_lowest_priority_first_and_keeps_results(engine):
    """A pool too small for both: the high-priority request keeps running while the other is preempted, and
    both produce what they produce alone."""
    serving = _serving(engine, 2048, num_blocks=12, block_size=16, max_batch=4)
    lo = SamplingParams(max_tokens=60, temperature=0, priority=9)
    hi = SamplingParams(max_tokens=60, temperature=0, priority=-1)
    a = serving.submit(_prompt(1, 60), lo)
    b = serving.submit(_prompt(2, 60), hi)
    preempted = []
    while not (a.done and b.done):
        out = serving.step()
        preempted += out.preempted
    assert preempted and b._seq.seq_id not in preempted
    for h, ids, params in ((a, _prompt(1, 60), lo), (b, _prompt(2, 60), hi)):
        want = engine.generator.generate(ids, params, lambda c: None)
        assert h.result.token_ids == want.token_ids


def test_bad_priority_is_refused(engine):
    serving = _serving(engine, 64)
    for bad in (2**31, -(2**31), 1.5, True):
        with pytest.raises(InvalidRequestError, match="priority"):
            serving.submit(_prompt(0, 4), SamplingParams(max_tokens=1, priority=bad))


def test_cli_serve_passes_the_budget_and_chunk(monkeypatch):
    from realizar.cli import serve as cli_serve
    from realizar.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "512", "--prefill-chunk", "256"])
    opts = cli_serve.serving_options(args, "cpu")
    assert opts["max_batched_tokens"] == 512 and opts["prefill_chunk"] == 256
    args = build_parser().parse_args(["serve"])
    from realizar.config import ServingConfig

    opts = cli_serve.serving_options(args, "cpu")
    assert (opts["max_batched_tokens"], opts["prefill_chunk"]) == (ServingConfig.max_batched_tokens,
                                                                   ServingConfig.prefill_chunk)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-batched-tokens", "0"])


def test_create_app_configures_the_engine(engine):
    pytest.importorskip("fastapi")
    from realizar.server import create_app

    app = create_app(engine, max_batched_tokens=300, prefill_chunk=128, max_batch=2)
    serving = app.state.server.scheduler.serving
    try:
        assert serving.scheduler.max_batched_tokens == 300
        assert serving.scheduler.max_batch == 2
    finally:
        serving.close()


def test_f16_weights_flag_reaches_the_backend(engine, monkeypatch):
    """``serve --f16-weights`` (auto / on / off) becomes ServingConfig.f16_weights (None / True / False), which
    create_app hands to the engine's batch backend."""
    pytest.importorskip("fastapi")
    from realizar.cli import build_parser
    from realizar.cli import serve as cli_serve
    from realizar.server import create_app

    for flag, want in ((None, None), ("auto", None), ("on", True), ("off", False)):
        argv = ["serve"] + (["--f16-weights", flag] if flag else [])
        assert cli_serve.serving_options(build_parser().parse_args(argv), "cpu")["f16_weights"] is want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--f16-weights", "yes"])
    seen = []
    real = engine.batch_backend
    monkeypatch.setattr(engine, "batch_backend", lambda cfg: (seen.append(cfg), real(cfg))[1])
    app = create_app(engine, f16_weights=False, max_batch=2)
    try:
        assert [c.f16_weights for c in seen] == [False]
    finally:
        app.state.server.scheduler.serving.close()


def test_http_priority_field(tmp_path_factory):
    """The completions endpoint takes ``priority`` and answers an OpenAI-style 400 naming it when out of range."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from tests.test_server import serve_tiny

    gen = serve_tiny(tmp_path_factory)
    live = next(gen)
    try:
        body = {"model": live.engine.name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        assert httpx.post(live.url + "/v1/completions", json={**body, "priority": -7}, timeout=30).status_code == 200
        r = httpx.post(live.url + "/v1/completions", json={**body, "priority": 2**31}, timeout=30)
        assert r.status_code == 400 and "priority" in r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    finally:
        gen.close()


def test_a_4000_token_prompt_at_the_default_budget_starves_nothing(tmp_path_factory):
    """Issue 40, item 2, at the default settings: with a stream running, a 4,000-token prompt and then a short
    request arrive; between two tokens of the stream at most the default budget of prompt tokens is
    prefilled, the stream gets a token every step, and the short request's first token comes within three
    steps (the long prompt is split into budget-sized chunks and the short one joins the second)."""
    from realizar.config import ServingConfig

    budget = ServingConfig().max_batched_tokens
    hf_dir, _ = make_hf_model("llama", tmp_path_factory.mktemp("long"), seed=32, max_position_embeddings=4200)
    engine = load_engine(hf_dir, device="cpu")
    backend = ReferenceBatchBackend(engine.model, 300, 16, max_batch=8)
    serving = ServingEngine(backend, engine.tokenizer, (), background=False)
    assert serving.scheduler.max_batched_tokens == budget
    stream = serving.submit(_prompt(1, 12), SamplingParams(max_tokens=12, temperature=0))
    for _ in range(3):
        serving.step()
    seq_id = stream._seq.seq_id
    long = serving.submit(_prompt(2, 4000), SamplingParams(max_tokens=2))
    short = serving.submit(_prompt(3, 5), SamplingParams(max_tokens=2))
    steps = 0
    while not stream.done:
        out = serving.step()
        steps += 1
        assert any(s == seq_id for s, _ in out.tokens), f"step {steps}: no token for the running stream"
        assert sum(n for _, _, n in out.prefills) <= budget
        if steps == 3:
            assert short._t_first is not None, "the short request waited behind the long prompt"
    while not (long.done and short.done):
        serving.step()
    assert long.result.completion_tokens == 2 and short.result.completion_tokens == 2
