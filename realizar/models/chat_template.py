"""The one lookup of a model's chat template (Jinja source), for GGUF files and HF directories.

* GGUF: the metadata string ``tokenizer.chat_template``.
* HF directory, first found wins: ``chat_template.jinja`` (what transformers writes and prefers),
  ``tokenizer_config.json``'s ``chat_template``, ``chat_template.json``'s ``chat_template``.

A template given as a list of named templates (``[{"name": "default", "template": ...}, ...]``)
yields the one named ``default``, else the first. An empty template counts as none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from realizar.errors import ModelFormatError

__all__ = ["chat_template_from_gguf", "chat_template_from_hf", "template_from_config"]


def template_from_config(value: Any) -> str | None:
    """The template held by a ``chat_template`` value of a JSON config: a string, or a list of named
    templates (the ``default`` one, else the first); ``None`` for anything else or an empty string."""
    if isinstance(value, list):
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, Mapping)}
        value = named.get("default")
        if value is None and named:
            value = next(iter(named.values()))
    return value if isinstance(value, str) and value else None


def chat_template_from_gguf(metadata: Mapping[str, Any]) -> str | None:
    """The ``tokenizer.chat_template`` of GGUF metadata, or ``None``."""
    return template_from_config(metadata.get("tokenizer.chat_template"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from e


def chat_template_from_hf(directory: str | Path, tokenizer_config: Mapping[str, Any] | None = None) -> str | None:
    """The chat template of an HF-layout ``directory``. ``tokenizer_config`` is the parsed
    ``tokenizer_config.json`` when the caller has it (else the file is read if present). Unreadable
    files raise :class:`ModelFormatError`."""
    d = Path(directory)
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        try:
            text = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(f"cannot read {jinja}: {e}") from e
        if text:
            return text
    if tokenizer_config is None and (d / "tokenizer_config.json").is_file():
        tokenizer_config = _read_json(d / "tokenizer_config.json")
    if isinstance(tokenizer_config, Mapping):
        template = template_from_config(tokenizer_config.get("chat_template"))
        if template is not None:
            return template
    if (d / "chat_template.json").is_file():
        data = _read_json(d / "chat_template.json")
        if isinstance(data, Mapping):
            return template_from_config(data.get("chat_template"))
    return None
