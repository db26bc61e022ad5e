"""Hardening, each a case that failed before its fix: a FIFO (or a directory whose config.json is one) as the
model path is refused at once instead of blocking forever; deeply nested JSON over 32 KB is a 400, not a 500;
a non-string ``tool_choice`` function name is a 400, not a 500; the listening socket is TCP (asyncio then sets
TCP_NODELAY: keep-alive responses are not held back by Nagle's algorithm)."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from realizar.server import bind_socket  # noqa: E402
from tests.test_server import LiveServer, _tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from realizar.engine import load_engine

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    srv = LiveServer(engine).start()
    yield srv
    srv.stop()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
@pytest.mark.parametrize("command", [["generate", "hi"], ["info"]])
def test_a_fifo_as_the_model_is_refused_at_once(tmp_path, command):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    d = tmp_path / "hf"
    d.mkdir()
    os.mkfifo(d / "config.json")
    for target in (fifo, d):
        argv = [sys.executable, "-m", "realizar", command[0], "-m", str(target), *command[1:]] if command[0] != "info" \
            else [sys.executable, "-m", "realizar", "info", str(target)]
        t0 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert time.monotonic() - t0 < 30
        assert r.returncode != 0 and "not a regular file" in r.stderr, r.stderr
        assert r.stderr.strip().count("\n") == 0, r.stderr


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": None}),
                                        ("/v1/chat/completions", {"messages": None}),
                                        ("/tokenize", {"prompt": None})])
def test_deeply_nested_json_over_32_kb_is_a_400(live, path, extra):
    depth = 40_000
    key = next(iter(extra))
    body = ('{"model": "%s", "%s": ' % (live.engine.name, key)) + "[" * depth + "1" + "]" * depth + "}"
    assert len(body) > 32 * 1024
    r = httpx.post(live.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_non_string_tool_choice_name_is_a_400(live):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    for name in (["get_time"], {"n": 1}, 7, None):
        body = {"model": live.engine.name, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
                "tool_choice": {"type": "function", "function": {"name": name}}, "max_tokens": 2}
        r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, (name, r.status_code, r.text[:200])
        assert r.json()["error"]["param"] == "tool_choice"


def test_the_listening_socket_is_tcp_and_keep_alive_is_not_delayed(live):
    s = bind_socket("127.0.0.1", 0)
    try:
        assert s.proto == socket.IPPROTO_TCP
    finally:
        s.close()
    with httpx.Client() as client:  # one keep-alive connection
        client.get(live.url + "/health", timeout=10)
        times = []
        for _ in range(12):
            t0 = time.perf_counter()
            assert client.get(live.url + "/health", timeout=10).status_code == 200
            times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 0.030, times  # (Nagle + delayed ACK held each one ~40 ms)


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "prompt", [True, False]), ("/v1/completions", "max_tokens", "5"),
    ("/v1/completions", "stream", "yes"), ("/v1/completions", "temperature", "0.5"),
    ("/v1/chat/completions", "max_tokens", "5"), ("/v1/chat/completions", "n", True),
    ("/tokenize", "add_special", "yes"), ("/detokenize", "tokens", [True, 3]),
])
def test_loose_types_are_refused_not_coerced(live, path, field, value):
    body = {"model": live.engine.name}
    body.update({"/v1/completions": {"prompt": "hi", "max_tokens": 2}, "/tokenize": {"prompt": "hi"},
                 "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                 "/detokenize": {"tokens": [1]}}[path])
    body[field] = value
    r = httpx.post(live.url + path, json=body, timeout=30)
    assert r.status_code == 400, (field, value, r.status_code, r.text[:200])
    assert field in r.text


def test_no_schema_page_without_the_key(live):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(live.url + path, timeout=10).status_code == 404


def test_health_counts_requests_the_engine_has_not_picked_up(tmp_path_factory):
    """While a long step runs, requests submitted meanwhile are in the queue /health reports (they were
    counted only once the engine took them at its next step)."""
    import threading

    from realizar.engine import load_engine
    from tests.test_server import throttled_serving

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    srv = LiveServer(engine, serving=throttled_serving(engine, max_batch=1)).start()
    body = {"model": engine.name, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    try:
        srv.backend.delay = 1.5  # every forward call: a long step
        threads = [threading.Thread(target=lambda: httpx.post(srv.url + "/v1/completions", json=body, timeout=120))
                   for _ in range(4)]
        threads[0].start()
        deadline = time.monotonic() + 10
        while srv.backend.prefills == 0 and time.monotonic() < deadline:  # the first one is in its step
            time.sleep(0.01)
        time.sleep(0.1)
        for t in threads[1:]:
            t.start()
        time.sleep(0.3)  # the three are submitted; the step of the first still runs
        h = httpx.get(srv.url + "/health", timeout=5).json()
        assert h["queue_depth"] == 3 and h["busy"] is True, h
    finally:
        srv.backend.delay = 0.0
        for t in threads:
            if t.is_alive():
                t.join(120)
        srv.stop()


def test_every_error_names_a_code_and_null_text_parts_say_so(live):
    """Issue 40, item 12: 400s carried ``code: null``; a ``text: null`` part got a misleading message."""
    name = live.engine.name
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": name, "messages": [
        {"role": "user", "content": [{"type": "text", "text": None}]}]}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_value" and "has no text" in err["message"]
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": name, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] is not None
    from realizar.server.protocol import ServerError

    for status in (400, 404, 413, 429, 500, 503):
        assert ServerError(status, "x").code is not None


def test_a_model_that_computes_nan_is_named_in_the_error(tmp_path_factory):
    """Issue 40, item 12: NaN logits are the model's failure, not a bad request: the CLI prints one line naming
    the file (no traceback), the server answers a 500 ``model_error`` naming it (streaming: the error event,
    then [DONE]) and stays up."""
    import numpy as np

    from realizar.engine import load_engine
    from realizar.models.loader import load_model
    from tests.gguf_factory import rewrite_gguf

    src = _tiny_gguf(tmp_path_factory)
    norm = load_model(src).tensors["output_norm.weight"].dequantize().astype(np.float32)
    bad = rewrite_gguf(src, tmp_path_factory.mktemp("nan") / "nan.gguf",
                       replace_tensors={"output_norm.weight": (np.full_like(norm, np.nan), None)})
    r = subprocess.run([sys.executable, "-m", "realizar", "generate", "-m", str(bad), "--device", "cpu", "-n", "3",
                        "hi"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and str(bad) in r.stderr and "NaN" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr
    engine = load_engine(str(bad), device="cpu")
    srv = LiveServer(engine).start()
    try:
        body = {"model": engine.name, "prompt": "hi", "max_tokens": 3}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "model_error" and str(bad) in err["message"] and "NaN" in err["message"], err
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and '"model_error"' in lines[-2], lines[-3:]
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    finally:
        srv.stop()

