"""The request body limit (413 before the body is read whole) and an event loop that keeps answering
while large bodies arrive, over real HTTP against a live server (tests/test_server.py's LiveServer)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from realizar.engine import load_engine  # noqa: E402
from realizar.server.limits import DEFAULT_MAX_BODY, BodyLimitMiddleware  # noqa: E402
from tests.test_server import LiveServer, _metrics, _sample, _tiny_gguf, serve_tiny  # noqa: E402

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    yield from serve_tiny(tmp_path_factory, max_body=LIMIT)


def _read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        part = sock.recv(65536)
        if not part:
            break
        rest += part
    return head + b"\r\n\r\n" + rest


def _assert_413(raw: bytes) -> None:
    import json

    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    err = json.loads(body)["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert str(LIMIT) in err["message"]


def test_default_limit_is_4_mib():
    assert DEFAULT_MAX_BODY == 4 * 1024 * 1024
    with pytest.raises(ValueError, match="positive"):
        BodyLimitMiddleware(None, max_body=0)


def test_declared_length_over_the_limit_is_refused_before_any_body_byte(live):
    """Only the headers are sent (a Content-Length of 1 GB): the 413 comes back without the server
    waiting for a single byte of the body."""
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")  # fmt: skip
        t0 = time.perf_counter()
        raw = _read_response(s)
        assert time.perf_counter() - t0 < 5
    _assert_413(raw)


def test_chunked_body_is_counted_and_refused_as_it_streams_in(live):
    """No Content-Length: the body comes in chunks; the 413 arrives once the limit is passed, while
    the client still has most of its body unsent."""
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        chunk = b"x" * 16384
        sent = 0
        s.settimeout(10)
        raw = b""
        for _ in range(64):  # up to 1 MiB, 16x the limit
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the server closed the connection after its answer
                break
            sent += len(chunk)
            s.setblocking(False)
            try:
                raw = s.recv(65536)
            except BlockingIOError:
                raw = b""
            s.setblocking(True)
            if raw:
                break
            time.sleep(0.01)
        s.settimeout(10)
        if not raw.endswith(b"}"):
            raw += _read_response(s) if not raw else s.recv(65536)
    _assert_413(raw)
    assert sent < 16 * LIMIT


def test_413_through_an_http_client_and_counted(live):
    before = _sample(_metrics(live), "realizar_requests", "realizar_requests_total", endpoint="/v1/completions", status="413")
    r = httpx.post(live.url + "/v1/completions", content=b" " * (LIMIT + 1),
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(8):
            yield b" " * (LIMIT // 4)

    r = httpx.post(live.url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    after = _sample(_metrics(live), "realizar_requests", "realizar_requests_total", endpoint="/v1/completions", status="413")
    assert after == before + 1


def test_a_body_at_the_limit_is_served(live):
    """Exactly ``LIMIT`` bytes (a valid request padded with spaces) passes, by declared length and chunked."""
    import json

    body = json.dumps({"model": live.engine.name, "prompt": "hello", "max_tokens": 2, "temperature": 0}).encode()
    body += b" " * (LIMIT - len(body))
    assert len(body) == LIMIT
    r = httpx.post(live.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(live.url + "/v1/completions", content=iter([body[: LIMIT // 2], body[LIMIT // 2 :]]),
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text


def test_health_answers_promptly_while_large_bodies_arrive(tmp_path_factory):
    """With the default 4 MiB limit: 20 MB bodies (declared and chunked) are refused, and a 4 MB
    body that is parsed and checked (a prompt of a million token ids) is answered, while /health is
    polled and must keep answering within 1 s (before the limit, a 20 MB body held it for 12 s; parsing
    the 4 MB body's JSON holds Python's lock for a few hundred ms on a loaded 2-core machine)."""
    import json

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    srv = LiveServer(engine).start()
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as h:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert h.get(srv.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    try:
        poller.start()
        big = b" " * 20_000_000
        r = httpx.post(srv.url + "/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413

        def chunks():
            for i in range(0, len(big), 1 << 20):
                yield big[i : i + (1 << 20)]

        r = httpx.post(srv.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                       timeout=60)  # fmt: skip
        assert r.status_code == 413
        ids = json.dumps({"model": engine.name, "prompt": [1] * 1_300_000, "max_tokens": 1}).encode()
        assert 3_000_000 < len(ids) <= DEFAULT_MAX_BODY
        r = httpx.post(srv.url + "/v1/completions", content=ids, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        time.sleep(0.05)
    finally:
        stop.set()
        poller.join(timeout=30)
        srv.stop()
    assert len(latencies) >= 3
    assert max(latencies) < 1.0, latencies
