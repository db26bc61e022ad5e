"""The chat page over plain HTTP (issue 39, item 4; the page in a real browser: tests/test_chat_page.py): ``GET /``
answers the page with the element ids its script and the browser test use, every file it links is served with
its content type and the page's security headers, the page is public on a server with an API key while the API
stays guarded, ``serve --no-chat-page`` (or ``REALIZAR_CHAT_PAGE=0``) leaves it out, and the wheel ships it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from realizar.engine import load_engine  # noqa: E402
from tests.gguf_factory import shared_tiny_gguf  # noqa: E402
from tests.test_server import LiveServer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "realizar" / "server" / "static"
KEY = "sk-page-test"
IDS = ("messages", "prompt", "send", "stop", "new-chat", "model", "system", "temperature", "top-p", "max-tokens",
       "api-key", "tps", "error")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A server with an API key and the page, and one without the page."""
    path = str(shared_tiny_gguf(tmp_path_factory))
    keyed = LiveServer(load_engine(path, device="cpu"), api_key=KEY).start()
    bare = LiveServer(load_engine(path, device="cpu"), chat_page=False).start()
    yield keyed, bare
    keyed.stop()
    bare.stop()


def _linked(html: str) -> list[str]:
    """The files the page loads (its script and style sheet links, relative to ``/``)."""
    return re.findall(r'<(?:script|link)\b[^>]*\b(?:src|href)="(static/[^"]+)"', html)


def test_the_page_is_served_at_the_root_without_the_api_key(servers):
    keyed, _ = servers
    r = httpx.get(keyed.url + "/", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    for element in IDS:
        assert f'id="{element}"' in r.text, element
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "unsafe-inline" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    # the API it calls still needs the key
    assert httpx.get(keyed.url + "/v1/models", timeout=10).status_code == 401
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == keyed.engine.name


def test_every_linked_file_is_served_with_its_type(servers):
    keyed, _ = servers
    linked = _linked(httpx.get(keyed.url + "/", timeout=10).text)
    assert sorted(linked) == ["static/chat.css", "static/chat.js", "static/markdown.js"]
    types = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
    for link in linked:
        r = httpx.get(f"{keyed.url}/{link}", timeout=10)  # (no API key)
        assert r.status_code == 200, link
        assert r.headers["content-type"] == types[Path(link).suffix], link
        assert r.content == (STATIC / Path(link).name).read_bytes()
        assert r.headers["x-content-type-options"] == "nosniff"
    head = httpx.head(keyed.url + "/static/chat.js", timeout=10)
    assert head.status_code == 200 and head.content == b""


@pytest.mark.parametrize("path", ["/static/nothing.js", "/static/index.html", "/static/..%2Fauth.py",
                                  "/static/routes/page.py", "/static/"])
def test_nothing_else_is_served_from_static(servers, path):
    keyed, _ = servers
    r = httpx.get(keyed.url + path, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path


def test_requests_for_the_page_are_counted_under_few_labels(servers):
    keyed, _ = servers
    httpx.get(keyed.url + "/", timeout=10)
    httpx.get(keyed.url + "/static/chat.js", timeout=10)
    text = httpx.get(keyed.url + "/metrics", timeout=10).text
    assert 'realizar_requests_total{endpoint="/",status="200"}' in text
    assert 'realizar_requests_total{endpoint="/static",status="200"}' in text
    assert 'endpoint="/static/chat.js"' not in text


def test_no_chat_page_leaves_it_out(servers):
    _, bare = servers
    for path in ("/", "/static/chat.js"):
        r = httpx.get(bare.url + path, timeout=10)
        assert r.status_code == 404 and "error" in r.json(), path
    assert httpx.get(bare.url + "/health", timeout=10).status_code == 200


def test_serve_flag_and_environment_reach_the_app(monkeypatch):
    from realizar.cli import build_parser

    assert build_parser().parse_args(["serve"]).chat_page is True
    assert build_parser().parse_args(["serve", "--no-chat-page"]).chat_page is False
    monkeypatch.setenv("REALIZAR_CHAT_PAGE", "0")
    assert build_parser().parse_args(["serve"]).chat_page is False
    assert build_parser().parse_args(["serve", "--chat-page"]).chat_page is True

    from tests.server_helpers import app_options

    for value in (True, False):
        assert app_options(monkeypatch, object(), "127.0.0.1", 0, chat_page=value)["chat_page"] is value


def test_the_wheel_ships_the_page():
    """setuptools' package data names every file of the page's folder (a wheel without them serves no page)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["realizar.server"]
    shipped = {p.name for pattern in patterns for p in (ROOT / "realizar" / "server").glob(pattern)}
    assert shipped == {p.name for p in STATIC.iterdir() if p.is_file()}
    assert {"index.html", "chat.js", "chat.css", "markdown.js"} <= shipped
