"""Anthropic's Messages API (``POST /v1/messages``) through the official ``anthropic`` client against a
live server on the CPU (a tiny random llama; its chat template swapped for one that renders tools,
tool calls and tool results): whole and streamed answers, system prompts, stop sequences, max_tokens,
forced tool use and a follow-up turn, errors in Anthropic's shape, the ``x-api-key`` header, and a
disconnect stopping the generation.

(Recent SDKs no longer take ``temperature`` as an argument: it goes in ``extra_body``.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server_helpers import check_disconnect_stops, sse_events, tool_template_server  # noqa: E402

KEY = "sk-ant-test-77"
GREEDY = {"temperature": 0}

WEATHER = {
    "name": "get_weather",
    "description": "Weather report for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
HI = [{"role": "user", "content": "Name a city in France."}]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    srv = tool_template_server(tmp_path_factory, "messages", KEY)
    yield srv
    srv.stop()


@pytest.fixture()
def client(live):
    live.backend.delay = 0.0
    return anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=60)


def _events(live, body: dict) -> list[tuple[str, dict]]:
    return sse_events(live.url + "/v1/messages", body, {"x-api-key": KEY})


def test_whole_answer(client, live):
    r = client.messages.create(model=live.engine.name, max_tokens=8, messages=HI, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == live.engine.name and r.stop_reason == "max_tokens" and r.stop_sequence is None
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    want = live.engine.chat_prompt([{"role": "user", "content": HI[0]["content"]}])
    assert r.usage.input_tokens == len(want) and r.usage.output_tokens == 8
    again = client.messages.create(model=live.engine.name, max_tokens=8, messages=HI, extra_body=GREEDY)
    assert again.content[0].text == r.content[0].text


def test_streamed_text_equals_the_whole_answer_and_events_come_in_order(client, live):
    kw = dict(model=live.engine.name, max_tokens=12, messages=HI, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    events = _events(live, {"model": live.engine.name, "max_tokens": 12, "messages": HI, **GREEDY})
    names = [e for e, _ in events]
    n = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * n,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert "".join(d["delta"]["text"] for e, d in events if e == "content_block_delta") == whole.content[0].text
    assert all(d["delta"]["type"] == "text_delta" for e, d in events if e == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


def test_system_prompt_string_and_blocks_reach_the_template(client, live):
    name, engine = live.engine.name, live.engine
    plain = client.messages.create(model=name, max_tokens=2, messages=HI, extra_body=GREEDY)
    s = client.messages.create(model=name, max_tokens=2, messages=HI, system="Be terse.\nAnswer in French.",
                               extra_body=GREEDY)  # fmt: skip
    blocks = client.messages.create(model=name, max_tokens=2, messages=HI, extra_body=GREEDY, system=[
        {"type": "text", "text": "Be terse."},
        {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral"}}])  # fmt: skip
    want = engine.chat_prompt([{"role": "system", "content": "Be terse.\nAnswer in French."}, HI[0]])
    assert s.usage.input_tokens == blocks.usage.input_tokens == len(want) > plain.usage.input_tokens
    assert s.content[0].text == blocks.content[0].text


def test_stop_sequences(client, live):
    name = live.engine.name
    text = client.messages.create(model=name, max_tokens=16, messages=HI, extra_body=GREEDY).content[0].text
    # a stop sequence the greedy answer runs into: two printable ASCII characters from it
    k = next((i for i in range(1, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable()), None)
    if k is None:
        pytest.skip(f"the tiny model's answer has no printable ASCII pair: {text!r}")
    seq = text[k:k + 2]
    r = client.messages.create(model=name, max_tokens=16, messages=HI, extra_body=GREEDY,
                               stop_sequences=["\x07never", seq])  # fmt: skip
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == seq
    assert r.content[0].text == text[: text.find(seq)]
    events = _events(live, {"model": name, "max_tokens": 16, "messages": HI, "stop_sequences": [seq], **GREEDY})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": seq}


def test_max_tokens_reason(client, live):
    r = client.messages.create(model=live.engine.name, max_tokens=3, messages=HI, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_forced_tool_use_then_a_tool_result_turn(client, live):
    name = live.engine.name
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.messages.create(model=name, max_tokens=120, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)  # fmt: skip
    assert r.stop_reason == "tool_use", r.content
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    # the call and its result go back; the template renders both (more prompt tokens than the question alone)
    history = [*ask, {"role": "assistant", "content": r.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"},
                                            {"type": "text", "text": "And tomorrow?"}]}]  # fmt: skip
    r2 = client.messages.create(model=name, max_tokens=6, messages=history, tools=[WEATHER],
                                tool_choice={"type": "none"}, extra_body=GREEDY)  # fmt: skip
    assert r2.stop_reason in ("end_turn", "max_tokens") and [b.type for b in r2.content] == ["text"]
    ids = live.engine.chat_prompt([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": "get_weather", "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "name": "get_weather", "content": "21 C, sunny"},
        {"role": "user", "content": "And tomorrow?"}])  # fmt: skip
    text = live.engine.tokenizer.decode(ids)
    assert "21 C, sunny" in text and '"name": "get_weather"' in text and r2.usage.input_tokens == len(ids)
    # "any" forces some tool; an error result is accepted too
    r3 = client.messages.create(model=name, max_tokens=120, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY)  # fmt: skip
    assert r3.stop_reason == "tool_use" and r3.content[-1].type == "tool_use"
    bad = [*ask, {"role": "assistant", "content": r3.content},
           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r3.content[-1].id, "is_error": True,
                                         "content": [{"type": "text", "text": "no such city"}]}]}]  # fmt: skip
    assert client.messages.create(model=name, max_tokens=2, messages=bad).usage.output_tokens <= 2


def test_streamed_tool_use_sends_input_json_pieces(client, live):
    kw = dict(model=live.engine.name, max_tokens=120, messages=[{"role": "user", "content": "Rome?"}],
              tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)  # fmt: skip
    events = list(client.messages.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert len(starts) == 1 and starts[0].content_block.type == "tool_use"
    assert starts[0].content_block.name == "get_weather" and starts[0].content_block.id.startswith("toolu_")
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
    value = json.loads("".join(pieces))
    jsonschema.validate(value, WEATHER["input_schema"])
    assert events[-2].delta.stop_reason == "tool_use"
    with anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=60).messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])


BAD = [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "first message must have the role 'user'"),
    ({"messages": [{"role": "system", "content": "x"}, *HI]}, "top-level 'system'"),
    ({"messages": [*HI, {"role": "assistant", "content": "Paris"}]}, "last message must have the role 'user'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "got 'image'"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "without a type"),
    ({"messages": [{"role": "user", "content": 3}]}, "must be a string or a list of content blocks, got int"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]},
     "no tool_use block with that id"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "unsupported field(s) thinking"),
    ({"max_tokens": 10**6}, "maximum context length"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "only client tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tool_choice": {"type": "any"}}, "needs tools"),
    ({"stop_sequences": [""]}, "stop_sequences"),
]


@pytest.mark.parametrize("extra, needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_are_400_in_anthropic_shape(live, extra, needle):
    body = {"model": live.engine.name, "max_tokens": 4, "messages": HI, **extra}
    for stream in (False, True):
        r = httpx.post(live.url + "/v1/messages", json={**body, "stream": stream}, headers={"x-api-key": KEY},
                       timeout=30)  # fmt: skip
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and set(r.json()) == {"type", "error"}
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and needle in err["message"], err


def test_missing_max_tokens_and_error_shapes(live):
    url, name = live.url + "/v1/messages", live.engine.name
    r = httpx.post(url, json={"model": name, "messages": HI}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}  # fmt: skip
    body = {"model": name, "max_tokens": 2, "messages": HI}
    r = httpx.post(url, json=body, headers={"x-api-key": "wrong"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url, json={**body, "model": "claude-nope"}, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error" and "claude-nope" in r.text
    r = httpx.get(url, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "error"
    # Bearer works here too; the OpenAI endpoints keep OpenAI's error body
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    r = httpx.post(live.url + "/v1/chat/completions", json={**body, "model": "claude-nope"},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=30)  # fmt: skip
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and "type" not in r.json()
    # x-api-key works on the OpenAI endpoints as well
    r = httpx.post(live.url + "/v1/chat/completions", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 200


def test_sdk_raises_its_typed_errors(client, live):
    name = live.engine.name
    with pytest.raises(anthropic.BadRequestError, match="first message"):
        client.messages.create(model=name, max_tokens=4, messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model=name, max_tokens=4, messages=HI, extra_body={"max_tokens": None})
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        client.messages.create(model=name, max_tokens=100_000, messages=HI)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=HI)
    wrong = anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=name, max_tokens=4, messages=HI)


def test_disconnect_mid_stream_stops_the_generation(live):
    body = {"model": live.engine.name, "max_tokens": 500, "messages": HI, **GREEDY}
    check_disconnect_stops(live, "/v1/messages", body, {"x-api-key": KEY}, "content_block_delta")
