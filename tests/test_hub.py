"""``--model org/name[:QUANT]``: Hub ids through huggingface_hub's own download and cache code, against a fake Hub
on loopback (``HF_ENDPOINT``) serving two fixture repos, then offline (``HF_HUB_OFFLINE=1``, and with the endpoint
unreachable) against the cache those downloads left. No network."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from realizar.errors import ModelNotFoundError
from realizar.models import hub
from realizar.models.hub import parse_hub_id, resolve_model, served_name
from realizar.models.loader import load_model
from tests.test_cli import assert_clean_error, run

DEAD_ENDPOINT = "http://127.0.0.1:9"  # (discard: nothing listens, a connection is refused at once)


class FakeHub(BaseHTTPRequestHandler):
    """The endpoints huggingface_hub 2.4 calls for model_info, list_repo_tree (snapshot_download),
    hf_hub_download's HEAD and GET: ``repos`` maps a repo id to {file name: bytes}."""

    repos: dict[str, dict[str, bytes]] = {}

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(code)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, obj) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _route(self, head: bool) -> None:
        parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        repo = "/".join(parts[2:4] if api else parts[:2])
        files = self.repos.get(repo)
        if files is None:
            return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)
        sha = hashlib.sha1(repo.encode()).hexdigest()
        rest = parts[4:] if api else parts[2:]
        if api and (not rest or rest[0] == "revision"):  # model_info / repo_info
            siblings = [{"rfilename": f, "size": len(b)} for f, b in sorted(files.items())]
            return self._json({"id": repo, "sha": sha, "siblings": siblings, "private": False})
        if api and rest[0] == "tree":  # list_repo_tree(recursive=True): one page
            return self._json([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                               for f, b in sorted(files.items())])
        if not api and rest[:1] == ["resolve"]:
            body = files.get("/".join(rest[2:]))
            if body is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha}, head)
            etag = hashlib.sha256(body).hexdigest()
            return self._send(200, body, {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}, head)
        self._send(404, b"", {}, head)

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    """The endpoint URL of a fake Hub serving org/tiny-gguf (tiny-Q8_0.gguf, tiny-F16.gguf, README.md) and
    org/tiny-st (a safetensors model with its config, tokenizer and generation config)."""
    from tests.gguf_factory import make_gguf_model
    from tests.model_factory import make_hf_model

    from tests.gguf_factory import rewrite_gguf

    d = tmp_path_factory.mktemp("repos")
    gguf, paths = {}, {}
    for qtype in ("Q8_0", "F16"):
        paths[qtype], _, _ = make_gguf_model("llama", d / qtype, qtype=qtype, seed=0)
        gguf[f"tiny-{qtype}.gguf"] = paths[qtype].read_bytes()
    (d / "split").mkdir()  # the Q8_0 model again, in three parts (gguf-split's naming)
    first = rewrite_gguf(paths["Q8_0"], d / "split" / "tiny-Q8_0.gguf", split_max_tensors=10)
    split = {p.name: p.read_bytes() for p in sorted(first.parent.glob("*.gguf"))}
    st_dir, _ = make_hf_model("llama", d, seed=1, name="tiny-st")
    FakeHub.repos = {
        "org/tiny-gguf": {**gguf, "README.md": b"# tiny\n"},
        "org/tiny-split": {**split, "README.md": b"# split\n"},
        "org/tiny-st": {f.name: f.read_bytes() for f in st_dir.iterdir()},
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


def _hub_env(monkeypatch, endpoint: str, home: Path, offline: bool) -> dict:
    """Point the resolver (which reads the environment at each call) and huggingface_hub (which read
    HF_HUB_OFFLINE at import: its HTTP session checks the constant) at ``endpoint`` and ``home``."""
    from huggingface_hub import constants

    env = {"HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1" if offline else "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for k in ("HF_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(hub, "_resolved", {})
    return env


@pytest.fixture
def online(monkeypatch, fake_hub, hf_home) -> dict:
    return _hub_env(monkeypatch, fake_hub, hf_home, offline=False)


@pytest.fixture(scope="module")
def cached(fake_hub, hf_home) -> Path:
    """The cache after the online resolutions the offline tests read back (org/tiny-gguf's Q8_0 and F16
    files, org/tiny-st's snapshot, org/tiny-split's three parts): what a first online run leaves."""
    with pytest.MonkeyPatch.context() as mp:
        _hub_env(mp, fake_hub, hf_home, offline=False)
        for model in ("org/tiny-gguf:Q8_0", "org/tiny-gguf/tiny-F16.gguf", "org/tiny-st", "org/tiny-split:Q8_0"):
            resolve_model(model)
    return hf_home


@pytest.fixture
def offline(monkeypatch, cached) -> dict:
    return _hub_env(monkeypatch, DEAD_ENDPOINT, cached, offline=True)


def _in_cache(path: Path, home: Path, repo: str) -> None:
    folder = "models--" + repo.replace("/", "--")
    assert path.is_relative_to(home / "hub" / folder / "snapshots"), path


def test_parse_hub_id():
    assert parse_hub_id("org/name") == hub.HubRef("org/name")
    assert parse_hub_id("org/name:Q4_K_M") == hub.HubRef("org/name", quant="Q4_K_M")
    assert parse_hub_id("org/name/sub/x.gguf@v1") == hub.HubRef("org/name", "sub/x.gguf", None, "v1")
    assert str(parse_hub_id("org/name:q8_0@dev")) == "org/name:q8_0@dev"
    for not_id in ("/abs/path", "./rel/x", "name", "org/name/file.bin", "../x/y", "a/b/c"):
        assert parse_hub_id(not_id) is None, not_id


def test_choose_quant_rules(capsys):
    ref = hub.HubRef("o/r")
    files = {"m-Q4_K_S.gguf": 5, "m-Q4_K_M.gguf": 6, "m-Q8_0.gguf": 9, "mmproj-m-f16.gguf": 1,
             "m-Q2_K-00001-of-00002.gguf": 3, "m-Q2_K-00002-of-00002.gguf": 3}
    assert hub._choose(ref, files) == ["m-Q4_K_M.gguf"]
    assert "using m-Q4_K_M.gguf" in capsys.readouterr().err
    assert hub._choose(hub.HubRef("o/r", quant="q4_k_s"), files) == ["m-Q4_K_S.gguf"]
    assert hub._choose(hub.HubRef("o/r", quant="Q5_K_M"), files) is None
    with pytest.raises(ModelNotFoundError, match="2 files match"):
        hub._choose(hub.HubRef("o/r", quant="Q4_K"), files)  # (no whole word: both Q4_K_S and Q4_K_M)
    split = ["m-Q2_K-00001-of-00002.gguf", "m-Q2_K-00002-of-00002.gguf"]
    assert hub._choose(hub.HubRef("o/r", quant="Q2_K"), files) == split  # every part, first to last
    assert hub._choose(hub.HubRef("o/r", filename=split[1]), files) == split
    assert hub._choose(hub.HubRef("o/r", quant="Q2_K"), {split[1]: 3}) is None  # a part missing: no model
    # the smallest model counts all its parts: 3 + 3 > 5
    assert hub._choose(ref, {"b-F16.gguf": 5, **{n.replace("m-Q2_K", "b-Q3"): 3 for n in split}}) == ["b-F16.gguf"]
    assert hub._choose(ref, {"a-F16.gguf": 8, "a-Q6_K.gguf": 4}) == ["a-Q6_K.gguf"]  # neither default: the smallest


def test_gguf_quant_downloads_and_loads(online, hf_home):
    path = resolve_model("org/tiny-gguf:Q8_0")
    assert path.name == "tiny-Q8_0.gguf"
    _in_cache(path, hf_home, "org/tiny-gguf")
    assert load_model(path).config.num_layers > 0
    assert served_name(path) == "tiny-Q8_0"


def test_a_split_gguf_downloads_every_part_and_loads(online, hf_home, monkeypatch, tmp_path_factory):
    path = resolve_model("org/tiny-split:Q8_0")
    assert path.name == "tiny-Q8_0-00001-of-00003.gguf"
    assert sorted(p.name for p in path.parent.glob("*.gguf")) == [f"tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    whole, one = load_model(path), load_model(resolve_model("org/tiny-gguf:Q8_0"))
    assert whole.config == one.config and sorted(whole.tensors) == sorted(one.tensors)
    assert served_name(path) == "tiny-Q8_0"


def test_gguf_file_name_and_default(online, hf_home, capsys):
    assert resolve_model("org/tiny-gguf/tiny-F16.gguf").name == "tiny-F16.gguf"
    assert resolve_model("org/tiny-gguf").name == "tiny-Q8_0.gguf"  # Q8_0 is the default once Q4_K_M is absent
    assert "org/tiny-gguf: using tiny-Q8_0.gguf" in capsys.readouterr().err


def test_safetensors_repo_downloads_and_loads(online, hf_home):
    path = resolve_model("org/tiny-st")
    _in_cache(path, hf_home, "org/tiny-st")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    assert load_model(path).format == "safetensors"
    assert served_name(path) == "tiny-st"


def test_online_errors(online):
    with pytest.raises(ModelNotFoundError, match=r"^no model org/missing on http://127\.0\.0\.1:\d+$"):
        resolve_model("org/missing")
    with pytest.raises(ModelNotFoundError, match="no Q4_K_M GGUF file; its GGUF files: tiny-F16.gguf, tiny-Q8_0.gguf"):
        resolve_model("org/tiny-gguf:Q4_K_M")
    with pytest.raises(ModelNotFoundError, match="no model at"):
        resolve_model("/no/such/model.gguf")


@pytest.mark.parametrize("model, name", [("org/tiny-gguf:Q8_0", "tiny-Q8_0.gguf"),
                                         ("org/tiny-gguf/tiny-F16.gguf", "tiny-F16.gguf"),
                                         ("org/tiny-gguf", "tiny-Q8_0.gguf"),
                                         ("org/tiny-split:Q8_0", "tiny-Q8_0-00001-of-00003.gguf"),
                                         ("org/tiny-st", "snapshots")])
def test_offline_from_cache(offline, cached, model, name):
    path = resolve_model(model)
    _in_cache(path, cached, model.split(":")[0].removesuffix("/tiny-F16.gguf"))
    assert name in (path.name, path.parent.name)
    load_model(path)


def test_unreachable_endpoint_falls_back_to_cache(monkeypatch, cached):
    _hub_env(monkeypatch, DEAD_ENDPOINT, cached, offline=False)
    assert resolve_model("org/tiny-gguf:Q8_0").name == "tiny-Q8_0.gguf"
    with pytest.raises(ModelNotFoundError, match=r"^org/other: not in the Hugging Face cache and cannot reach "
                                                 r"http://127\.0\.0\.1:9: "):
        resolve_model("org/other")


def test_offline_errors(offline):
    with pytest.raises(ModelNotFoundError, match=r"^org/tiny-gguf:Q4_K_M: not in the Hugging Face cache and "
                                                 r"HF_HUB_OFFLINE=1 is set \(cached: tiny-F16.gguf, tiny-Q8_0.gguf\)$"):
        resolve_model("org/tiny-gguf:Q4_K_M")
    with pytest.raises(ModelNotFoundError, match="^org/missing: not in the Hugging Face cache and HF_HUB_OFFLINE=1"):
        resolve_model("org/missing")


def test_cli_generate_online_then_offline(fake_hub, tmp_path):
    """The CLI end to end in a fresh HF_HOME: downloads, then the same id offline from that cache."""
    env = {"HF_ENDPOINT": fake_hub, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}
    args = ("generate", "-m", "org/tiny-gguf:Q8_0", "hi", "-n", "2", "--device", "cpu")
    p = run(*args, env=env)
    assert p.returncode == 0, p.stderr
    assert list((tmp_path / "hub" / "models--org--tiny-gguf").rglob("tiny-Q8_0.gguf"))
    p = run(*args, env={**env, "HF_ENDPOINT": DEAD_ENDPOINT, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0, p.stderr
    assert_clean_error(run("generate", "-m", "org/tiny-gguf:Q4_K_M", "hi", "-n", "1", "--device", "cpu",
                           env={**env, "HF_HUB_OFFLINE": "1"}),
                       match="org/tiny-gguf:Q4_K_M: not in the Hugging Face cache and HF_HUB_OFFLINE=1 is set")


def test_cli_serve_fails_before_starting(fake_hub, tmp_path):
    env = {"HF_ENDPOINT": fake_hub, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "0"}
    p = run("serve", "-m", "org/missing", "--port", "0", env=env, timeout=60)
    assert_clean_error(p, match=r"no model org/missing on http://127\.0\.0\.1:\d+$")
