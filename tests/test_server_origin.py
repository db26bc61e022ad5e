"""Cross-site and DNS-rebinding requests (issue 40, item 10), each a case that ran a generation before: a request
from another site's page (any Origin but the server's own) is refused with 403 unless allowed, and no CORS
header is sent by default; allowed origins get CORS (preflight and Access-Control-Allow-Origin); listening on
loopback without an API key, a request addressed to another Host is refused; API clients (no Origin) and
same-origin pages pass; ``serve`` turns the checks on and ``--allowed-origins`` reaches them."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from realizar.engine import load_engine  # noqa: E402
from tests.gguf_factory import shared_tiny_gguf  # noqa: E402
from tests.test_server import LiveServer  # noqa: E402


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = str(shared_tiny_gguf(tmp_path_factory))
    plain = LiveServer(load_engine(path, device="cpu"), loopback_hosts=True).start()
    cors = LiveServer(load_engine(path, device="cpu"), allowed_origins=["https://app.example"]).start()
    yield plain, cors
    plain.stop()
    cors.stop()


def _completion(url, name, **headers):
    return httpx.post(url + "/v1/completions", content=b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % name.encode(),
                      headers={"Content-Type": "text/plain", **headers}, timeout=30)


def test_a_foreign_origin_is_refused_and_no_cors_by_default(servers):
    plain, _ = servers
    name = plain.engine.name
    r = _completion(plain.url, name, Origin="https://evil.example")
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert _completion(plain.url, name).status_code == 200  # an API client: no Origin
    same = f"http://127.0.0.1:{plain.port}"
    r = _completion(plain.url, name, Origin=same)  # a page of the server itself
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(plain.url + "/v1/completions", headers={"Origin": "https://evil.example",
                                                              "Access-Control-Request-Method": "POST"}, timeout=10)
    assert r.status_code == 403


def test_rebound_host_names_are_refused_on_loopback(servers):
    plain, cors = servers
    r = httpx.get(plain.url + "/health", headers={"Host": "evil.example"}, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{plain.port}", f"127.0.0.1:{plain.port}", f"[::1]:{plain.port}", "LOCALHOST"):
        assert httpx.get(plain.url + "/health", headers={"Host": host}, timeout=10).status_code == 200, host
    assert httpx.get(cors.url + "/health", headers={"Host": "replica.svc"}, timeout=10).status_code == 200


def test_allowed_origins_get_cors(servers):
    _, cors = servers
    r = httpx.options(cors.url + "/v1/completions", headers={"Origin": "https://app.example",
                                                             "Access-Control-Request-Method": "POST"}, timeout=10)
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in r.headers["access-control-allow-methods"]
    r = _completion(cors.url, cors.engine.name, Origin="https://app.example")
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    assert _completion(cors.url, cors.engine.name, Origin="https://other.example").status_code == 403


def test_serve_turns_the_checks_on(monkeypatch):
    from realizar.cli import build_parser
    from tests.server_helpers import app_options

    for host, key, want in (("127.0.0.1", None, True), ("0.0.0.0", None, False), ("127.0.0.1", "k", False)):
        seen = app_options(monkeypatch, object(), host, 0, api_key=key, allowed_origins=["https://a.example"])
        assert seen["loopback_hosts"] is want and seen["allowed_origins"] == ["https://a.example"]
    args = build_parser().parse_args(["serve", "--allowed-origins", "https://a.example", "https://b.example"])
    assert args.allowed_origins == ["https://a.example", "https://b.example"]
    assert build_parser().parse_args(["serve"]).allowed_origins == []
