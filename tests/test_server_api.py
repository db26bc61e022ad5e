"""The OpenAI features beyond one greedy choice, through the official ``openai`` client against a live
server on the CPU (a tiny random llama): n and best_of, logprobs checked against the reference
model's own log-softmax, presence/frequency penalties, lists of prompts, tokenize/detokenize and
the optional API key."""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from realizar.engine import load_engine  # noqa: E402
from realizar.generation import SamplingParams  # noqa: E402
from realizar.sampling import log_softmax  # noqa: E402
from tests.test_server import MESSAGES, PROMPT, LiveServer  # noqa: E402

KEY = "sk-test-4f1c"


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from tests.gguf_factory import shared_tiny_gguf

    return shared_tiny_gguf(tmp_path_factory)


@pytest.fixture(scope="module")
def oracle(gguf_path):
    return load_engine(str(gguf_path), device="cpu")


@pytest.fixture(scope="module")
def live(gguf_path):
    srv = LiveServer(load_engine(str(gguf_path), device="cpu"), api_key=KEY).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _model_logprobs(oracle, prompt_ids: list[int], generated: list[int]) -> list[np.ndarray]:
    """The reference model's log-softmax before each generated token, teacher-forced."""
    model = oracle.model
    model.reset()
    logits = model.prefill(list(prompt_ids))
    out = []
    for tok in generated:
        out.append(log_softmax(np.asarray(logits, dtype=np.float64)))
        logits = model.decode(tok)
    return out


# ---------------------------------------------------------------------------------------------- n


def test_n3_seeded_gives_three_different_reproducible_choices(client, live, oracle):
    kw = dict(model=live.engine.name, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=7)
    r = client.completions.create(**kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert [c.text for c in client.completions.create(**kw).choices] == texts
    # choice i is the serving engine's generation with seed 7 + i, run alone
    from realizar.serving import ServingEngine

    with ServingEngine.from_engine(oracle, max_batch=1) as alone:
        ids = oracle.tokenizer.encode(PROMPT)
        wants = [alone.submit(ids, SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i)).wait() for i in range(3)]
    assert texts == [w.text for w in wants]
    assert r.usage.completion_tokens == sum(w.completion_tokens for w in wants)
    assert r.usage.prompt_tokens == len(oracle.tokenizer.encode(PROMPT))


def test_chat_n3_streamed_choices_carry_their_index(client, live):
    kw = dict(model=live.engine.name, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=11)
    whole = client.chat.completions.create(**kw)
    streamed: dict[int, str] = {}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert sorted(streamed) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert [streamed[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert len({c.message.content for c in whole.choices}) == 3


def test_best_of_returns_the_highest_mean_logprob_candidates(client, live, oracle):
    kw = dict(model=live.engine.name, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=3)
    cands = client.completions.create(n=4, logprobs=0, **kw).choices
    means = [np.mean(c.logprobs.token_logprobs) for c in cands]
    r = client.completions.create(n=2, best_of=4, **kw)
    order = sorted(range(4), key=lambda i: (-means[i], i))[:2]
    assert [c.text for c in r.choices] == [cands[i].text for i in order]
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)


def test_list_of_prompts_each_gets_its_choices_in_order(client, live, oracle):
    prompts = ["Once upon a time", PROMPT, "1 2 3"]
    r = client.completions.create(model=live.engine.name, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    for p, prompt in enumerate(prompts):
        want = oracle.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0)).text
        assert [r.choices[2 * p].text, r.choices[2 * p + 1].text] == [want, want]
    assert r.usage.prompt_tokens == sum(len(oracle.tokenizer.encode(p)) for p in prompts)
    ids = [oracle.tokenizer.encode(p) for p in prompts[:2]]
    r2 = client.completions.create(model=live.engine.name, prompt=ids, max_tokens=5, temperature=0)
    assert [c.text for c in r2.choices] == [r.choices[0].text, r.choices[2].text]


# ---------------------------------------------------------------------------------------- logprobs


def test_completion_logprobs_match_the_reference_log_softmax(client, live, oracle):
    r = client.completions.create(model=live.engine.name, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                  seed=5, logprobs=3, presence_penalty=1.0)  # fmt: skip
    lp = r.choices[0].logprobs
    generated = oracle.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                       presence_penalty=1.0)).token_ids  # fmt: skip
    ref = _model_logprobs(oracle, oracle.tokenizer.encode(PROMPT), generated)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(generated)
    for step, (tok, got) in enumerate(zip(generated, lp.token_logprobs)):
        assert abs(got - ref[step][tok]) < 1e-4
        top3 = np.argsort(-ref[step], kind="stable")[:3]
        got_top = sorted(lp.top_logprobs[step].values(), reverse=True)
        np.testing.assert_allclose(got_top, ref[step][top3], atol=1e-4)
    assert abs(sum(lp.token_logprobs) - sum(ref[i][t] for i, t in enumerate(generated))) < 1e-4
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(o <= len(r.choices[0].text) for o in lp.text_offset)


def test_chat_logprobs_shape_and_values_streamed_and_whole(client, live, oracle):
    kw = dict(model=live.engine.name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    generated = oracle.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0.0)).token_ids
    ref = _model_logprobs(oracle, oracle.chat_prompt(MESSAGES), generated)
    assert len(content) == len(generated)
    for step, (entry, tok) in enumerate(zip(content, generated)):
        assert abs(entry.logprob - ref[step][tok]) < 1e-4
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(ref[step].max(), abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy: the chosen token is the likeliest
        assert isinstance(entry.bytes, list)
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [(e.token, round(e.logprob, 6)) for e in streamed] == [(e.token, round(e.logprob, 6)) for e in content]


# --------------------------------------------------------------------------------------- penalties


def test_penalties_through_the_server_match_the_engine(client, live, oracle):
    kw = dict(max_tokens=16, temperature=0.0)
    plain = client.completions.create(model=live.engine.name, prompt=PROMPT, **kw).choices[0].text
    got = client.completions.create(model=live.engine.name, prompt=PROMPT, frequency_penalty=2.0,
                                    presence_penalty=2.0, **kw).choices[0].text  # fmt: skip
    pen = oracle.generate(PROMPT, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0, **kw))
    assert got == pen.text
    plain_ids = oracle.generate(PROMPT, SamplingParams(**kw)).token_ids
    assert len(set(plain_ids)) < len(plain_ids), "the tiny model should repeat itself greedily"
    assert len(set(pen.token_ids)) > len(set(plain_ids)) and got != plain


# --------------------------------------------------------------------------------------- tokenize


def test_tokenize_detokenize_round_trip(live, oracle):
    h = {"Authorization": f"Bearer {KEY}"}
    text = "Hello world, the capital of France is Paris."
    r = httpx.post(live.url + "/tokenize", json={"content": text}, headers=h, timeout=30).json()
    assert r["tokens"] == oracle.tokenizer.encode(text, add_special_tokens=False) and r["count"] == len(r["tokens"])
    back = httpx.post(live.url + "/detokenize", json={"tokens": r["tokens"]}, headers=h, timeout=30).json()
    assert back["content"] == text
    r = httpx.post(live.url + "/tokenize", json={"prompt": text}, headers=h, timeout=30).json()
    assert r["tokens"] == oracle.tokenizer.encode(text)
    r = httpx.post(live.url + "/tokenize", json={"messages": MESSAGES}, headers=h, timeout=30).json()
    assert r["tokens"] == oracle.chat_prompt(MESSAGES)
    r = httpx.post(live.url + "/tokenize", json={"content": "ab", "with_pieces": True}, headers=h, timeout=30).json()
    assert "".join(t["piece"] for t in r["tokens"]) == "ab"
    bad = httpx.post(live.url + "/detokenize", json={"tokens": [10**9]}, headers=h, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(live.url + "/tokenize", json={"content": "a", "prompt": "b"}, headers=h, timeout=30)
    assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]


# ---------------------------------------------------------------------------------------- API key


def test_api_key_guards_v1_and_tokenize_not_health(live):
    name = live.engine.name
    calls = [("post", "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1}),
             ("post", "/v1/chat/completions", {"model": name, "messages": MESSAGES, "max_tokens": 1}),
             ("get", "/v1/models", None), ("post", "/tokenize", {"content": "hi"}),
             ("post", "/detokenize", {"tokens": [1]})]  # fmt: skip
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, live.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.request(method, live.url + path, json=body, headers={"Authorization": f"bearer {KEY}"}, timeout=30)
        assert ok.status_code == 200, (path, ok.text)
    assert httpx.get(live.url + "/health", timeout=10).status_code == 200
    assert httpx.get(live.url + "/metrics", timeout=10).status_code == 200
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_streamed_completion_logprobs_per_chunk(client, live):
    kw = dict(model=live.engine.name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, lps = [], []
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
    assert tokens == whole.tokens
    np.testing.assert_allclose(lps, whole.token_logprobs, atol=1e-9)
    assert json.loads(json.dumps(whole.top_logprobs))  # plain JSON
