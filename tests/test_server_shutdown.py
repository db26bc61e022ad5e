"""Graceful shutdown of the HTTP server (issue 40, item 3), each a case that cut responses off before: requests in
flight when shutdown starts either finish or end with a 503 ``server_shutting_down`` error (a stream: the error
event, then ``[DONE]``; a whole answer: a JSON 503), never a bare cut or a plain-text 500; ``/health`` answers 503
while the server drains; ``realizar serve`` under SIGTERM during 8 streams exits within 10 s with every stream
ended by ``[DONE]`` and no traceback. Loopback only, bounded."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.test_server import LiveServer, _tiny_gguf, throttled_serving  # noqa: E402


def _stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    """POST a streaming completion; ``out`` gets every ``data:`` payload (text), ``started`` is set at the first."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out.append(("status", r.status_code))
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.append(("data", line[6:]))
                    started.set()
    except httpx.HTTPError as e:
        out.append(("cut", repr(e)))
    finally:
        started.set()


def start_long_streams(url: str, n: int) -> tuple[list, list]:
    """``n`` streams of 200 sampled tokens of the tiny model, each on a thread of its own: (their event lists,
    their (thread, started event) pairs)."""
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 200, "temperature": 1.0, "seed": 1}
    streams, threads = [], []
    for _ in range(n):
        out, ev = [], threading.Event()
        t = threading.Thread(target=_stream, args=(url, body, out, ev), daemon=True)
        t.start()
        streams.append(out)
        threads.append((t, ev))
    return streams, threads


def _ended_well(events: list) -> str:
    """'finished' or 'shut down' for a stream that ended as it should; raises otherwise."""
    data = [p for k, p in events if k == "data"]
    assert ("status", 200) in events and not any(k == "cut" for k, _ in events), events[-3:]
    assert data and data[-1] == "[DONE]", data[-3:]
    last = json.loads(data[-2])
    if "error" in last:
        assert last["error"]["code"] == "server_shutting_down" and last["error"]["type"] == "server_error"
        return "shut down"
    assert last["choices"][0]["finish_reason"] in ("stop", "length"), last
    return "finished"


def test_shutdown_ends_streams_and_answers_with_an_error_not_a_cut(tmp_path_factory):
    from realizar.engine import load_engine

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    serving = throttled_serving(engine)
    serving.backend.delay = 0.05  # (a decode step every 50 ms: the generations are still running at shutdown)
    srv = LiveServer(engine, serving=serving, drain_seconds=0.5).start()
    body = {"model": engine.name, "prompt": "The capital of France is", "max_tokens": 150, "temperature": 0}
    streams, threads, whole = [], [], []
    for _ in range(6):
        out, ev = [], threading.Event()
        t = threading.Thread(target=_stream, args=(srv.url, body, out, ev), daemon=True)
        t.start()
        streams.append((out, ev))
        threads.append(t)
    for _ in range(2):
        t = threading.Thread(target=lambda: whole.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=60)),
                             daemon=True)
        t.start()
        threads.append(t)
    for _, ev in streams:
        assert ev.wait(30)
    t0 = time.monotonic()
    srv.server.should_exit = True  # what uvicorn's SIGTERM / SIGINT handler does
    deadline = time.monotonic() + 5
    while not srv.app.state.server.scheduler.draining:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ends = []
    for t in threads:
        t.join(15)
        assert not t.is_alive()
    srv.stop()
    assert time.monotonic() - t0 < 10
    ends = [_ended_well(out) for out, _ in streams]
    assert "shut down" in ends, ends  # (greedy runs 58 steps here: 50 ms each outlast the half-second grace)
    for r in whole:
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "server_shutting_down"
    assert len(whole) == 2


def test_health_is_503_and_new_requests_are_refused_while_draining(tmp_path_factory):
    from realizar.engine import load_engine

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    srv = LiveServer(engine).start()
    try:
        sched = srv.app.state.server.scheduler
        with sched._lock:  # (what drain() does first: admit nothing more)
            sched._closed = sched.draining = True
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503 and r.json()["status"] == "shutting down"
        r = httpx.post(srv.url + "/v1/completions", json={"model": engine.name, "prompt": "hi", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    finally:
        srv.stop()


def test_sigterm_during_eight_streams(tmp_path_factory):
    """The real signal on `realizar serve`: every stream ends with [DONE] (complete, or the shutdown error), the
    process exits within 10 s, no traceback; --shutdown-grace reaches the server."""
    from tests.test_cli import _start_server

    path = _tiny_gguf(tmp_path_factory)
    # one sequence a step and no grace: the streams still waiting at the signal end with the shutdown error
    proc, url = _start_server("-m", str(path), "--model-name", "tiny", "--max-batch", "1", "--shutdown-grace", "0.01")
    try:
        streams, threads = start_long_streams(url, 8)
        deadline = time.monotonic() + 60
        # every request admitted (its 200 sent: a signal before that answers it 503) and some still waiting
        while not (all(any(k == "status" for k, _ in out) for out in streams)
                   and httpx.get(url + "/health", timeout=10).json()["queue_depth"] >= 1):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
        for t, _ in threads:
            t.join(15)
        assert took < 10, took
        assert "Traceback" not in err and "CancelledError" not in err, err[-2000:]
        ends = [_ended_well(out) for out in streams]
        assert "shut down" in ends, ends
    finally:
        if proc.poll() is None:
            proc.kill()
