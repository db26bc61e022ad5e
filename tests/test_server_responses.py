"""OpenAI's Responses API (``POST /v1/responses``, stateless) through the official ``openai`` client against a
live server on the CPU (a tiny random llama; its chat template swapped for one that renders tools, tool
calls and tool results): whole and streamed answers, instructions and message items, max_output_tokens,
JSON schema output, forced function calls and a follow-up turn with their output, errors, and a
disconnect stopping the generation."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.server_helpers import check_disconnect_stops, sse_events, tool_template_server  # noqa: E402

KEY = "sk-resp-test-5"
GREEDY = {"temperature": 0}
ASK = "Name a city in France."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather report for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    srv = tool_template_server(tmp_path_factory, "responses", KEY)
    yield srv
    srv.stop()


@pytest.fixture()
def client(live):
    live.backend.delay = 0.0
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _events(live, body: dict) -> list[tuple[str, dict]]:
    out = sse_events(live.url + "/v1/responses", body, {"Authorization": f"Bearer {KEY}"})
    assert [d["sequence_number"] for _, d in out] == list(range(len(out)))
    return out


def _prompt_len(live, messages: list[dict], tools: list[dict] | None = None) -> int:
    return len(live.engine.chat_prompt(messages, **({"tools": tools} if tools else {})))


def test_string_input(client, live):
    r = client.responses.create(model=live.engine.name, input=ASK, max_output_tokens=8, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == live.engine.name
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.error is None
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.output_text and r.output_text == item.content[0].text and item.content[0].annotations == []
    assert r.usage.input_tokens == _prompt_len(live, [{"role": "user", "content": ASK}])
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True
    again = client.responses.create(model=live.engine.name, input=ASK, max_output_tokens=8, store=True,
                                    metadata={"k": "v"}, user="u1", **GREEDY)  # fmt: skip
    assert again.output_text == r.output_text and again.metadata == {"k": "v"}


def test_instructions_and_message_items_reach_the_template(client, live):
    name = live.engine.name
    r = client.responses.create(model=name, input=ASK, instructions="Be terse.", max_output_tokens=2, **GREEDY)
    assert r.instructions == "Be terse."
    assert r.usage.input_tokens == _prompt_len(live, [{"role": "system", "content": "Be terse."},
                                                      {"role": "user", "content": ASK}])  # fmt: skip
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello. "},
                                                             {"type": "input_text", "text": ASK}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Paris", "annotations": []}]},
             {"role": "system", "content": "Be terse."},
             {"role": "user", "content": "Another?"}]  # fmt: skip
    r = client.responses.create(model=name, input=items, instructions="Hi.", max_output_tokens=2, **GREEDY)
    want = [{"role": "system", "content": "Hi."}, {"role": "system", "content": "Answer in French."},
            {"role": "user", "content": "Hello. " + ASK}, {"role": "assistant", "content": "Paris"},
            {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Another?"}]  # fmt: skip
    assert r.usage.input_tokens == _prompt_len(live, want)
    # an earlier response's output goes back as the SDK gave it
    first = client.responses.create(model=name, input=ASK, max_output_tokens=3, **GREEDY)
    again = client.responses.create(model=name, input=[*items[:2], *first.output, *items[3:]], instructions="Hi.",
                                    max_output_tokens=2, **GREEDY)  # fmt: skip
    want[3] = {"role": "assistant", "content": first.output_text}
    assert again.usage.input_tokens == _prompt_len(live, want)


def test_streamed_events_in_order_and_deltas_join_to_the_answer(client, live):
    name = live.engine.name
    whole = client.responses.create(model=name, input=ASK, max_output_tokens=12, **GREEDY)
    events = _events(live, {"model": name, "input": ASK, "max_output_tokens": 12, **GREEDY})
    names = [e for e, _ in events]
    n = names.count("response.output_text.delta")
    assert n >= 1 and names == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * n, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    deltas = [d for e, d in events if e == "response.output_text.delta"]
    mid = events[2][1]["item"]["id"]
    assert all(d["item_id"] == mid and d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    assert "".join(d["delta"] for d in deltas) == whole.output_text == events[-4][1]["text"]
    final = events[-1][1]["response"]
    assert final["output"][0]["id"] == mid and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    # the SDK parses every event (its get_final_response() wants a response.completed: not for an incomplete one)
    with client.responses.stream(model=name, input=ASK, max_output_tokens=12, **GREEDY) as s:
        got = list(s)
    text = "".join(e.delta for e in got if e.type == "response.output_text.delta")
    assert got[-1].type == "response.incomplete" and got[-1].response.status == "incomplete"
    assert text == got[-1].response.output_text == whole.output_text
    stream = client.responses.create(model=name, input=ASK, max_output_tokens=12, stream=True, **GREEDY)
    kinds = [e.type for e in stream]  # (the text comes in as many deltas as the decode steps gave)
    assert [k for i, k in enumerate(kinds) if k != "response.output_text.delta" or kinds[i - 1] != k] == \
        [k for i, k in enumerate(names) if k != "response.output_text.delta" or names[i - 1] != k]


def test_max_output_tokens_and_completed_status(client, live):
    r = client.responses.create(model=live.engine.name, input=ASK, max_output_tokens=3, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.max_output_tokens == 3
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model=live.engine.name, input="ok?", max_output_tokens=40, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                 "strict": True}})  # fmt: skip
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_json_schema_text_format(client, live):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "pop": {"type": "integer"}},
              "required": ["city", "pop"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model=live.engine.name, input=ASK, max_output_tokens=80, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(model=live.engine.name, input=ASK, max_output_tokens=60, **GREEDY,
                                text={"format": {"type": "json_object"}})  # fmt: skip
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_forced_function_call_then_its_output(client, live):
    name = live.engine.name
    r = client.responses.create(model=name, input="Weather in Paris?", tools=[WEATHER], tool_choice=FORCED,
                                max_output_tokens=120, **GREEDY)  # fmt: skip
    assert r.status == "completed"
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    # the call goes back as the SDK gave it, with its output; the template renders both
    items = [{"role": "user", "content": "Weather in Paris?"}, *r.output,
             {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}]  # fmt: skip
    r2 = client.responses.create(model=name, input=items, tools=[WEATHER], tool_choice="none",
                                 max_output_tokens=4, **GREEDY)  # fmt: skip
    assert [o.type for o in r2.output] == ["message"]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                                                                     "function": {"name": "get_weather",
                                                                                  "arguments": args}}]},
                {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "21 C, sunny"}]
    text = live.engine.tokenizer.decode(live.engine.chat_prompt(messages))
    assert "21 C, sunny" in text and '"name": "get_weather"' in text
    assert r2.usage.input_tokens == _prompt_len(live, messages)
    # "required" forces some call
    r3 = client.responses.create(model=name, input="Rome?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, **GREEDY)  # fmt: skip
    assert [o.type for o in r3.output] == ["function_call"] and r3.parallel_tool_calls is False


def test_streamed_function_call_argument_deltas(client, live):
    body = {"model": live.engine.name, "input": "Rome?", "tools": [WEATHER], "tool_choice": FORCED,
            "max_output_tokens": 120, **GREEDY}  # fmt: skip
    events = _events(live, body)
    names = [e for e, _ in events]
    n = names.count("response.function_call_arguments.delta")
    assert n >= 1 and names == [
        "response.created", "response.in_progress", "response.output_item.added",
        *["response.function_call_arguments.delta"] * n, "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]  # fmt: skip
    added = events[2][1]["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather" and added["arguments"] == ""
    joined = "".join(d["delta"] for e, d in events if e == "response.function_call_arguments.delta")
    assert joined == events[-3][1]["arguments"] == events[-1][1]["response"]["output"][0]["arguments"]
    assert all(d["item_id"] == added["id"] for e, d in events if e.startswith("response.function_call"))
    jsonschema.validate(json.loads(joined), WEATHER["parameters"])
    kw = {k: v for k, v in body.items() if k != "temperature"}
    with client.responses.stream(**kw, temperature=0) as s:
        final = s.get_final_response()
    assert final.output[0].type == "function_call"
    jsonschema.validate(json.loads(final.output[0].arguments), WEATHER["parameters"])


BAD = [
    ({"previous_response_id": "resp_123"}, "previous_response_id is not supported: this server is stateless"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "'input_image'"),
    ({"tools": [{"type": "web_search"}]}, "only function tools (type 'function') are supported, got 'web_search'"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "an item of type 'reasoning'"),
    ({"input": [{"type": "bogus"}]}, "an item of type 'bogus'"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "no earlier function_call"),
    ({"max_output_tokens": 10**6}, "maximum context length"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"frobnicate": 1}, "unsupported field(s) frobnicate"),
    ({"input": []}, "non-empty"),
]


@pytest.mark.parametrize("extra, needle", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_are_400(client, live, extra, needle):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:  # (extra_body: what the SDK's arguments would refuse)
            client.responses.create(model=live.engine.name, input=ASK, max_output_tokens=4, stream=stream,
                                    extra_body=extra)  # fmt: skip
        assert needle in e.value.message, e.value.message


def test_unknown_model_and_key(client, live):
    with pytest.raises(openai.NotFoundError, match="gpt-nope"):
        client.responses.create(model="gpt-nope", input=ASK, max_output_tokens=2)
    wrong = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model=live.engine.name, input=ASK, max_output_tokens=2)


def test_disconnect_mid_stream_stops_the_generation(live):
    body = {"model": live.engine.name, "max_output_tokens": 500, "input": ASK, **GREEDY}
    check_disconnect_stops(live, "/v1/responses", body, {"Authorization": f"Bearer {KEY}"},
                           "response.output_text.delta")  # fmt: skip
