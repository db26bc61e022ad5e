"""CLI pieces of the OpenAI-API work: ``serve --api-key`` / ``REALIZAR_API_KEY`` and ``--model-id``,
``info`` without a model, ``--seed`` checked by name, model ids without spaces."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from realizar.engine import model_id
from tests.test_cli import ROOT, assert_clean_error, run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.gguf_factory import shared_tiny_gguf

    return shared_tiny_gguf(tmp_path_factory)


def test_negative_seed_names_the_option(tiny):
    p = run("generate", "-m", str(tiny), "--seed", "-5", "hi")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == "realizar generate: error: argument --seed: expected an integer >= 0, got -5"


def test_info_without_a_model_describes_the_default_one(tiny, monkeypatch, capsys):
    from realizar import default_model
    from realizar.cli import main

    monkeypatch.setattr(default_model, "default_model_path", lambda: tiny)
    assert main(["info", "--json"]) == 0
    out = capsys.readouterr().out
    assert f'"path": "{tiny}"' in out and '"architecture": "llama"' in out


@pytest.mark.parametrize("name,want", [("SmolLM2 135M Instruct", "SmolLM2-135M-Instruct"),
                                       ("  a \t b\n", "a-b"), ("plain", "plain"), ("   ", "model")])  # fmt: skip
def test_model_id_has_no_spaces(name, want):
    assert model_id(name) == want


def test_serve_api_key_from_env_and_model_id(tiny):
    httpx = pytest.importorskip("httpx")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REALIZAR_API_KEY": "k-123"}
    proc = subprocess.Popen([sys.executable, "-m", "realizar", "serve", "-m", str(tiny), "--port", "0",
                             "--log-level", "warning", "--model-id", "my-model"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)  # fmt: skip
    try:
        url, deadline = None, time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            m = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            url = m.group(1) if m else None
        assert url, "the server did not start"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        ok = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k-123"}, timeout=10)
        assert [m["id"] for m in ok.json()["data"]] == ["my-model"]
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0


def test_serve_refuses_an_empty_api_key(tiny):
    assert_clean_error(run("serve", "-m", str(tiny), "--port", "0", "--api-key", " "), match="--api-key")
