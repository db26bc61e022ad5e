"""Helpers the API-translation tests share (Anthropic's Messages API, OpenAI's Responses API): a live CPU
server whose chat template renders tools, tool calls and tool results, reading a stream's named events,
and checking that a client gone mid-stream stops its generation."""

from __future__ import annotations

import json

import httpx

from realizar.engine import load_engine
from tests.test_server import LiveServer, _sample, _wait_idle, throttled_serving

# ChatML that lists the tools in a system turn and renders an assistant's tool calls and tool results
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t['function'] | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tool_template_server(tmp_path_factory, name: str, api_key: str) -> LiveServer:
    """A started live server of a tiny random llama (1024 positions) with :data:`TEMPLATE`."""
    from tests.gguf_factory import make_gguf_model

    path, _, _ = make_gguf_model("llama", tmp_path_factory.mktemp(name), qtype="Q8_0", seed=0,
                                 max_position_embeddings=1024)  # fmt: skip
    engine = load_engine(str(path), device="cpu")
    engine.tokenizer.chat_template = TEMPLATE
    return LiveServer(engine, api_key=api_key, serving=throttled_serving(engine)).start()


def sse_events(url: str, body: dict, headers: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed answer, read raw (each data's ``type`` is its event)."""
    out = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == event
                out.append((event, data))
    return out


def check_disconnect_stops(live, path: str, body: dict, headers: dict, delta_event: str) -> None:
    """A client that goes away after two ``delta_event`` events of a long stream has its generation
    cancelled (counted once) long before it would have ended."""
    backend = live.backend
    before = _wait_idle(live)
    cancelled0 = _sample(before, "realizar_requests_cancelled")
    backend.delay = 0.05
    try:
        decodes0 = backend.decodes
        with httpx.Client(timeout=30) as h:
            with h.stream("POST", live.url + path, json={**body, "stream": True}, headers=headers) as r:
                assert r.status_code == 200
                deltas = 0
                for line in r.iter_lines():
                    deltas += line == f"event: {delta_event}"
                    if deltas >= 2:
                        break
        m = _wait_idle(live, timeout=10)
        assert _sample(m, "realizar_requests_cancelled") == cancelled0 + 1
        assert backend.decodes - decodes0 < 250
    finally:
        backend.delay = 0.0


def app_options(monkeypatch, *args, **kwargs) -> dict:
    """The keywords ``realizar.server.serve(*args, **kwargs)`` hands to ``create_app`` (stopped there: nothing
    binds or serves)."""
    import pytest

    import realizar.server as server

    seen = {}

    class Made(Exception):
        pass

    def fake(engine, **kw):
        seen.update(kw)
        raise Made

    monkeypatch.setattr(server, "create_app", fake)
    with pytest.raises(Made):
        server.serve(*args, **kwargs)
    return seen
