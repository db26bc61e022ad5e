"""The served model's id and aliases: ``--served-model-name ID ALIAS ...`` (or ``create_app(model_name=[...])``):
requests under any of them are answered, ``/v1/models`` lists each, and any other name gets an OpenAI-style
404 that names the served ones."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from realizar.cli import build_parser  # noqa: E402
from tests.test_server import LiveServer, _tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from realizar.engine import load_engine

    engine = load_engine(str(_tiny_gguf(tmp_path_factory)), device="cpu")
    srv = LiveServer(engine, model_name=["team/tiny", "tiny", "tiny-latest"]).start()
    yield srv
    srv.stop()


def test_each_name_is_served_and_listed(live):
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
    for name in ("team/tiny", "tiny", "tiny-latest"):
        r = httpx.post(live.url + "/v1/completions", json={**body, "model": name}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "team/tiny"  # (responses name the model's id)
        card = httpx.get(f"{live.url}/v1/models/{name}", timeout=10).json()
        assert card["id"] == name
    data = httpx.get(live.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == ["team/tiny", "tiny", "tiny-latest"]
    assert [m.get("root") for m in data] == [None, "team/tiny", "team/tiny"]


def test_another_name_is_a_404_naming_the_served_ones(live):
    r = httpx.post(live.url + "/v1/completions", json={"model": "gpt-4", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'team/tiny', 'tiny', 'tiny-latest'" in err["message"]


def test_served_model_name_takes_several():
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.model_name == ["a", "b"]
    assert build_parser().parse_args(["serve", "--model-id", "a"]).model_name == ["a"]


def test_the_default_id_is_the_file_name_not_general_name(tmp_path_factory):
    """Issue 39, item 2: without --served-model-name the id is the file's name (a directory's for safetensors):
    what the user named and typed, not the GGUF's general.name (for the default model a training run's label);
    whitespace becomes '-'."""
    from realizar.engine import load_engine, load_front
    from tests.gguf_factory import rewrite_gguf

    src = _tiny_gguf(tmp_path_factory)
    path = rewrite_gguf(src, tmp_path_factory.mktemp("names") / "My Model.Q8_0.gguf",
                        set_metadata={"general.name": "Some-Run-8k-Lc100K-Mix1-Ep2"})
    engine = load_engine(str(path), device="cpu")
    assert engine.name == load_front(str(path)).name == "My-Model.Q8_0"
    srv = LiveServer(engine).start()
    try:
        assert [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]] == ["My-Model.Q8_0"]
    finally:
        srv.stop()
