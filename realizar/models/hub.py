"""``--model`` as a Hugging Face Hub id, through :mod:`huggingface_hub` and its cache.

:func:`resolve_model` is the one place a model argument becomes a local path: ``None`` is the default model, an
existing path is itself, and ``org/name`` (``org/name:QUANT``, ``org/name/file.gguf``, each optionally
``@revision``) is a Hub repo. A repo with GGUF files gives one of its models (the file named, the one whose name
holds QUANT, else Q4_K_M, then Q8_0, else the smallest), downloaded with ``hf_hub_download``: one file, or every
part of a model split into ``-0000K-of-0000N.gguf`` files (the path of the first); a safetensors repo gives
its snapshot directory (config, tokenizer, generation config, weights and their index), with
``snapshot_download``. Files land in the Hugging Face cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``); with
``HF_HUB_OFFLINE=1``, or when ``HF_ENDPOINT`` cannot be reached, the cache alone answers. What cannot be had is
one :class:`~realizar.errors.ModelNotFoundError` line.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from realizar.errors import ModelNotFoundError
from realizar.models.gguf_split import SPLIT_SUFFIX, unsplit_stem

__all__ = ["HubRef", "parse_hub_id", "resolve_model", "served_name", "DEFAULT_QUANTS", "SAFETENSORS_PATTERNS"]

_NAME = r"[A-Za-z0-9][\w.-]*"
_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?P<file>/[^:@]+\.gguf)?(?::(?P<quant>[\w.-]+))?(?:@(?P<rev>[\w./-]+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # with no :QUANT, the first of these a repo has; else its smallest GGUF
SAFETENSORS_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                        "special_tokens_map.json", "tokenizer.model", "*.jinja", "*.safetensors",
                        "model.safetensors.index.json"]


@dataclass(frozen=True)
class HubRef:
    """A parsed Hub id: the repo, and a GGUF file name or a quant within it, at a revision."""

    repo: str
    filename: str | None = None
    quant: str | None = None
    revision: str = "main"

    def __str__(self) -> str:
        return (self.repo + (f"/{self.filename}" if self.filename else "") + (f":{self.quant}" if self.quant else "")
                + (f"@{self.revision}" if self.revision != "main" else ""))


def parse_hub_id(text: str) -> HubRef | None:
    """``org/name[/file.gguf][:QUANT][@revision]`` as a :class:`HubRef`; None when ``text`` is not of that form."""
    m = _ID.fullmatch(text)
    if m is None or ".." in m["repo"]:
        return None
    return HubRef(m["repo"], m["file"][1:] if m["file"] else None, m["quant"], m["rev"] or "main")


def _settings() -> tuple[str, str, bool]:
    """(endpoint, cache directory, offline) from the environment now (huggingface_hub reads them at import)."""
    from huggingface_hub import constants

    env = os.environ
    endpoint = (env.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    home = env.get("HF_HOME")
    cache = env.get("HF_HUB_CACHE") or (os.path.join(home, "hub") if home else constants.HF_HUB_CACHE)
    flag = env.get("HF_HUB_OFFLINE")
    offline = flag.strip().upper() in ("1", "ON", "YES", "TRUE") if flag is not None else constants.HF_HUB_OFFLINE
    return endpoint, os.path.expanduser(os.path.expandvars(cache)), offline


_resolved: dict[tuple, Path] = {}  # (ref, endpoint, cache, offline) -> path: resolved once a process


def resolve_model(model: str | os.PathLike | None) -> Path:
    """The local path of a model argument (see the module's text): the default model for None, a path that
    exists, else a Hub id downloaded into (or found in) the Hugging Face cache."""
    if model is None:
        from realizar.default_model import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    ref = None if path.exists() else parse_hub_id(str(model))
    if ref is None:
        if not path.exists():
            raise ModelNotFoundError(f"no model at {path}")
        return path
    key = (ref, *_settings())
    if key not in _resolved:
        _resolved[key] = _resolve(*key)
    return _resolved[key]


def served_name(path: Path) -> str:
    """The name a model is known by: a file's stem, a directory's name, the repo's name for a snapshot
    directory of the Hugging Face cache (``models--org--name/snapshots/<commit>``)."""
    if path.is_dir() and path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--", 2)[-1]
    if path.is_file():
        return unsplit_stem(path.name) if path.suffix == ".gguf" else path.stem
    return path.name


def _resolve(ref: HubRef, endpoint: str, cache: str, offline: bool) -> Path:
    import httpx2
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if offline:
        return _from_cache(ref, cache, "HF_HUB_OFFLINE=1 is set")
    try:
        info = HfApi(endpoint=endpoint).model_info(ref.repo, revision=ref.revision, files_metadata=True)
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or ()}
        ggufs = {f: n for f, n in sizes.items() if f.endswith(".gguf")}
        common = {"revision": ref.revision, "endpoint": endpoint, "cache_dir": cache}
        if ggufs or ref.filename or ref.quant:
            files = _choose(ref, ggufs)
            if files is None:
                what = f"file {ref.filename}" if ref.filename else f"{ref.quant} GGUF file"
                raise ModelNotFoundError(f"{ref.repo} on {endpoint} has no {what}; its GGUF files: {_listing(ggufs)}")
            return _download(ref, files, common)
        if "config.json" not in sizes or not any(f.endswith(".safetensors") for f in sizes):
            raise ModelNotFoundError(f"{ref.repo} on {endpoint} has no GGUF file and no config.json with "
                                     f"safetensors weights to load")
        return Path(snapshot_download(ref.repo, allow_patterns=SAFETENSORS_PATTERNS, **common))
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"no model {ref.repo} on {endpoint}") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{ref.repo} on {endpoint} has no revision {ref.revision}") from None
    except (httpx2.TransportError, OfflineModeIsEnabled, HfHubHTTPError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return _from_cache(ref, cache, f"cannot reach {endpoint}: {first}")


def _from_cache(ref: HubRef, cache: str, why: str) -> Path:
    """``ref`` from the Hugging Face cache alone; ``why`` says why the Hub is not asked."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, IncompleteSnapshotError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(cache) / repo_folder_name(repo_id=ref.repo, repo_type="model")
    commit = ref.revision
    if not _COMMIT.fullmatch(commit):
        ref_file = storage / "refs" / ref.revision
        commit = ref_file.read_text().strip() if ref_file.is_file() else ""
    snapshot = storage / "snapshots" / commit
    missing = f"{ref}: not in the Hugging Face cache and {why}"
    if not commit or not snapshot.is_dir():
        raise ModelNotFoundError(missing)
    ggufs = {p.relative_to(snapshot).as_posix(): p.stat().st_size for p in snapshot.rglob("*.gguf") if p.exists()}
    common = {"revision": ref.revision, "cache_dir": cache, "local_files_only": True}
    try:
        if ggufs or ref.filename or ref.quant:
            files = _choose(ref, ggufs)
            if files is None:
                raise ModelNotFoundError(f"{missing} (cached: {_listing(ggufs)})")
            return _download(ref, files, common)
        return Path(snapshot_download(ref.repo, allow_patterns=SAFETENSORS_PATTERNS, **common))
    except (LocalEntryNotFoundError, IncompleteSnapshotError, CachedRepoTreeNotFoundError):
        raise ModelNotFoundError(missing) from None


def _download(ref: HubRef, files: list[str], common: dict) -> Path:
    """Every file of a model (one, or each part of a split one) through ``hf_hub_download``; the first's path."""
    from huggingface_hub import hf_hub_download

    return [Path(hf_hub_download(ref.repo, name, **common)) for name in files][0]


def _listing(files: dict[str, int] | list[str]) -> str:
    return ", ".join(sorted(files)) or "none"


def _matching(names: list[str], quant: str) -> list[str]:
    """The names holding ``quant`` as a whole word (``Q4_K`` is not ``Q4_K_M``), else as any part of them."""
    word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)
    return [n for n in names if word.search(n)] or [n for n in names if quant.lower() in n.lower()]


def _models(ggufs: dict[str, int]) -> dict[str, list[str]]:
    """The models among GGUF files (name -> bytes): a one-file model by its name, a split one by its first
    part's name -> its parts, first to last (:mod:`realizar.models.gguf_split`'s naming). A split model with a
    part missing from ``ggufs`` is left out."""
    groups: dict[tuple[str, str], list[str]] = {}
    out: dict[str, list[str]] = {}
    for name in sorted(ggufs):
        m = SPLIT_SUFFIX.search(name)
        if m is None:
            out[name] = [name]
        else:
            groups.setdefault((name[: m.start()], m[2]), []).append(name)
    for (_, count), parts in groups.items():
        if len(parts) == int(count):
            out[parts[0]] = parts
    return out


def _choose(ref: HubRef, ggufs: dict[str, int]) -> list[str] | None:
    """The GGUF files of ``ggufs`` (name -> bytes) that hold the model ``ref`` asks for: one file, or every part
    of a split model (first to last); None when none matches. Raises when several models do."""
    models = {first: parts for first, parts in _models(ggufs).items()
              if not Path(first).name.lower().startswith("mmproj")}  # (vision projectors)
    if ref.filename:
        return next((parts for parts in models.values() if ref.filename in parts), None)
    names = sorted(models)
    if ref.quant:
        picked = _matching(names, ref.quant)
    else:
        picked = next((m for q in DEFAULT_QUANTS if (m := _matching(names, q))), None) or names
    if not picked:
        return None
    if ref.quant and len(picked) > 1:
        raise ModelNotFoundError(f"{ref}: {len(picked)} files match ({_listing(picked)}): name one as "
                                 f"{ref.repo}/FILE")
    name = min(picked, key=lambda n: (sum(ggufs[p] for p in models[n]), n))
    if not ref.quant:
        more = f" and its {len(models[name]) - 1} further parts" if len(models[name]) > 1 else ""
        print(f"realizar: {ref.repo}: using {name}{more} (no :QUANT given: {' then '.join(DEFAULT_QUANTS)} first, "
              f"else the smallest of {len(names)} GGUF models)", file=sys.stderr, flush=True)
    return models[name]
