"""The HTTP server's connection limits (``realizar.server.connections``), each a case that held the server before:
thousands of idle connections no longer keep ``/health`` from answering (the oldest idle one makes room) and the
log stays small; a request whose headers trickle in, a body shorter than its Content-Length and a kept-alive
connection that starts a request and stalls are closed after their timeouts; when every connection is busy a new
one gets a 503 at once; the serve command's flags reach the limits. Loopback only, bounded."""

from __future__ import annotations

import logging
import resource
import socket
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from realizar.server.connections import ConnectionLimits  # noqa: E402
from tests.test_server import LiveServer, _tiny_gguf  # noqa: E402

IDLE = 2000


def _server(tmp_path_factory, **limits):
    from realizar.engine import load_engine

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    return LiveServer(engine, limits=ConnectionLimits(**limits)).start()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (whatever it answered first)."""
    sock.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


@pytest.fixture
def fds():
    """Room for the test's idle sockets and the server's side of them (the test raises its own limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * IDLE + 512
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) is below the {need} file descriptors this test holds")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_idle_connections_do_not_lock_out_health(tmp_path_factory, fds, caplog):
    srv = _server(tmp_path_factory, max_connections=256, header_timeout=60)
    socks = []
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(IDLE):
                socks.append(socket.create_connection(("127.0.0.1", srv.port)))
            guard = srv.server.config.http.guard
            deadline = time.monotonic() + 60
            while guard.accepted < IDLE:  # (the server has taken every idle connection off its accept queue)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            t0 = time.monotonic()
            r = httpx.get(srv.url + "/health", timeout=5)
            took = time.monotonic() - t0
            assert r.status_code == 200 and took < 1.0, (r.status_code, took)
            assert len(guard.live) <= 256
            closed = sum(_closed_within(s, 0.01) for s in socks[:IDLE - 300])
            assert closed >= IDLE - 300 - 5  # the oldest idle ones made room
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert len(text) < 1 << 20 and "Traceback" not in text
        limit_lines = [r for r in caplog.records if "connection limits" in r.getMessage()]
        assert 1 <= len(limit_lines) <= 3, len(limit_lines)  # (once per interval, with counts)
    finally:
        for s in socks:
            s.close()
        srv.stop()


def test_slow_headers_and_bodies_are_cut_off(tmp_path_factory):
    srv = _server(tmp_path_factory, header_timeout=1.0, body_timeout=1.0)
    try:
        # headers trickling in, a byte at a time
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        cut = False
        while time.monotonic() - t0 < 5:
            try:
                s.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            if _closed_within(s, 0.25):
                cut = True
                break
        assert cut and time.monotonic() - t0 < 3, "a trickled header was not cut off"
        s.close()
        # a body shorter than its Content-Length
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.monotonic()
        assert _closed_within(s, 4) and time.monotonic() - t0 < 3
        s.close()
        # a kept-alive connection: one answered request, then the next one's headers stall
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /health HTTP/1.1\r\n")
        t0 = time.monotonic()
        assert _closed_within(s, 4) and time.monotonic() - t0 < 3
        s.close()
        # a healthy connection is unaffected
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    finally:
        srv.stop()


def test_a_pipelined_request_is_not_cut_off_by_the_header_timeout(tmp_path_factory):
    """Two streamed completions sent back to back on one connection (pipelined), each taking longer than the
    header timeout: the second's headers had arrived with the first, so neither is cut off."""
    from realizar.engine import load_engine
    from tests.test_server import throttled_serving

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    srv = LiveServer(engine, limits=ConnectionLimits(header_timeout=0.25), serving=throttled_serving(engine)).start()
    try:
        srv.backend.delay = 0.3  # (every forward call takes longer than the header timeout)
        name = httpx.get(srv.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = (b'{"model": "' + name.encode() + b'", "prompt": "The capital of France is", "max_tokens": 3, '
                b'"temperature": 0, "stream": true}')
        one = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(one + one)
        s.settimeout(15)
        got, t0 = b"", time.monotonic()
        while got.count(b"data: [DONE]") < 2 and time.monotonic() - t0 < 15:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        s.close()
        assert got.count(b"HTTP/1.1 200") == 2 and got.count(b"data: [DONE]") == 2, got[-400:]
    finally:
        srv.stop()


def test_a_new_connection_gets_a_503_when_every_one_is_busy(tmp_path_factory):
    srv = _server(tmp_path_factory, max_connections=4, body_timeout=30)
    busy = []
    try:
        for _ in range(4):  # each in a request: headers in, body still coming
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{")
            busy.append(s)
        time.sleep(0.3)
        t0 = time.monotonic()
        r = httpx.get(srv.url + "/health", timeout=5)
        assert r.status_code == 503 and time.monotonic() - t0 < 1
        err = r.json()["error"]
        assert err["code"] == "too_many_connections" and err["type"] == "server_error"
        busy.pop().close()
        deadline = time.monotonic() + 5
        while httpx.get(srv.url + "/health", timeout=5).status_code != 200:  # room again once one ends
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        for s in busy:
            s.close()
        srv.stop()


def test_serve_flags_make_the_limits():
    from realizar.cli import build_parser
    from realizar.cli.serve import connection_limits

    args = build_parser().parse_args(["serve", "--max-connections", "64", "--header-timeout", "2.5",
                                      "--body-timeout", "7"])
    assert connection_limits(args) == ConnectionLimits(64, 2.5, 7.0)
    assert connection_limits(build_parser().parse_args(["serve"])) == ConnectionLimits()
    for bad in (["--max-connections", "0"], ["--header-timeout", "0"], ["--body-timeout", "nan"],
                ["--body-timeout", "inf"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionLimits(max_connections=0)


def test_the_descriptor_limit_fits_the_connections(monkeypatch):
    from realizar.server import connections

    calls = []
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 1500))
    monkeypatch.setattr(resource, "setrlimit", lambda what, lim: calls.append(lim))
    assert connections.fit_fd_limit(ConnectionLimits(max_connections=512)) == ConnectionLimits(max_connections=512)
    assert calls == []  # (512 + the reserve fit in 1024 already)
    got = connections.fit_fd_limit(ConnectionLimits(max_connections=4096))
    assert calls == [(1500, 1500)] and got.max_connections == 1500 - connections.FD_RESERVE
    calls.clear()
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, resource.RLIM_INFINITY))
    assert connections.fit_fd_limit(ConnectionLimits(max_connections=4096)).max_connections == 4096
    assert calls == [(4096 + connections.FD_RESERVE, resource.RLIM_INFINITY)]
