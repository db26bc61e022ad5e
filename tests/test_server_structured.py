"""Structured output and tool calls through the official ``openai`` client against a live server
on the CPU (a tiny random llama; its chat template is swapped for one that renders tools)."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from realizar.engine import load_engine  # noqa: E402
from realizar.server.routes.chat import _chat_prompt  # noqa: E402
from realizar.server.structured_chat import plan_chat  # noqa: E402
from realizar.server import protocol as P  # noqa: E402
from realizar.text.chat import CHATML_TEMPLATE  # noqa: E402
from tests.test_server import LiveServer  # noqa: E402

# A ChatML template that lists the tools in a system turn, in the manner of tool-aware templates.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools you can call:\n"
    "{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

RECORD = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 8},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "rating": {"enum": [1, 2, 3, 4, 5]},
        "seen": {"type": "boolean"},
    },
    "required": ["title", "year", "rating", "seen"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather report for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from tests.gguf_factory import make_gguf_model

    # a longer context than the shared tiny model's: rendered tool definitions take room
    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp("structured"), qtype="Q8_0", seed=0,
                                 max_position_embeddings=1024)  # fmt: skip
    return path


@pytest.fixture(scope="module")
def live(gguf_path):
    engine = load_engine(str(gguf_path), device="cpu")
    engine.tokenizer.chat_template = TOOLS_TEMPLATE
    srv = LiveServer(engine).start()
    yield srv
    srv.stop()


@pytest.fixture()
def client(live):
    return live.client()


def _ask(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe film number {i} as JSON."}]


def test_json_schema_outputs_validate_for_20_prompts(client, live):
    fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": RECORD, "strict": True}}
    outputs = []
    for i in range(20):
        r = client.chat.completions.create(model=live.engine.name, messages=_ask(i), response_format=fmt,
                                           max_tokens=120, temperature=1.0, seed=i)  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (i, choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, RECORD)
        outputs.append(choice.message.content)
    assert len(set(outputs)) > 1


def test_json_schema_streamed(client, live):
    fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": RECORD}}
    stream = client.chat.completions.create(model=live.engine.name, messages=_ask(99), response_format=fmt,
                                            max_tokens=120, seed=5, temperature=1.0, stream=True)  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), RECORD)


def test_json_object_parses(client, live):
    # "object of small integers" keeps a random model short; json_object itself allows any object
    done = 0
    for i in range(6):
        r = client.chat.completions.create(model=live.engine.name, messages=_ask(i), max_tokens=150,
                                           response_format={"type": "json_object"}, seed=40 + i)  # fmt: skip
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert text.startswith("{")
        if finish == "stop":
            assert isinstance(json.loads(text), dict)
            done += 1
        else:
            assert finish == "length"
    assert done >= 1


def test_truncated_json_reports_length(client, live):
    fmt = {"type": "json_schema", "json_schema": {"name": "film", "schema": RECORD}}
    r = client.chat.completions.create(model=live.engine.name, messages=_ask(1), response_format=fmt, max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_returns_tool_calls(client, live, stream):
    kw = dict(model=live.engine.name, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=120, seed=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert finish == ["tool_calls"] and len(calls) == 1 and calls[0].index == 0
        call = calls[0]
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.content is None
        (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])


def test_required_tool_choice_and_a_follow_up_turn(client, live):
    r = client.chat.completions.create(model=live.engine.name, messages=[{"role": "user", "content": "Rome?"}],
                                       tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=120, seed=11)  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    # the call and its result go back in; the template renders them and the answer is plain text
    history = [{"role": "user", "content": "Rome?"}, r.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]  # fmt: skip
    r2 = client.chat.completions.create(model=live.engine.name, messages=history, tools=[WEATHER],
                                        tool_choice="none", max_tokens=8, seed=1)  # fmt: skip
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.tool_calls is None


def test_tool_definitions_are_in_the_rendered_prompt(live):
    engine = live.engine
    req = P.ChatCompletionRequest(model=engine.name, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER])
    plan = plan_chat(req, engine.tokenizer)
    text = engine.tokenizer.decode(_chat_prompt(engine, plan.messages(req.plain_messages()), plan.template_tools()))
    assert "Tools you can call:" in text and '"name": "get_weather"' in text and "Weather report for a city" in text
    # a template that ignores tools: they are listed in a system message instead
    saved, engine.tokenizer.chat_template = engine.tokenizer.chat_template, CHATML_TEMPLATE
    try:
        plan = plan_chat(req, engine.tokenizer)
        assert plan.template_tools() is None
        text = engine.tokenizer.decode(_chat_prompt(engine, plan.messages(req.plain_messages()), None))
        assert text.startswith("<|im_start|>system\n") and "Weather report for a city" in text
    finally:
        engine.tokenizer.chat_template = saved
    # tool_choice "none": nothing about tools reaches the prompt
    req_none = P.ChatCompletionRequest(model=engine.name, messages=[{"role": "user", "content": "hi"}],
                                       tools=[WEATHER], tool_choice="none")  # fmt: skip
    plan = plan_chat(req_none, engine.tokenizer)
    assert "get_weather" not in engine.tokenizer.decode(_chat_prompt(engine, plan.messages(req_none.plain_messages()),
                                                                      plan.template_tools()))  # fmt: skip


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"tools": [{"type": "function"}]}, "tools", "function"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "string", "pattern": "(("}}}}}], "tool_choice": "required"}, "tools", "regex"),
    # schemas that compile but that nothing can satisfy (issue 40, item 8: they answered 200 with empty content)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format", "cannot be enforced"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}},
     "response_format", "cannot be enforced"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, param, needle", BAD)
def test_bad_formats_and_tools_get_400(live, extra, param, needle, stream):
    """Before any response starts (a stream too gets the 400, not a 200 and then an error), naming the part,
    without the grammar engine's internal state."""
    body = {"model": live.engine.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "stream": stream, **extra}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert needle in err["message"] and "<state>" not in err["message"] and len(err["message"]) < 400
